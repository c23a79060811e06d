"""`tiergram serve MODEL_DIR`: the OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

import argparse
import os
import sys

# mirror engine.config.PLACEMENT_KINDS and cache.POLICIES (kept here so that `tiergram --help` imports no torch;
# tests/test_one_of_each.py checks that they agree)
PLACEMENTS = ("device", "host", "file", "mooncake")
CACHE_POLICIES = ("lru", "lookahead", "lfu")
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def byte_size(text: str) -> int:
    """'1048576', '512M', '1.5G', '64KiB' -> bytes (K, M, G, T are powers of 1024)."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)]) * UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size like 1048576, 512M or 2G, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative size, got {text!r}")
    return int(value)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options shared by `serve` (placement, memory budget, batching, queue)."""
    g = p.add_argument_group("engine")
    g.add_argument("--placement", default="host", choices=PLACEMENTS,
                   help="where the Engram tables live: device (resident), host (DRAM), file (SSD) or mooncake "
                        "(Mooncake Store at --mooncake-master, docs/remote.md)")
    g.add_argument("--mooncake-master", default="", metavar="HOST:PORT",
                   help="the mooncake_master of the mooncake placement (each layer's table is pushed once)")
    g.add_argument("--cache-bytes", type=byte_size, default=0,
                   help="hot-row cache of the file or mooncake placement, e.g. 64M")
    g.add_argument("--cache-policy", default="lru", choices=CACHE_POLICIES)
    g.add_argument("--no-read-ahead", dest="read_ahead", action="store_false",
                   help="do not read the next step's prompt rows into the file placement's cache ahead of time")
    g.add_argument("--no-prompt-rows-first", dest="prompt_rows_first", action="store_false",
                   help="let a new prompt join the batch at once instead of once its rows are read into the cache "
                        "(then running sequences' steps wait for those reads)")
    g.add_argument("--no-early-decode-reads", dest="early_decode_reads", action="store_false",
                   help="read a decode step's rows from the step's entry instead of as soon as the step before "
                        "sampled its tokens")
    g.add_argument("--hot-rows", default=None, metavar="PATH",
                   help="a hot-rows file (tiergram hot-rows): fill the file or mooncake placement's cache with each "
                        "table's most read rows at start, as many as it holds")
    g.add_argument("--no-fixed-buffers", dest="fixed_buffers", action="store_false",
                   help="read the file placement's pages plainly instead of into io_uring-registered staging "
                        "buffers (READ_FIXED saves the kernel pinning each page; docs/benchmarks.md)")
    g.add_argument("--no-read-ahead-yield", dest="read_ahead_yields", action="store_false",
                   help="let the file placement's read-ahead keep its whole queue depth at the disk while a step's "
                        "rows are read (by default it keeps 8 reads there meanwhile, so the step's reads do not queue "
                        "behind it)")
    g.add_argument("--engine-core", action="store_true",
                   help="run the engine's step thread alone on the first CPU this process may use and every other "
                        "thread (the HTTP loop, the file placement's page reads) on the rest, so that neither takes "
                        "the step's core (needs 2 CPUs; not with --engine-process; docs/serving.md)")
    g.add_argument("--read-nice", type=int, default=0, metavar="N",
                   help="run the file placement's page-read threads at nice N (-20..19; below 0 needs CAP_SYS_NICE): "
                        "on a machine whose cores the step's compute fills, a read completion then gets a core at "
                        "once and the disk's queue stays full (docs/serving.md)")
    g.add_argument("--mooncake-busy-waits", dest="low_priority_waits", action="store_false",
                   help="let the mooncake placement's store calls wait on the caller's thread at normal priority "
                        "(Mooncake's client spins until a transfer completes; by default it spins at the lowest "
                        "CPU priority, docs/remote.md)")
    g.add_argument("--codec", default="fp8_e4m3", choices=["fp8_e4m3", "bf16", "fp32", "int8"],
                   help="table file codec (exported on first use)")
    g.add_argument("--device", default="cpu", help="compute device: cpu, cuda, cuda:1, ..., or auto (cuda when "
                   "available, else cpu)")
    g.add_argument("--device-memory", type=byte_size, default=None,
                   help="device memory budget for weights, resident tables, activations and K/V, e.g. 4G "
                        "(default: CUDA's free memory; on the CPU $TIERGRAM_DEVICE_BYTES or 2G)")
    g.add_argument("--host-memory", type=byte_size, default=None,
                   help="host memory the Engram tables may use in all, e.g. 4G, split evenly over the layers: a host "
                        "placement must fit it; a file placement's cache (unless --cache-bytes), staging and index are "
                        "sized to it (default: no limit)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per K/V block")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences in one batch at most")
    g.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens in one step at most")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--max-waiting", type=int, default=256, help="waiting requests at most; more are answered 429")
    g.add_argument("--torch-threads", type=int, default=0,
                   help="threads for torch's CPU ops (0: the CPUs less one, which leaves a core to the HTTP server "
                        "and the Engram reads; on 2 cores one thread served 1.02-1.49x what two did at c <= 4)")


def engine_config(args: argparse.Namespace):
    """The EngineConfig the options describe."""
    from tiergram.engine import EngineConfig, Placement

    placement = Placement(kind=args.placement, cache_bytes=args.cache_bytes, cache_policy=args.cache_policy,
                          codec=args.codec, master=args.mooncake_master if args.placement == "mooncake" else "",
                          fixed_buffers=getattr(args, "fixed_buffers", True),
                          read_ahead_yields=getattr(args, "read_ahead_yields", True),
                          read_nice=getattr(args, "read_nice", 0),
                          low_priority_waits=getattr(args, "low_priority_waits", True))
    return EngineConfig(model_dir=args.model_dir, placement=placement, device=_device(args.device),
                        device_memory_bytes=args.device_memory, block_size=args.block_size,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, max_waiting=args.max_waiting, read_ahead=args.read_ahead,
                        prompt_rows_first=getattr(args, "prompt_rows_first", True),
                        early_decode_reads=getattr(args, "early_decode_reads", True),
                        host_memory_bytes=getattr(args, "host_memory", None),
                        hot_rows=getattr(args, "hot_rows", None))


def _device(name: str) -> str:
    """'auto' -> cuda when torch sees a GPU, else cpu; any other name as resolve_device checks it."""
    from tiergram.tiers.device import resolve_device  # torch only when the command runs

    return str(resolve_device(name))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                     "streaming, /metrics)")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (host/file need its exported tables)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000, help="port (0: a free one, printed when listening)")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: the engine's)")
    s.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds SIGTERM waits for in-flight requests before exiting")
    s.add_argument("--engine-process", action="store_true",
                   help="run the engine in a process of its own instead of on a thread of the HTTP process: the two "
                        "then share no GIL, and an engine that crashes leaves a server answering 503 (docs/serving.md)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    lim = p.add_argument_group("request limits (docs/serving.md, \"Limits and failure behaviour\")")
    lim.add_argument("--max-body-bytes", type=byte_size, default=1 << 20, help="request body size; beyond: 413")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="prompt text characters (default: 32 x the context length); beyond: 400")
    lim.add_argument("--max-stop", type=int, default=4, help="stop strings per request")
    lim.add_argument("--max-stop-chars", type=int, default=256, help="characters of one stop string")
    lim.add_argument("--unhealthy-after", type=int, default=8,
                     help="engine steps failing in a row before /health answers 503 unhealthy")
    lim.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                     help="seconds a request's headers may take from its first byte; beyond: 408 and closed")
    lim.add_argument("--body-timeout", type=float, default=30.0, metavar="S",
                     help="seconds a request's whole body may take after its headers; beyond: 408 and closed")
    lim.add_argument("--max-connections", type=int, default=1024,
                     help="open connections; more are answered 503 (Retry-After) and closed at once")
    lim.add_argument("--max-reading", type=int, default=256,
                     help="requests still reading their body or being tokenized; more are answered 429 (Retry-After)")
    acc = p.add_argument_group("access (docs/serving.md, \"Access\")")
    acc.add_argument("--api-key", default=os.environ.get("TIERGRAM_API_KEY"),
                     help="a Bearer token every endpoint but --public-paths needs (default: $TIERGRAM_API_KEY; "
                          "none: no key needed)")
    acc.add_argument("--public-paths", default="/health,/metrics",
                     help="comma-separated paths served without the API key")
    acc.add_argument("--allowed-hosts", default=None,
                     help="comma-separated Host header names the server answers to, * for any (default: on a "
                          "loopback bind localhost and loopback addresses only, so DNS rebinding is refused; on any "
                          "other bind any)")
    acc.add_argument("--cors-origins", default="",
                     help="comma-separated origins a browser page may call the API from, * for any (default: none; "
                          "a request from any other origin is refused 403)")
    acc.add_argument("--debug", action="store_true",
                     help="error bodies carry exception text, file paths and tracebacks (else only the log does)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from tiergram.engine import LLMEngine, serving_torch_threads
    from tiergram.server import EngineProcess, EngineStartError, serve
    from tiergram.server.edge import Edge
    from tiergram.server.protocol import Limits

    if args.torch_threads < 0:
        raise SystemExit(f"tiergram serve: error: --torch-threads must be >= 0, got {args.torch_threads}")
    threads = serving_torch_threads(args.torch_threads)
    for name in ("max_body_bytes", "max_prompt_chars", "max_stop", "max_stop_chars", "unhealthy_after",
                 "header_timeout", "body_timeout", "max_connections", "max_reading"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise SystemExit(f"tiergram serve: error: --{name.replace('_', '-')} must be >= 1, got {value}")
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
                    max_stop=args.max_stop, max_stop_chars=args.max_stop_chars)
    edge = Edge(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                max_connections=args.max_connections, max_reading=args.max_reading, api_key=args.api_key or None,
                public_paths=_names(args.public_paths), allowed_hosts=_names(args.allowed_hosts),
                cors_origins=_names(args.cors_origins), debug=args.debug)
    engine_cpu = None
    if getattr(args, "engine_core", False):
        from tiergram.server.affinity import keep_off_engine_core, split_cpus

        if args.engine_process:
            raise SystemExit("tiergram serve: error: --engine-core pins this process's engine thread; "
                             "--engine-process runs the engine elsewhere")
        if threads > 1:  # OpenMP starts its workers from the step thread: they would share its one CPU
            raise SystemExit(f"tiergram serve: error: --engine-core needs torch on one thread (the step thread's "
                             f"CPU), got --torch-threads {threads}")
        try:
            engine_cpu, others = split_cpus()
        except ValueError as e:
            raise SystemExit(f"tiergram serve: error: {e}") from None
        keep_off_engine_core(others)  # before the engine starts its read threads
    try:
        if args.engine_process:
            engine = EngineProcess(engine_config(args), torch_threads=threads)
        else:
            torch.set_num_threads(threads)
            engine = LLMEngine(engine_config(args))
    except (EngineStartError, RuntimeError, ImportError, KeyError) as e:  # e.g. CUDA asked for without one: one
        raise SystemExit(f"tiergram serve: error: {e}") from None                 # line, no traceback
    print(f"tiergram serve: torch on {threads} CPU thread{'s' * (threads > 1)}"  # once started: an error stays one line
          + ("" if args.torch_threads else " (the CPUs less one; --torch-threads to change)")
          + ("" if engine_cpu is None else f"; the engine thread alone on CPU {engine_cpu}, the rest on "
             f"{sorted(os.sched_getaffinity(0))}"), file=sys.stderr, flush=True)
    return serve(engine, host=args.host, port=args.port, log_level=args.log_level,
                 drain_timeout_s=args.drain_timeout, model_name=args.served_model_name, limits=limits,
                 unhealthy_after=args.unhealthy_after, engine_cpu=engine_cpu, edge=edge)


def _names(text: str | None) -> tuple[str, ...] | None:
    """'a, b,' -> ('a', 'b'); None stays None."""
    return None if text is None else tuple(n.strip() for n in text.split(",") if n.strip())
