"""`tiergram bench ...`: benchmarks that print ratios against limits measured in the same run."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from tiergram.bench import cache, lookup
from tiergram.cli.common import add_common, config_from
from tiergram.cli.serve import CACHE_POLICIES, byte_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks (lookup, ...)")
    bsub = p.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    lk = bsub.add_parser("lookup", help="row lookup rate: host tier against the same-bytes gather limit and numpy; "
                                        "file tier against the device's limit and Python threads")
    lk.add_argument("--tier", default="host", choices=["host", "file", "mooncake"],
                    help="tier to read from (mooncake: side by side with Mooncake's EngramStore, docs/remote.md)")
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
                    help="seconds per measurement over all rounds (default: 1 host; file: 4 per reader)")
    fg = lk.add_argument_group("file tier")
    lk.add_argument("--table-gib", type=float, default=None,
                    help="size of the benchmark table file (file: default 2, created once; host: rows per head to "
                         "fit, created at disk speed and removed afterwards unless --keep-table)")
    lk.add_argument("--keep-table", action="store_true", help="host: keep the --table-gib table in the bench cache")
    fg.add_argument("--table", default=None, help="table file path (default: in the bench cache folder)")
    fg.add_argument("--queue-depths", type=_ints, default=(1, 32, 128),
                    help="queue depths of the limit measurement, comma-separated")
    fg.add_argument("--queue-depth", type=int, default=128, help="queue depth of tiergram's reader")
    fg.add_argument("--py-threads", type=_ints, default=(8, 16), help="Python thread counts of the baseline")
    lk.add_argument("--rounds", type=int, default=None,
                    help="interleaved segments per measurement; the best is kept (default 4; mooncake: 12, i.e. "
                         "36 timed calls per point: with 12, one point's ratio moved by +-20%% between runs)")
    fg.add_argument("--backend", default="auto", choices=["auto", "io_uring", "threads"], help="native reader")
    add_common(lk, "--json")
    lk.set_defaults(func=cmd_lookup)
    ca = bsub.add_parser("cache", help="cache policy hit rates on a real token stream against the offline optimum")
    d = cache.CacheBenchConfig()  # each option's default is the config's (dest: its field)
    add_common(ca, "--corpus")
    ca.add_argument("--split", default=d.split, choices=["train", "validation", "test"])
    ca.add_argument("--tokens", dest="max_tokens", metavar="TOKENS", type=int, default=d.max_tokens,
                    help="tokens of text replayed")
    ca.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt tokens per request (prefilled)")
    ca.add_argument("--decode-len", type=int, default=d.decode_len,
                    help="tokens per request after the prompt (decoded)")
    ca.add_argument("--max-seqs", type=int, default=d.max_seqs, help="requests running at once")
    ca.add_argument("--step-tokens", type=int, default=d.step_tokens, help="token budget of one step (chunked prefill)")
    ca.add_argument("--max-ngram", dest="max_ngram_size", metavar="MAX_NGRAM", type=int, default=d.max_ngram_size,
                    help="n-gram orders 2..N")
    ca.add_argument("--heads", dest="n_head_per_ngram", metavar="HEADS", type=int, default=d.n_head_per_ngram,
                    help="hash heads per n-gram order")
    ca.add_argument("--table-factor", type=int, default=d.table_factor,
                    help="rows per head ~ this x the compressed vocabulary")
    ca.add_argument("--rows-per-head", type=int, default=d.rows_per_head,
                    help="rows per head (DeepSeek-V4.1: about 16000000); overrides --table-factor")
    ca.add_argument("--capacity-of", default=d.capacity_of, choices=["touched", "table"],
                    help="capacities as fractions of the distinct rows the stream touches, or of the table")
    ca.add_argument("--capacities", type=float, nargs="+", default=d.capacities,
                    help="cache sizes as fractions of the distinct rows the stream touches")
    ca.add_argument("--policies", nargs="+", default=d.policies, choices=list(cache.ALL_POLICIES),
                    help="cache policies to replay (lru-hot: LRU started full of the rows the corpus's train split "
                         "reads most, as `serve --hot-rows`; needs the corpus)")
    ca.add_argument("--window", type=int, default=d.window, help="steps the lookahead policy is told ahead")
    add_common(ca, "--seed", "--plot", "--json")
    ca.set_defaults(func=cmd_cache)

    pf = bsub.add_parser("prefetch", help="stall a compute loop still sees with prefetch, against a synchronous "
                                          "lookup (host tier, file tier, file tier + cache)")
    pf.add_argument("--stores", type=_names, default=("host", "file", "file+cache"),
                    help="comma-separated: host, file, file+cache")
    pf.add_argument("--positions", type=int, default=64, help="token positions per step (x heads rows)")
    pf.add_argument("--steps", type=int, default=200)
    pf.add_argument("--warmup", type=int, default=10, help="steps before the measured ones")
    pf.add_argument("--dist", default="zipf", choices=["uniform", "zipf"], help="row id distribution")
    pf.add_argument("--cache-fraction", type=float, default=0.10, help="host cache of file+cache, of the table")
    pf.add_argument("--cache-policy", default="lru", choices=CACHE_POLICIES)
    pf.add_argument("--compute-ms", type=float, default=0.0,
                    help="compute per step (0: per store, about its synchronous fetch time)")
    pf.add_argument("--hidden", type=int, default=512, help="width of the compute's matmuls")
    pf.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for the compute (1 leaves a core to the fetch on 2 cores)")
    pf.add_argument("--table-gib", type=float, default=2.0, help="table size (the file lookup bench's table)")
    pf.add_argument("--rows-per-head", type=int, default=0, help="rows per head (0: as many as --table-gib holds)")
    pf.add_argument("--heads", type=int, default=24)
    pf.add_argument("--dim", type=int, default=256)
    pf.add_argument("--table", default=None, help="table file path (default: in the bench cache folder)")
    add_common(pf, "--json")
    pf.set_defaults(func=cmd_prefetch)

    tb = bsub.add_parser("table", help="create / verify / open a large V4.1-geometry table against this disk's "
                                       "sequential write and read limits, measured in the same run")
    tb.add_argument("--table-gib", type=float, default=8.0, help="table size in GiB")
    tb.add_argument("--keep", action="store_true", help="keep the table file (default: removed at the end)")
    add_common(tb, "--dir", "--json")
    tb.set_defaults(func=cmd_table)

    im = bsub.add_parser("import", help="`tiergram import` of a synthetic DeepSeek-V4.1-layout checkpoint against this "
                                        "disk's copy rate measured in the same run, and its peak memory")
    im.add_argument("--gib", type=float, default=16.0, help="checkpoint size in GiB (both Engram tables)")
    im.add_argument("--rounds", type=int, default=2, help="rounds of copy and import, order alternating")
    add_common(im, "--dir", "--json")
    im.set_defaults(func=cmd_import)

    sv = bsub.add_parser("serve", help="throughput vs interactivity of the real HTTP server per table placement "
                                       "(closed-loop streaming clients, pareto fronts, acceptance ratios)")
    sv.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (its tables are exported on first use)")
    sv.add_argument("--config", default=None, metavar="FILE",
                    help="a serve configuration (TOML or JSON, docs/serving.md) whose [engine] every server runs "
                         "with; the placement is each server's own")
    sv.add_argument("--variants", dest="variants_file", default=None, metavar="FILE",
                    help="more servers: [variants.NAME] copies server `base` with [engine] settings changed "
                         "(docs/serving.md, \"Comparing settings\"; an example: docs/variants.toml)")
    sv.add_argument("--placements", type=_names, default=("device", "host", "file"),
                    help="comma-separated: device, host, file, mooncake (docs/remote.md)")
    sv.add_argument("--input-len", type=int, default=128, help="prompt tokens: uniform in [0.8 L, L]")
    sv.add_argument("--output-len", type=int, default=32, help="output tokens: uniform in [0.8 L, L]")
    sv.add_argument("--max-concurrency", type=int, default=64, help="highest concurrency (also capped by the engine)")
    sv.add_argument("--requests-per-user", type=int, default=4,
                    help="measured requests per point and round: this x concurrency")
    sv.add_argument("--warmup-per-user", type=int, default=2, help="warm-up requests per point = this x concurrency")
    sv.add_argument("--rounds", type=int, default=3,
                    help="interleaved rounds per point: the servers take turns on the same requests")
    sv.add_argument("--cache-fractions", type=_fractions, default=(0.10,),
                    help="file placement: host cache per layer as a fraction of that layer's table; several make a "
                         "server each (file-1%%, file-10%%, ...), e.g. 0.01,0.1 (default 0.1)")
    sv.add_argument("--big-model", dest="big_model_dir", default=None, metavar="DIR",
                    help="also serve this model (same backbone, larger tables, e.g. larger than RAM) with the file "
                         "placement, as file-big")
    sv.add_argument("--big-cache-bytes", type=byte_size, default=None,
                    help="file-big's host cache per layer (default: the same bytes as the first file placement's)")
    sv.add_argument("--hot-rows", action="store_true",
                    help="file and mooncake servers preload their cache with MODEL_DIR/hot_rows.npz (`tiergram "
                         "hot-rows`)")
    sv.add_argument("--source", default="auto",
                    help="replayed text: auto (the corpus test split when built, else the Python stdlib's source), "
                         "corpus, stdlib, or a corpus folder")
    sv.add_argument("--workload", default="requests", choices=["requests", "conversations"],
                    help="requests: one-shot requests cut from the text; conversations: multi-turn sessions over "
                         "shared documents, the reuse prefix caching serves (docs/benchmarks.md)")
    sv.add_argument("--markdown", default=None, help="also write the table to this markdown file")
    add_common(sv, "--seed", "--plot", "--json")
    sv.set_defaults(func=cmd_serve)
    po = bsub.add_parser("pool", help="one acceptance check's paired round ratios pooled over several `bench serve "
                                      "--json` runs, with bootstrap 95%% intervals")
    po.add_argument("sweeps", nargs="+", metavar="SWEEP_JSON", help="the JSON `tiergram bench serve --json` printed")
    po.add_argument("--check", default="file_vs_host", help="the check's key in the JSON's checks (file_vs_host, "
                    "host_vs_device, file-10%%_vs_host, ...)")
    add_common(po, "--json")
    po.set_defaults(func=cmd_pool)

    sp = bsub.add_parser("split", help="a `bench serve --workload conversations` sweep read as the split of one host "
                                       "budget between Engram tables and the host K/V tier: table, plot, best split")
    sp.add_argument("sweep", metavar="SWEEP_JSON", help="the JSON `tiergram bench serve --json` printed")
    add_common(sp, "--plot", "--json")
    sp.set_defaults(func=cmd_split)

    sk = bsub.add_parser("soak", help="the server under fuzzing, hostile input, 2x overload, disconnects, storage "
                                      "faults and kill -9 (docs/serving.md, \"Limits and failure behaviour\")")
    sk.add_argument("model_dir", metavar="MODEL_DIR", nargs="?", default=None,
                    help="model directory (default: the demo's trained model)")
    sk.add_argument("--requests", type=int, default=10_000, help="requests of the overload soak (RSS measured)")
    sk.add_argument("--slow-clients", type=int, default=500,
                    help="slow clients holding connections beside normal requests (0: skip that phase)")
    sk.add_argument("--slow-only", action="store_true", help="run the slow-client phase alone")
    add_common(sk, "--seed", "--json")
    sk.set_defaults(func=cmd_soak)


def _numbers(cast: type, valid: Callable[[float], bool], what: str) -> Callable[[str], tuple]:
    """An option type: comma-separated numbers, each cast and valid (else an error naming `what` was expected)."""
    def parse(text: str) -> tuple:
        try:
            values = tuple(cast(v) for v in text.split(",") if v.strip())
        except ValueError:
            values = ()
        if not values or not all(valid(v) for v in values):
            raise argparse.ArgumentTypeError(f"expected comma-separated {what}, got {text!r}")
        return values
    return parse


_ints = _numbers(int, lambda v: v >= 1, "positive integers")
_fractions = _numbers(float, lambda v: 0 < v <= 1, "fractions in (0, 1] like 0.01,0.1")


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _run(bench: ModuleType, cfg: object, args: argparse.Namespace) -> object:
    """bench.run(cfg) with its report printed: bench.to_json with --json, else bench.to_text (progress on stderr)."""
    res = bench.run(cfg, progress=not args.json)
    print(bench.to_json(res) if args.json else bench.to_text(res))
    return res


def cmd_lookup(args: argparse.Namespace) -> int:
    if args.rounds is None:
        args.rounds = 12 if args.tier == "mooncake" else 4
    if args.tier == "mooncake":
        from tiergram.bench import remote  # optional dependency (the remote extra)

        return remote.cmd_lookup(args)
    if args.tier == "host":
        _run(lookup, lookup.LookupBenchConfig(
            heads=args.heads, rows_per_head=args.rows_per_head or 65537, dim=args.dim, codec=args.codec,
            positions=args.positions or 2048, dtype=args.dtype, rounds=args.rounds,
            seconds=(args.min_time or 1.0) / args.rounds, threads=args.threads, table_gib=args.table_gib,
            keep_table=args.keep_table), args)
        return 0
    from tiergram import _native
    from tiergram.bench import file_lookup

    if args.threads:
        _native.set_num_threads(args.threads)
    _run(file_lookup, file_lookup.FileLookupBenchConfig(
        table_gib=args.table_gib or 2.0, heads=args.heads, rows_per_head=args.rows_per_head or 0, dim=args.dim,
        codec=args.codec, positions=args.positions or 256, queue_depths=args.queue_depths,
        store_queue_depth=args.queue_depth, py_threads=args.py_threads, min_time=args.min_time or 4.0,
        rounds=args.rounds, dtype=args.dtype, backend=args.backend, table=args.table), args)
    return 0


def cmd_prefetch(args: argparse.Namespace) -> int:
    from tiergram.bench import prefetch

    _run(prefetch, config_from(prefetch.PrefetchBenchConfig, args), args)
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    _run(cache, config_from(cache.CacheBenchConfig, args), args)
    return 0


def cmd_table(args: argparse.Namespace) -> int:
    from tiergram.bench import table_io
    from tiergram.paths import cache_dir

    r = table_io.run(args.table_gib, Path(args.dir or cache_dir("bench")), progress=not args.json, keep=args.keep)
    print(json.dumps(r) if args.json else table_io.report(r))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from tiergram.bench import import_bench
    from tiergram.paths import cache_dir

    r = import_bench.run(args.gib, Path(args.dir or cache_dir("bench-import")), rounds=args.rounds)
    print(json.dumps(r, indent=1) if args.json else import_bench.report(r))
    return 0 if r["ratio_median"] >= 0.8 and r["peak_rss_bytes"] <= 2**30 else 1


# the [engine] keys of `bench serve --config` that are SweepConfig fields (the planner reads them from the sweep)
SWEEP_ENGINE_KEYS = ("device_memory", "host_memory", "cache_policy", "torch_threads", "max_num_seqs",
                     "max_num_batched_tokens", "block_size", "mooncake_master")


def sweep_config(args: argparse.Namespace):
    """The SweepConfig `bench serve`'s options and files describe."""
    from dataclasses import replace

    from tiergram.bench import serve
    from tiergram.settings import ConfigError, EngineSettings, read_file, section

    engine: dict = {}
    if args.config:
        path, raw = args.config, read_file(args.config)
        if set(raw) - {"engine"}:
            raise ConfigError(f"{path}: bench serve takes [engine] alone (the servers' placements are the sweep's), "
                              f"got {sorted(raw)}")
        engine = section(EngineSettings, raw.get("engine", {}), f"{path}: [engine]", partial=True)
        if "placement" in engine:
            raise ConfigError(f"{path}: [engine] placement: each server's is the sweep's (--placements)")
    fields = {k: engine.pop(k) for k in SWEEP_ENGINE_KEYS if k in engine}
    fields["mooncake_master"] = fields.get("mooncake_master") or None
    fractions, known = args.cache_fractions, args.source in ("auto", "corpus", "stdlib")
    return replace(config_from(serve.SweepConfig, args), cache_fraction=fractions[0],
                   cache_fractions=fractions if len(fractions) > 1 else None, engine=engine,
                   variants=serve.load_variants(args.variants_file) if args.variants_file else {},
                   source=args.source if known else "corpus", corpus=None if known else args.source, **fields)


