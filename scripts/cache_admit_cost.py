"""CPU per key of a full LRU native row cache admitting batches of new keys: the cold-cache path's admission
(index insert + eviction + the row's copy), which `bench lookup`'s cold 10% cache / no cache CPU ratio pays.

    python scripts/cache_admit_cost.py [--rounds 5] [--capacity 786432] [--batch 6144]

Each round admits 1 s of batches of never-seen keys into a cache already full of other keys; prints ns of this
process's CPU per key, each round and the median. (`NativeRowCache.admit` also removes duplicates within a call,
which the fetch pipeline's admission skips.)"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tiergram.cache.native import NativeRowCache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--capacity", type=int, default=786_432, help="slots (786,432 x 264 B: 10%% of a 2 GiB table)")
    ap.add_argument("--batch", type=int, default=6144, help="keys per admit call (256 positions x 24 heads)")
    ap.add_argument("--row-bytes", type=int, default=264)
    args = ap.parse_args()
    cap, batch = args.capacity, args.batch
    cache = NativeRowCache(cap, args.row_bytes)
    rng = np.random.default_rng(0)
    rows = rng.integers(0, 255, (batch * 16, args.row_bytes), dtype=np.uint8)  # staged rows, reused in turn
    for s in range(0, cap, batch):
        keys = np.arange(s, min(cap, s + batch), dtype=np.int64)
        cache.admit(keys, rows[: len(keys)])
    nxt, out = cap, []
    for _ in range(args.rounds):
        n, end, c0 = 0, time.perf_counter() + 1.0, time.process_time()
        while time.perf_counter() < end:
            keys = nxt + rng.permutation(batch).astype(np.int64) * 7  # new keys, in no order
            nxt += batch * 7
            off = (n // batch) % 16 * batch
            cache.admit(keys, rows[off: off + batch])
            n += batch
        out.append(1e9 * (time.process_time() - c0) / n)
    print("admit, ns of CPU per key, per 1-s round:", " ".join(f"{x:.0f}" for x in out),
          f"median {np.median(out):.0f}")


if __name__ == "__main__":
    main()
