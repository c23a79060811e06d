"""`tiergram bench ...`: benchmarks that print ratios against limits measured in the same run."""

from __future__ import annotations

import argparse

from tiergram.bench import lookup


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (lookup, ...)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    lk = bsub.add_parser("lookup", help="row lookup rate against the memcpy-gather limit and numpy")
    lk.add_argument("--tier", default="host", choices=["host"], help="tier to read from")
    lk.add_argument("--positions", type=int, default=2048, help="token positions per lookup call")
    lk.add_argument("--rows-per-head", type=int, default=65537)
    lk.add_argument("--heads", type=int, default=24)
    lk.add_argument("--codec", default="fp8_e4m3")
    lk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="output dtype")
    lk.add_argument("--threads", type=int, default=0, help="native threads (0: all cores)")
    lk.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement")
    lk.add_argument("--json", action="store_true", help="print one JSON object")
    lk.set_defaults(func=cmd_lookup)


def cmd_lookup(args: argparse.Namespace) -> int:
    cfg = lookup.LookupBenchConfig(heads=args.heads, rows_per_head=args.rows_per_head, codec=args.codec,
                                   positions=args.positions, dtype=args.dtype, min_time=args.min_time,
                                   threads=args.threads)
    res = lookup.run(cfg, progress=not args.json)
    print(lookup.to_json(res) if args.json else lookup.to_text(res))
    return 0
