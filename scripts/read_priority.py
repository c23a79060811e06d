"""Does a CPU-busy machine slow the native page reader, and does a higher priority for the reading thread win it
back? The file tier (O_DIRECT, QD 128, no cache) looks up uniform ids of a table in a loop, in rounds of four
conditions: alone; beside a 2-thread torch loop (a stand-in for a serving step's compute) in another process;
beside it with the reading thread at nice -10 (needs CAP_SYS_NICE or RLIMIT_NICE); beside it with the torch loop at
nice 5 instead (what any user may do).

    python scripts/read_priority.py TABLE.tgram [--seconds 4] [--rounds 3]

Prints each round's pages/s (rows read ~ pages read: uniform ids rarely share a page) and each condition's median
over the rounds against reading alone. Use a table larger than the page cache's share of memory; the reads are
O_DIRECT either way."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np

from tiergram.store.table import TieredTable

TORCH_LOOP = ("import time, torch\ntorch.set_num_threads(2)\na = torch.randn(384, 384)\nend = time.time() + {s}\n"
              "while time.time() < end:\n    a = torch.tanh(a @ a * 0.01)\n")
CONDITIONS = ("alone", "beside torch", "beside torch, reader nice -10", "beside torch at nice 5")


def pages_per_s(table: TieredTable, rng: np.random.Generator, seconds: float, nice: int) -> float:
    """Rows/s of 256-position lookups of uniform ids, this thread at `nice` meanwhile."""
    tid = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except PermissionError:
        print(f"nice {nice} refused (needs CAP_SYS_NICE or RLIMIT_NICE): read at {before}", file=sys.stderr)
    try:
        rows, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            ids = rng.integers(0, int(table.table.head_rows.min()), size=(256, table.num_heads))
            table.lookup(ids)
            rows += ids.size
        return rows / (time.perf_counter() - t0)
    finally:
        os.setpriority(os.PRIO_PROCESS, tid, before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", help="a .tgram table file")
    ap.add_argument("--seconds", type=float, default=4.0, help="seconds per condition per round")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    table = TieredTable(a.table, tier="file", queue_depth=128)
    rng = np.random.default_rng(1)
    got: dict[str, list[float]] = {c: [] for c in CONDITIONS}
    try:
        for r in range(a.rounds):
            got["alone"].append(pages_per_s(table, rng, a.seconds, 0))
            for cond in CONDITIONS[1:]:
                loop = subprocess.Popen([sys.executable, "-c", TORCH_LOOP.format(s=a.seconds + 1.5)],
                                        preexec_fn=(lambda: os.nice(5)) if "at nice 5" in cond else None)
                time.sleep(1.0)  # torch's threads running before the reads start
                got[cond].append(pages_per_s(table, rng, a.seconds, -10 if "nice -10" in cond else 0))
                loop.wait()
            print(f"round {r + 1}: " + ", ".join(f"{c} {v[-1]:,.0f}" for c, v in got.items()) + " pages/s", flush=True)
    finally:
        table.close()
    alone = float(np.median(got["alone"]))
    for cond, v in got.items():
        print(f"{cond:<32} {np.median(v):>9,.0f} pages/s  {np.median(v) / alone:.2f}x alone")


if __name__ == "__main__":
    main()
