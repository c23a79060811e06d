"""Does the table disk's I/O scheduler change what a page read costs? The native limit reader (O_DIRECT, QD 128,
random pages no earlier probe chose) reads TABLE in segments, alternating `mq-deadline` and `none` as the disk's
scheduler round by round (the order swapped every round), and reports pages/s, the reading process's CPU per page
and the whole machine's (busy time from /proc/stat: completions are handled in interrupt context on whichever
core takes them, so the process's own figure misses part of a read's cost).

    sudo python scripts/io_scheduler.py TABLE.tgram [--device vda] [--rounds 6] [--seconds 3]

Needs root (it writes /sys/block/DEV/queue/scheduler) and puts the scheduler it found back when it ends."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from tiergram.bench.file_lookup import LimitReader
from tiergram.format import TableFile

SCHEDULERS = ("mq-deadline", "none")


def machine_busy_s() -> float:
    """Seconds of CPU time the whole machine ran work of its own (all cores, /proc/stat at USER_HZ = 100)."""
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in
                                                         Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / 100.0  # not idle, iowait, or time the hypervisor stole


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--device", default="vda", help="the block device the table lives on (default vda)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--seconds", type=float, default=3.0)
    a = ap.parse_args()
    knob = Path(f"/sys/block/{a.device}/queue/scheduler")
    found = knob.read_text().split("[")[1].split("]")[0]
    reader = LimitReader(TableFile.open(a.table), 128)
    got: dict[str, list[tuple[float, float, float]]] = {s: [] for s in SCHEDULERS}
    try:
        for r in range(a.rounds):
            for sched in SCHEDULERS if r % 2 == 0 else SCHEDULERS[::-1]:
                knob.write_text(sched)
                busy = machine_busy_s()
                seg = reader.segment(a.seconds)
                machine = machine_busy_s() - busy
                got[sched].append((seg.pages / seg.seconds, 1e6 * seg.cpu / seg.pages, 1e6 * machine / seg.pages))
                print(f"round {r + 1} {sched:>11}: {got[sched][-1][0]:9,.0f} pages/s, process "
                      f"{got[sched][-1][1]:.2f} us/page, machine {got[sched][-1][2]:.2f} us/page", flush=True)
    finally:
        knob.write_text(found)
        reader.close()
    for i, what in enumerate(("pages/s", "process CPU per page", "machine CPU per page")):
        paired = [n[i] / d[i] for n, d in zip(got["none"], got["mq-deadline"], strict=True)]
        print(f"none / mq-deadline, {what}: median {statistics.median(paired):.3f} (rounds "
              + ", ".join(f"{x:.2f}" for x in paired) + ")")


if __name__ == "__main__":
    main()
