"""`tiergram serve`'s whole configuration as typed sections, from a TOML or JSON file, flags on top (docs/serving.md,
"Configuration"). Imports nothing heavy: `tiergram --help` and the `bench serve` client build these too."""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import numbers
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

# the names engine.config accepts too (defined here, torch-free, for the CLI and the config files)
PLACEMENTS = ("device", "host", "file", "mooncake")
CACHE_POLICIES = ("lru", "lookahead", "lfu")
CODECS = ("fp8_e4m3", "bf16", "fp32", "int8")
FILE_MODES = ("direct", "buffered", "mmap")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
# keys whose value is a byte count: an integer, or a size string like "512M"
SIZE_KEYS = {"cache_bytes", "device_memory", "host_memory", "max_body_bytes"}
SCALARS = {bool: ("true or false", bool), int: ("an integer", int), float: ("a number", (int, float)),
           str: ("a string", str)}
# keys that take one of a few names
CHOICES = {"placement": PLACEMENTS, "tier": PLACEMENTS, "cache_policy": CACHE_POLICIES, "codec": CODECS,
           "file_mode": FILE_MODES, "log_level": LOG_LEVELS}


class ConfigError(ValueError):
    """A configuration value not allowed, named where it came from (`key` at fault, `detail`: what is wrong)."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None) -> None:
        super().__init__(message)
        self.key, self.detail = key, detail

    @classmethod
    def field(cls, obj: Any, key: str, detail: str) -> ConfigError:
        """The error of obj's field `key` ("EngineConfig.max_waiting must be ...")."""
        return cls(f"{type(obj).__name__}.{key} {detail}", key, detail)


def byte_size(text: str | int) -> int:
    """1048576, '1048576', '512M', '1.5G', '64KiB' -> bytes (K, M, G, T are powers of 1024); ValueError otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        value: float = text
    else:
        t = str(text).strip().lower().removesuffix("ib").removesuffix("b")
        unit = t[-1:] if t[-1:] in UNITS else ""
        try:
            value = float(t[: len(t) - len(unit)]) * UNITS[unit]
        except ValueError:
            raise ValueError(f"expected a size like 1048576, 512M or 2G, got {text!r}") from None
    if value < 0:
        raise ValueError(f"expected a non-negative size, got {text!r}")
    return int(value)


@dataclass(kw_only=True)
class EngineShared:
    """The settings [engine] and the engine's own EngineConfig share, under the same names, checked here once."""

    device: str = "cpu"  # cpu, cuda, cuda:N or auto
    block_size: int = 16  # K/V cache block, in tokens
    max_num_seqs: int = 64  # running sequences at most
    max_num_batched_tokens: int = 512  # tokens per step: decodes first, then prefill chunks
    max_model_len: int | None = None  # prompt + output tokens (None: the model's)
    max_waiting: int = 256  # the bounded waiting queue: more requests are refused (QueueFullError, 429)
    kv_host_fraction: float = 0.0  # of the host memory, for K/V blocks evicted from the device (0: no host tier)
    prefix_caching: bool = True  # share full K/V blocks between requests with the same prefix (docs/engine.md)
    hot_rows: str | None = None  # a hot-rows file (tiergram hot-rows): each cache starts full of its most read rows

    def check_shared(self, host_memory: str) -> None:
        """ConfigError for the first shared setting out of range (`host_memory`: the host budget's field)."""
        at_least(self, 1, "block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", host_memory)
        at_least(self, 0, "max_waiting")
        f = self.kv_host_fraction  # the host K/V tier takes this share of the host memory, for cached prefix blocks
        if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 <= f < 1:
            raise ConfigError.field(self, "kv_host_fraction", f"must be a number in [0, 1), got {f!r}")
        if f and getattr(self, host_memory) is None:
            raise ConfigError.field(self, "kv_host_fraction", f"needs {host_memory}: the host K/V tier takes a share")
        if f and not self.prefix_caching:
            raise ConfigError.field(self, "kv_host_fraction", "needs prefix_caching: the host K/V tier keeps prefixes")


