"""`tiergram bench ...`: benchmarks that print ratios against limits measured in the same run."""

from __future__ import annotations

import argparse

from tiergram.bench import lookup


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (lookup, ...)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    lk = bsub.add_parser("lookup", help="row lookup rate: host tier against the memcpy-gather limit and numpy; "
                                        "file tier against the device's limit, Python threads and mmap")
    lk.add_argument("--tier", default="host", choices=["host", "file"], help="tier to read from")
    lk.add_argument("--positions", type=int, default=None,
                    help="token positions per lookup call (default: 2048 host, 256 file)")
    lk.add_argument("--rows-per-head", type=int, default=None,
                    help="rows per head (default: 65537 host; file: as many as --table-gib holds)")
    lk.add_argument("--heads", type=int, default=24)
    lk.add_argument("--dim", type=int, default=256)
    lk.add_argument("--codec", default="fp8_e4m3")
    lk.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="output dtype")
    lk.add_argument("--threads", type=int, default=0, help="native threads (0: all cores)")
    lk.add_argument("--min-time", type=float, default=None,
                    help="seconds per measurement (default: 1 host; file: 4 per reader, over all rounds)")
    fg = lk.add_argument_group("file tier")
    fg.add_argument("--table-gib", type=float, default=2.0, help="size of the benchmark table file (created once)")
    fg.add_argument("--table", default=None, help="table file path (default: in the bench cache folder)")
    fg.add_argument("--queue-depths", type=_ints, default=(1, 32, 128),
                    help="queue depths of the limit measurement, comma-separated")
    fg.add_argument("--queue-depth", type=int, default=128, help="queue depth of tiergram's reader")
    fg.add_argument("--py-threads", type=_ints, default=(8, 16), help="Python thread counts of the baseline")
    fg.add_argument("--rounds", type=int, default=4, help="interleaved segments per reader; the best is kept")
    fg.add_argument("--backend", default="auto", choices=["auto", "io_uring", "threads"], help="native reader")
    lk.add_argument("--json", action="store_true", help="print one JSON object")
    lk.set_defaults(func=cmd_lookup)


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def cmd_lookup(args: argparse.Namespace) -> int:
    if args.tier == "file":
        return cmd_lookup_file(args)
    cfg = lookup.LookupBenchConfig(heads=args.heads, rows_per_head=args.rows_per_head or 65537, dim=args.dim,
                                   codec=args.codec, positions=args.positions or 2048, dtype=args.dtype,
                                   min_time=args.min_time or 1.0, threads=args.threads)
    res = lookup.run(cfg, progress=not args.json)
    print(lookup.to_json(res) if args.json else lookup.to_text(res))
    return 0


def cmd_lookup_file(args: argparse.Namespace) -> int:
    from tiergram import _native
    from tiergram.bench import file_lookup

    if args.threads:
        _native.set_num_threads(args.threads)
    cfg = file_lookup.FileLookupBenchConfig(
        table_gib=args.table_gib, heads=args.heads, rows_per_head=args.rows_per_head or 0, dim=args.dim,
        codec=args.codec, positions=args.positions or 256, queue_depths=args.queue_depths,
        store_queue_depth=args.queue_depth, py_threads=args.py_threads, min_time=args.min_time or 4.0,
        rounds=args.rounds, dtype=args.dtype, backend=args.backend, table=args.table)
    res = file_lookup.run(cfg, progress=not args.json)
    print(file_lookup.to_json(res) if args.json else file_lookup.to_text(res))
    return 0
