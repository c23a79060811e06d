"""CPU per key of a full LRU native row cache admitting batches of new keys: the cold-cache path's admission
(index insert + eviction + the row's copy), which `bench lookup`'s 10% cache / no cache CPU ratio pays, against
the data movement no admission avoids, measured in the same rounds: the same rows copied into random slots of an
array of the cache's size (numpy fancy-index assignment).

    python scripts/cache_admit_cost.py [--rounds 5] [--capacity 786432] [--batch 6144]

Each round admits 1 s of batches of never-seen keys into a cache already full of other keys, then copies 1 s of
the same batches into random slots; prints ns of this process's CPU per key for both, their ratio per round, and
the medians. (`NativeRowCache.admit` also removes duplicates within a call, which the fetch pipeline's admission
skips.)"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np

from tiergram.cache.native import NativeRowCache


def cpu_ns_per_key(step: Callable[[int], None], batch: int, seconds: float = 1.0) -> float:
    """Process CPU ns per key of calling step(i) (one batch of `batch` keys each) for `seconds` of wall time."""
    n, end, c0 = 0, time.perf_counter() + seconds, time.process_time()
    while time.perf_counter() < end:
        step(n // batch)
        n += batch
    return 1e9 * (time.process_time() - c0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=786_432, help="slots (786,432 x 264 B: 10%% of a 2 GiB table)")
    ap.add_argument("--batch", type=int, default=6144, help="keys per admit call (256 positions x 24 heads)")
    ap.add_argument("--row-bytes", type=int, default=264)
    args = ap.parse_args()
    cap, batch = args.capacity, args.batch
    cache = NativeRowCache(cap, args.row_bytes)
    slots = np.ones((cap, args.row_bytes), dtype=np.uint8)  # the copy baseline's slots (written: no first faults)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 255, (batch * 16, args.row_bytes), dtype=np.uint8)  # staged rows, reused in turn
    for s in range(0, cap, batch):
        keys = np.arange(s, min(cap, s + batch), dtype=np.int64)
        cache.admit(keys, rows[: len(keys)])
    nxt = cap

    def admit(i: int) -> None:
        nonlocal nxt
        keys = nxt + rng.permutation(batch).astype(np.int64) * 7  # new keys, in no order
        nxt += batch * 7
        off = i % 16 * batch
        cache.admit(keys, rows[off: off + batch])

    def copy(i: int) -> None:
        off = i % 16 * batch
        slots[rng.integers(0, cap, batch)] = rows[off: off + batch]

    admits, copies = [], []
    for _ in range(args.rounds):
        admits.append(cpu_ns_per_key(admit, batch))
        copies.append(cpu_ns_per_key(copy, batch))
    ratios = [a / c for a, c in zip(admits, copies, strict=True)]
    print("admit, ns of CPU per key, per 1-s round:", " ".join(f"{x:.0f}" for x in admits),
          f"median {np.median(admits):.0f}")
    print("copy into random slots (baseline):      ", " ".join(f"{x:.0f}" for x in copies),
          f"median {np.median(copies):.0f}")
    print("admit / copy, per round:", " ".join(f"{x:.2f}" for x in ratios), f"median {np.median(ratios):.2f}")


if __name__ == "__main__":
    main()