@dataclass
class EngineSettings(EngineShared):
    """[engine]: the engine, the one placement of every Engram layer (unless [engram] names each), its process."""

    placement: str = "host"  # device | host | file | mooncake
    cache_bytes: int = 0  # file / mooncake: hot-row cache per layer
    cache_policy: str = "lru"
    read_ahead: bool = True  # file / mooncake: rows read into the cache before their step (docs/engine.md)
    codec: str = "fp8_e4m3"  # table file codec (exported on first use)
    file_mode: str = "direct"  # file: direct (O_DIRECT) | buffered | mmap
    mooncake_master: str = ""  # mooncake: HOST:PORT of the mooncake_master
    device_memory: int | None = None  # the device budget (None: CUDA's free memory; CPU: $TIERGRAM_DEVICE_BYTES, 2G)
    host_memory: int | None = None  # for the Engram tables and the host K/V tier in all (None: no limit)
    torch_threads: int = 0  # 0: the CPUs less one
    engine_process: bool = False  # the engine in a process of its own

    def check(self) -> None:
        self.check_shared("host_memory")
        at_least(self, 0, "torch_threads")
        if self.placement == "mooncake" and not self.mooncake_master:
            raise ConfigError("placement 'mooncake' needs mooncake_master (HOST:PORT of the mooncake_master)")


@dataclass
class LayerSettings:
    """One Engram layer's placement (`[engram.layers.N]`); what it leaves out comes from [engine]."""

    tier: str  # device | host | file | mooncake
    cache_bytes: int | None = None
    cache_policy: str | None = None
    read_ahead: bool | None = None

    def check(self) -> None:
        if self.cache_bytes and self.tier not in ("file", "mooncake"):  # the one check, engine.config's Placement too
            raise ConfigError(f"a {self.tier} layer holds its whole table: cache_bytes is for tiers file and mooncake")


@dataclass
class EngramSettings:
    """[engram]: per-layer placement, {layer index: LayerSettings}."""

    layers: dict[int, LayerSettings] = field(default_factory=dict)


@dataclass
class ServerSettings:
    """[server]: the HTTP server, its edge and what one request may ask for (docs/serving.md, "Limits")."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free one, printed when listening
    served_model_name: str | None = None  # None: the engine's
    log_level: str = "info"
    drain_timeout: float = 60.0  # seconds SIGTERM waits for in-flight requests
    unhealthy_after: int = 8  # engine steps failing in a row before /health says unhealthy
    api_key: str | None = None  # the Bearer token every path but public_paths needs (serve: $TIERGRAM_API_KEY)
    public_paths: list[str] = field(default_factory=lambda: ["/health", "/metrics"])
    allowed_hosts: list[str] | None = None  # Host header names answered ("*": any); None: see for_bind
    cors_origins: list[str] = field(default_factory=list)  # origins a browser page may call from ("*": any)
    debug: bool = False  # error bodies carry exception text and tracebacks (else only the log does)
    header_timeout: float = 10.0  # seconds for a request's headers, from its first byte (408 beyond)
    body_timeout: float = 30.0  # seconds for its whole body, from its headers (408 beyond)
    max_connections: int = 1024  # open connections; more are answered 503 at once
    max_reading: int = 256  # requests reading their body or being tokenized; more are answered 429 at once
    max_body_bytes: int = 1 << 20  # request body (413 beyond)
    max_prompt_chars: int | None = None  # prompt text, chat messages included (None: 32 x the context length)
    max_stop: int = 4  # stop strings
    max_stop_chars: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_messages: int = 1024  # chat messages
    max_temperature: float = 2.0  # as OpenAI's API

    def check(self) -> None:
        at_least(self, 1, "max_body_bytes", "max_prompt_chars", "max_stop", "max_stop_chars", "max_stop_token_ids",
                 "max_messages", "unhealthy_after", "max_connections", "max_reading")
        at_least(self, 0, "port")
        for name in ("drain_timeout", "header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError.field(self, name, f"must be > 0, got {getattr(self, name)!r}")
        if not self.max_temperature >= 0:
            raise ConfigError.field(self, "max_temperature", f"must be >= 0, got {self.max_temperature!r}")

    def prompt_chars(self, max_model_len: int) -> int:
        """The prompt-text limit for a model of this context length."""
        return self.max_prompt_chars if self.max_prompt_chars is not None else 32 * max_model_len

    def for_bind(self, host: str) -> ServerSettings:
        """These settings bound to `host`: unset allowed hosts become any name off a loopback bind."""
        if self.allowed_hosts is not None or is_loopback(host):
            return self
        return dataclasses.replace(self, allowed_hosts=["*"])


def is_loopback(host: str) -> bool:
    """Whether a bind address or Host name is this machine: localhost, *.localhost, 127.0.0.0/8, ::1."""
    host = host.strip("[]").lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class ServeSettings:
    """Everything `tiergram serve` runs with."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    engram: EngramSettings = field(default_factory=EngramSettings)
    server: ServerSettings = field(default_factory=ServerSettings)

    def to_dict(self) -> dict[str, Any]:
        """The JSON-able object `load` reads back (None values left out: a TOML file cannot say None)."""
        return _drop_none({"engine": dataclasses.asdict(self.engine), "server": dataclasses.asdict(self.server),
                           "engram": {"layers": {str(k): dataclasses.asdict(v)
                                                 for k, v in self.engram.layers.items()}}})


