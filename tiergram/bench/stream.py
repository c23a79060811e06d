"""A stand-in for K/V swap traffic: copy K/V-sized blocks through host memory at a set rate, until stopped.

`python -m tiergram.bench.stream --rate-gbps 2` beside a `tiergram bench serve --placements host` sweep measures
what host-memory traffic other than the Engram table's does to the host placement (docs/planner-validation.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

import numpy as np


def stream(rate_bps: float, block_bytes: int, pool_bytes: int, seconds: float | None = None,
           report: bool = True) -> float:
    """Copy blocks at rate_bps (read + write) for `seconds` (None: until interrupted); returns the rate reached."""
    if rate_bps <= 0 or block_bytes <= 0 or pool_bytes < block_bytes:
        raise ValueError(f"rate ({rate_bps}), block ({block_bytes}) must be > 0 and the pool ({pool_bytes}) "
                         "at least one block")
    n = pool_bytes // block_bytes
    src = np.ones((n, block_bytes), dtype=np.uint8)  # K/V blocks at rest in host memory
    dst = np.empty((n, block_bytes), dtype=np.uint8)  # where a swap puts them
    moved, t0, last, i = 0, time.perf_counter(), time.perf_counter(), 0
    try:
        while seconds is None or time.perf_counter() - t0 < seconds:
            np.copyto(dst[i % n], src[(i * 7919) % n])  # a stride through the pool: no block stays in cache
            moved += 2 * block_bytes
            i += 1
            ahead = moved / rate_bps - (time.perf_counter() - t0)
            if ahead > 0:
                time.sleep(ahead)
            now = time.perf_counter()
            if report and now - last >= 1.0:
                print(f"{moved / (now - t0) / 1e9:.2f} GB/s", flush=True)
                last = now
    except KeyboardInterrupt:
        pass
    return moved / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> int:
    """Entry point: python -m tiergram.bench.stream."""
    p = argparse.ArgumentParser(prog="python -m tiergram.bench.stream", description=__doc__.splitlines()[0])
    p.add_argument("--rate-gbps", type=float, required=True, help="bytes moved per second (read + write), in GB/s")
    p.add_argument("--block-mib", type=float, default=16.0, help="one K/V block swap, MiB (default 16)")
    p.add_argument("--pool-mib", type=float, default=1024.0, help="the K/V pool streamed through, MiB (default 1024)")
    p.add_argument("--seconds", type=float, default=None, help="stop after this long (default: until interrupted)")
    a = p.parse_args(argv)
    # stopped by SIGTERM or SIGINT alike (a background job of a script ignores SIGINT)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    got = stream(a.rate_gbps * 1e9, int(a.block_mib * 2**20), int(a.pool_mib * 2**20), a.seconds)
    print(f"streamed at {got / 1e9:.2f} GB/s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
