"""Does the table's volume serve blocks it served recently faster than others? (a cache under the VM's disk)

Each round reads `--pages` random 4 KiB pages of TABLE no probe chose before (the native reader, QD 128, O_DIRECT:
the guest's page cache is not involved), then the same pages again in the same order; a device without a cache
in front gives both the same rate. Usage: python scripts/reread_probe.py TABLE [--pages 20000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tiergram.bench.file_lookup import reread_rates
from tiergram.format import TableFile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--pages", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    table = TableFile.open(a.table)
    print(f"{a.table}: {table.manifest.n_pages:,} pages")
    ratios = []
    for r in range(a.rounds):
        fresh, again = reread_rates(table, a.pages)
        ratios.append(again / fresh)
        print(f"{time.strftime('%H:%M:%S')} round {r + 1}: new pages {fresh:9,.0f} pages/s, the same pages again "
              f"{again:9,.0f} pages/s ({again / fresh:.2f}x)", flush=True)
    print(f"re-read / new, median of {a.rounds}: {float(np.median(ratios)):.2f}x")


if __name__ == "__main__":
    main()