def read_file(path: str | os.PathLike, where: str = "") -> dict[str, Any]:
    """A TOML file's table (JSON by its .json suffix); ConfigError naming `where` (default the path) if unreadable."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except (OSError, ValueError) as e:  # tomllib.TOMLDecodeError and json's errors are ValueErrors
        raise ConfigError(f"{where or path}: not a readable TOML or JSON file ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where or path}: expected a table of sections, got {type(raw).__name__}")
    return raw


def load(path: str | os.PathLike) -> ServeSettings:
    """A serve configuration file (TOML, or JSON by its .json suffix); ConfigError naming file, section and key."""
    return from_dict(read_file(path), str(path))


def from_dict(raw: Any, where: str = "the configuration") -> ServeSettings:
    """ServeSettings from a file's table (read_file's): only [engine], [engram] and [server], each key checked."""
    unknown = set(raw) - {"engine", "engram", "server"}
    if unknown:
        raise ConfigError(f"{where}: unknown sections {sorted(unknown)} (valid: engine, engram, server)")
    return ServeSettings(engram=engram_from(raw.get("engram", {}), f"{where}: [engram]"),
                         engine=section(EngineSettings, raw.get("engine", {}), f"{where}: [engine]"),
                         server=section(ServerSettings, raw.get("server", {}), f"{where}: [server]"))


def engram_from(raw: Any, where: str) -> EngramSettings:
    """[engram] (or --engram-config): {"layers": {"N": {"tier": ..., ...}}}."""
    if not isinstance(raw, dict) or set(raw) - {"layers"}:
        raise ConfigError(f"{where}: expected {{\"layers\": {{\"N\": {{\"tier\": ...}}}}}}, got {raw!r}")
    layers = raw.get("layers", {})
    if not isinstance(layers, dict):
        raise ConfigError(f"{where}: layers must map a layer index to its placement, got {layers!r}")
    out = {}
    for key, value in layers.items():
        try:
            index = int(key)
        except ValueError:
            raise ConfigError(f"{where}: layer {key!r} is not a layer index") from None
        out[index] = section(LayerSettings, value, f"{where} layer {index}")
    return EngramSettings(layers=out)


def engram_config(text: str) -> EngramSettings:
    """`--engram-config`: inline JSON, or the path of a JSON or TOML file holding the same object."""
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--engram-config: not valid JSON ({e})") from None
        return engram_from(raw, "--engram-config")
    raw = read_file(text, f"--engram-config {text}")
    return engram_from(raw.get("engram", raw), text)


def section(cls: type, raw: Any, where: str, partial: bool = False) -> Any:
    """A settings dataclass from a dict, every key converted and checked (partial: only the dict of those given)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)  # the dataclass's fields and their types
    values = {}
    for key, value in raw.items():
        if key not in hints:
            raise ConfigError(f"{where}: unknown key {key!r} (valid: {', '.join(hints)})")
        try:
            values[key] = convert(key, hints[key], value)
        except ValueError as e:
            raise ConfigError(f"{where}: {key}: {e}", key, str(e)) from None
    if partial:
        return values
    try:
        obj = cls(**values)
    except TypeError as e:  # a required key left out
        raise ConfigError(f"{where}: {e}") from None
    try:
        obj.check()
    except ConfigError as e:
        raise ConfigError(f"{where}: {e.key}: {e.detail}" if e.key else f"{where}: {e}", e.key, e.detail) from None
    return obj


def convert(key: str, hint: Any, value: Any) -> Any:
    """One value to its field's type (size strings for byte counts; names checked against their choices)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
    if key in SIZE_KEYS:
        return byte_size(value)
    if typing.get_origin(hint) is list:
        if isinstance(value, str):  # "a, b" as from a flag
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ValueError(f"expected a list of strings, got {value!r}")
        return list(value)
    what, accepted = SCALARS[hint]
    if not isinstance(value, accepted) or isinstance(value, bool) != (hint is bool):
        raise ValueError(f"expected {what}, got {value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ValueError(f"{value!r} is not one of {', '.join(CHOICES[key])}")
    return float(value) if hint is float else value


def at_least(obj: Any, low: int, *names: str) -> None:
    """ConfigError for the first of obj's fields `names` that is set (not None) but not an integer >= low."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low):
            raise ConfigError.field(obj, name, f"must be an integer >= {low}, got {value!r}")


def _drop_none(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_none(v) for k, v in obj.items() if v is not None}
    return obj
