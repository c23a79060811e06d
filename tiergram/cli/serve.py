"""`tiergram serve MODEL_DIR`: the OpenAI-compatible HTTP server (docs/serving.md)."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import asdict

from tiergram import settings
from tiergram.settings import CACHE_POLICIES, LOG_LEVELS, PLACEMENTS, ConfigError, ServeSettings


def byte_size(text: str) -> int:
    """'1048576', '512M', '1.5G', '64KiB' -> bytes (K, M, G, T are powers of 1024)."""
    try:
        return settings.byte_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The options people commonly set; each overrides its key of the --config file (docs/serving.md)."""
    c = p.add_argument_group("configuration")
    c.add_argument("--config", default=None, metavar="FILE",
                   help="a TOML or JSON file of every setting: [engine], [engram], [server] (docs/serving.md, "
                        "\"Configuration\"); the options below override it")
    c.add_argument("--engram-config", default=None, metavar="JSON|FILE",
                   help="per-layer placement, inline JSON or a file: {\"layers\": {\"1\": {\"tier\": \"host\"}, ...}} "
                        "(replaces the file's [engram])")
    g = p.add_argument_group("engine")
    g.add_argument("--placement", default=None, choices=PLACEMENTS,
                   help="where every layer's Engram table lives (default: host; mooncake: docs/remote.md)")
    g.add_argument("--mooncake-master", default=None, metavar="HOST:PORT",
                   help="the mooncake_master of the mooncake placement (each layer's table is pushed once)")
    g.add_argument("--cache-bytes", type=byte_size, default=None,
                   help="hot-row cache per layer of the file or mooncake placement, e.g. 64M")
    g.add_argument("--cache-policy", default=None, choices=CACHE_POLICIES, help="(default: lru)")
    g.add_argument("--hot-rows", default=None, metavar="PATH",
                   help="a hot-rows file (tiergram hot-rows): fill each cache with its table's most read rows at start")
    g.add_argument("--device", default=None, help="compute device: cpu (default), cuda, cuda:1, ..., or auto (cuda "
                   "when available, else cpu)")
    g.add_argument("--device-memory", type=byte_size, default=None,
                   help="device memory budget, e.g. 4G (default: CUDA's free memory; on the CPU 2G)")
    g.add_argument("--host-memory", type=byte_size, default=None,
                   help="host memory the Engram tables and the host K/V tier may use in all, e.g. 4G (default: none)")
    g.add_argument("--kv-host-fraction", type=float, default=None, metavar="F",
                   help="the share of --host-memory for K/V blocks evicted from the device (default: 0, none)")
    g.add_argument("--max-num-seqs", type=int, default=None, help="sequences in one batch at most (default: 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens in one step at most (default: 512)")
    g.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    g.add_argument("--torch-threads", type=int, default=None,
                   help="threads for torch's CPU ops (default 0: the CPUs less one, a core left to the HTTP loop)")
    g.add_argument("--engine-process", action="store_true", default=None,
                   help="the engine in a process of its own: no shared GIL; a crash leaves a server answering 503")


def settings_of(args: argparse.Namespace) -> ServeSettings:
    """The configuration file (or the defaults), then --engram-config, then each flag given, checked as one."""
    base = settings.load(args.config) if args.config else ServeSettings()
    raw = {"engine": asdict(base.engine), "server": asdict(base.server)}
    # a flag is named as the key it overrides (every other setting is a key of the file only)
    given = {key for keys in raw.values() for key in keys if getattr(args, key, None) is not None}
    for keys in raw.values():
        keys.update({key: getattr(args, key) for key in given & keys.keys()})
    if raw["server"]["api_key"] is None:
        raw["server"]["api_key"] = os.environ.get("TIERGRAM_API_KEY") or None
    try:
        out = settings.from_dict(raw, args.config or "the configuration")
    except ConfigError as e:  # a value a flag gave is named by its flag
        if e.key not in given:
            raise
        raise ConfigError(f"--{e.key.replace('_', '-')}: {e.detail}") from None
    out.engram = settings.engram_config(args.engram_config) if args.engram_config else base.engram
    return out


def engine_config(args: argparse.Namespace):
    """The EngineConfig the options describe."""
    from tiergram.engine import EngineConfig

    s = settings_of(args)
    return EngineConfig.from_settings(s, args.model_dir, _device(s.engine.device))


def _device(name: str) -> str:
    """'auto' -> cuda when torch sees a GPU, else cpu; any other name as resolve_device checks it."""
    from tiergram.tiers.device import resolve_device  # torch only when the command runs

    return str(resolve_device(name))


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                     "streaming, /metrics)")
    p.add_argument("model_dir", metavar="MODEL_DIR", help="model directory (host/file need its exported tables)")
    add_engine_args(p)
    s = p.add_argument_group("server (limits, deadlines and the rest of the edge: the --config file's [server])")
    s.add_argument("--host", default=None, help="address to bind (default: 127.0.0.1, loopback only)")
    s.add_argument("--port", type=int, default=None, help="port (default 8000; 0: a free one, printed when listening)")
    s.add_argument("--served-model-name", default=None, help="model name in the API (default: the engine's)")
    s.add_argument("--api-key", default=None,
                   help="a Bearer token every endpoint but /health and /metrics needs (default: $TIERGRAM_API_KEY)")
    s.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host header names answered, * for any (default: loopback names on a loopback "
                        "bind, else any)")
    s.add_argument("--log-level", default=None, choices=LOG_LEVELS, help="(default: info)")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from tiergram.engine import EngineConfig, LLMEngine, serving_torch_threads
    from tiergram.server import EngineProcess, EngineStartError, serve

    try:  # a bad setting, or an engine that cannot start (e.g. CUDA asked for without one): one line
        cfg = settings_of(args)
        e = cfg.engine
        threads = serving_torch_threads(e.torch_threads)
        engine_cfg = EngineConfig.from_settings(cfg, args.model_dir, _device(e.device))
        if e.engine_process:
            engine = EngineProcess(engine_cfg, torch_threads=threads)
        else:
            torch.set_num_threads(threads)
            engine = LLMEngine(engine_cfg)
    except (EngineStartError, RuntimeError, ImportError, KeyError, ValueError) as err:
        raise SystemExit(f"tiergram serve: error: {err}") from None
    print(f"tiergram serve: torch on {threads} CPU thread{'s' * (threads > 1)}"  # once started: an error stays one line
          + ("" if e.torch_threads else " (the CPUs less one; --torch-threads to change)"), file=sys.stderr, flush=True)
    return serve(engine, cfg.server)