def cmd_serve(args: argparse.Namespace) -> int:
    from tiergram.bench import serve

    cfg = sweep_config(args)  # a bad file or option: a ValueError, said by `tiergram` (exit status 2)
    cfg.labels()  # a variant of a server the sweep does not run: said before any server starts
    if "mooncake" in cfg.placements and not cfg.mooncake_master:
        from tiergram.bench.mooncake_cluster import private_netns, run_in_netns

        if not private_netns():  # Mooncake's clients listen on every interface: fence the local cluster
            return run_in_netns([sys.executable, "-m", "tiergram", *sys.argv[1:]]).returncode
    try:
        _run(serve, cfg, args)
    except RuntimeError as e:  # a server that did not start, or a request that failed: say which, no traceback
        print(f"tiergram: error: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_split(args: argparse.Namespace) -> int:
    from tiergram.bench import split

    try:
        points, table = split.report(args.sweep, args.plot)
    except (OSError, ValueError, KeyError) as e:
        print(f"tiergram: error: {args.sweep}: not a split sweep ({type(e).__name__}: {e})", file=sys.stderr)
        return 1
    print(split.to_json(points) if args.json else table)
    return 0


def cmd_pool(args: argparse.Namespace) -> int:
    from tiergram.bench.serve_stats import pool_rounds

    try:
        sweeps = [json.loads(Path(path).read_text()) for path in args.sweeps]
        pooled = pool_rounds(sweeps, args.check, args.sweeps)
    except (OSError, ValueError, AttributeError, KeyError) as e:
        print(f"tiergram: error: not a set of bench serve JSONs with check {args.check!r}: {e}", file=sys.stderr)
        return 1
    target = sweeps[0]["checks"][args.check].get("target")
    if args.json:
        print(json.dumps({"check": args.check, "runs": args.sweeps, "target": target, "points": pooled}, indent=2))
        return 0
    print(f"{args.check}, paired round ratios pooled over {len(sweeps)} runs" +
          (f" (target {target:g})" if target else "") + ":")
    for c, p in pooled.items():
        print(f"  c={c:<3} {p['rounds']:>3} rounds  median {p['median']:.3f} [{p['median_lo']:.3f}, "
              f"{p['median_hi']:.3f}]  geometric mean {p['geomean']:.3f} [{p['geomean_lo']:.3f}, "
              f"{p['geomean_hi']:.3f}]  (bootstrap 95%)")
    return 0


def cmd_soak(args: argparse.Namespace) -> int:
    from tiergram.bench import soak
    from tiergram.paths import cache_dir

    args.model_dir = args.model_dir or str(cache_dir("models") / "demo-small")
    if not Path(args.model_dir, "config.json").is_file():
        raise ValueError(f"no model at {args.model_dir}: give MODEL_DIR (or run `tiergram demo` first)")
    if args.slow_only and args.slow_clients < 1:
        raise ValueError(f"--slow-only measures slow clients: give --slow-clients >= 1, got {args.slow_clients}")
    try:
        res = _run(soak, config_from(soak.SoakConfig, args), args)
    except RuntimeError as e:  # a server that did not start: say which, no traceback
        print(f"tiergram: error: {e}", file=sys.stderr)
        return 1
    return 0 if all(soak.checks(res).values()) else 1
