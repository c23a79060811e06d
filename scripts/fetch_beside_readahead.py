"""A step's fetch beside a read-ahead on the same reader: what `PageReader.yield_depth` buys and costs.

    python scripts/fetch_beside_readahead.py TABLE.tgram [--fetch-pages 190] [--rounds 4]

One native O_DIRECT reader at QD 128 (as a table's fetch and read-ahead queues share one). The foreground reads
N random pages every 5 ms (a step's fetch between steps' compute); a background thread reads 3,072-page batches
(a 128-token prompt's misses at the V4.1 geometry) with `background=True`, giving way at yield_depth 0 (never), 32
and 8. Settings are interleaved in rounds of 1 s each, and every round also measures the disk's own limit (the same
reader alone, random pages at QD 128) in the same minute. Prints each setting's fetch time over the fetch alone, and
the read-ahead's and both together's pages/s over the disk's limit. Use a table whose pages the disk's cache does
not hold (docs/planner.md, session 14), and nothing else running.
"""
import argparse
import statistics
import threading
import time

import numpy as np

from tiergram import _native
from tiergram.format.reader import TableFile
from tiergram.tiers.aligned import aligned_empty

AHEAD = 3072  # pages per read-ahead call
GAP_S = 0.005  # the step's compute between fetches
SETTINGS = ("alone", 0, 32, 8)  # no read-ahead, then its yield_depth (0: never gives way)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("table")
    ap.add_argument("--fetch-pages", type=int, default=190, help="pages per fetch (190: c = 8 at the V4.1 geometry)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=1.0, help="per setting per round")
    args = ap.parse_args()
    table = TableFile.open(args.table)
    m = table.manifest
    rng = np.random.default_rng()
    reader = _native.PageReader(str(table.path), table.data_offset, m.page_size, m.n_pages, queue_depth=128)
    fetch_out = aligned_empty(args.fetch_pages * m.page_size)
    ahead_out = aligned_empty(AHEAD * m.page_size)
    fetch_s = {k: [] for k in SETTINGS}
    ahead_rate = {k: [] for k in SETTINGS[1:]}
    limits = []

    for r in range(args.rounds):
        n, t0 = 0, time.perf_counter()  # the disk's limit this round
        while time.perf_counter() - t0 < args.seconds:
            reader.read_pages(rng.integers(0, m.n_pages, AHEAD), ahead_out, verify=False)
            n += AHEAD
        limits.append(n / (time.perf_counter() - t0))
        for setting in SETTINGS:
            stop, pages = threading.Event(), [0]

            def read_ahead(stop: threading.Event = stop, pages: list[int] = pages) -> None:
                while not stop.is_set():
                    reader.read_pages(rng.integers(0, m.n_pages, AHEAD), ahead_out, verify=False, background=True)
                    pages[0] += AHEAD

            worker = None
            if setting != "alone":
                reader.yield_depth = setting
                worker = threading.Thread(target=read_ahead)
                worker.start()
                time.sleep(0.05)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                f0 = time.perf_counter()
                reader.read_pages(rng.integers(0, m.n_pages, args.fetch_pages), fetch_out)
                fetch_s[setting].append(time.perf_counter() - f0)
                time.sleep(GAP_S)
            wall = time.perf_counter() - t0
            stop.set()
            if worker is not None:
                worker.join()
                ahead_rate[setting].append(pages[0] / (wall + 0.05))
        print(f"round {r + 1}/{args.rounds}: disk limit {limits[-1]:,.0f} pages/s", flush=True)

    limit = statistics.median(limits)
    alone = float(np.median(fetch_s["alone"]))
    print(f"\n{args.table}: fetch of {args.fetch_pages} pages; the disk's limit (QD 128, this reader alone) "
          f"{limit:,.0f} pages/s, median of {args.rounds} rounds")
    for k in SETTINGS:
        t = np.array(fetch_s[k])
        name = "no read-ahead" if k == "alone" else f"yield_depth {k}"
        line = (f"{name:>14}: fetch median {np.median(t) * 1e3:6.2f} ms "
                f"(p90 {np.percentile(t, 90) * 1e3:6.2f}), {np.median(t) / alone:4.2f}x alone")
        if k != "alone":
            ahead = statistics.median(ahead_rate[k])
            both = ahead + args.fetch_pages / (float(np.mean(t)) + GAP_S)
            line += f"; read-ahead {ahead:,.0f} pages/s, both {both:,.0f} pages/s = {both / limit:.2f} of the limit"
        print(line)


if __name__ == "__main__":
    main()
