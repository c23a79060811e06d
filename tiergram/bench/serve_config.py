"""`tiergram bench serve`'s configuration: the placements it can sweep, the load's shape, the servers' labels."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

PLACEMENTS = ("device", "host", "file", "mooncake")
DEFAULT_PLACEMENTS = ("device", "host", "file")  # mooncake needs a master or a private network namespace


@dataclass
class SweepConfig:
    """What to sweep and how the load is shaped."""

    model_dir: str
    placements: tuple[str, ...] = DEFAULT_PLACEMENTS
    input_len: int = 128
    output_len: int = 32
    max_concurrency: int = 64
    requests_per_user: int = 4  # measured requests per point and round = this x concurrency
    warmup_per_user: int = 2  # warm-up requests per point = this x concurrency (before the first round)
    rounds: int = 3  # interleaved rounds per point: each placement in turn serves the same requests
    device_memory: int | None = None  # device memory budget of the engine (bytes)
    cache_fraction: float = 0.10  # file placement: host cache per layer, as a fraction of that layer's table
    cache_policy: str = "lru"  # the engine announces one step ahead: lookahead adds cost, not hits
    torch_threads: int = 0  # each server's torch CPU threads (0: torch's default)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    source: str = "auto"  # auto (corpus test split if built, else stdlib), corpus, stdlib
    corpus: str | None = None
    seed: int = 0
    plot: str | None = None
    markdown: str | None = None
    # file placement at several cache sizes, each its own server labelled file-<pct>% (None: cache_fraction alone)
    cache_fractions: tuple[float, ...] | None = None
    # a second model (larger tables) served as "file-big" with a per-layer cache of big_cache_bytes (None: file's)
    big_model_dir: str | None = None
    big_cache_bytes: int | None = None
    host_memory: int | None = None  # every server's --host-memory (bytes)
    mooncake_master: str | None = None  # HOST:PORT (None: a local cluster for the sweep, docs/remote.md)
    hot_rows: bool = False  # file and mooncake servers preload MODEL_DIR/hot_rows.npz
    engine: dict[str, Any] = field(default_factory=dict)  # more [engine] settings (`--config`), checked
    variants: dict[str, Variant] = field(default_factory=dict)  # more servers (`--variants FILE`)
    speed_probe_s: float = 0.25  # the CPU speed probe before and after each placement's round (0: none)
    # "requests", or "conversations" (load.Conversations): `turns` turns over `docs` documents, think_time_s apart
    workload: str = "requests"
    turns: int = 4
    docs: int = 8
    think_time_s: float = 0.2

    def __post_init__(self) -> None:
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad or not self.placements:
            raise ValueError(f"unknown placements {bad} (valid: {', '.join(PLACEMENTS)})")
        if min(self.input_len, self.output_len, self.max_concurrency, self.requests_per_user, self.rounds) < 1:
            raise ValueError("input_len, output_len, max_concurrency, requests_per_user and rounds must be >= 1")
        if self.workload not in ("requests", "conversations"):
            raise ValueError(f"unknown workload {self.workload!r} (valid: requests, conversations)")
        if self.cache_fractions is not None:
            self.cache_fractions = tuple(float(f) for f in self.cache_fractions)
        if not self.fractions or any(not 0 < f <= 1 for f in self.fractions):
            raise ValueError(f"cache_fractions must each be in (0, 1], got {self.fractions}")

    @property
    def fractions(self) -> tuple[float, ...]:
        """The file placement's cache fractions."""
        return self.cache_fractions or (self.cache_fraction,)

    def labels(self) -> list[str]:
        """Every server: the placements (file per cache fraction), variants after their base, file-big."""
        out = []
        for p in self.placements:
            if p == "file" and len(self.fractions) > 1:
                out += [file_label(f) for f in self.fractions]
            else:
                out.append(p)
        for name, v in self.variants.items():
            if v.base not in out:
                raise ValueError(f"variant {name!r}: base {v.base!r} is not a server of this sweep ({', '.join(out)})")
            if name in out or name == "file-big":
                raise ValueError(f"variant {name!r} has the name of another server of the sweep")
            at = out.index(v.base) + 1
            while at < len(out) and out[at] in self.variants:  # after the variants of the same base before it
                at += 1
            out.insert(at, name)
        for name, v in self.variants.items():
            if v.reference is not None and v.reference not in out:
                raise ValueError(f"variant {name!r}: reference {v.reference!r} is not a server of this sweep")
        if self.big_model_dir:
            out.append("file-big")
        return out

    def base_of(self, label: str) -> str:
        """The placement server a label runs: a variant's base, else the label itself."""
        return self.variants[label].base if label in self.variants else label

    def kind_of(self, label: str) -> str:
        """The placement kind a server runs (file-10% and file-big are file; a variant its base's kind)."""
        base = self.base_of(label)
        return "file" if base.startswith("file") else base


@dataclass
class Variant:
    """A server of the sweep that copies another (`base`) with some [engine] settings changed."""

    base: str  # the server it copies: device, host, file, file-N%, mooncake
    engine: dict[str, Any] = field(default_factory=dict)  # [engine] keys and values, checked (settings.py)
    reference: str | None = None  # the server a file variant's check is held against (None: host)


NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.%-]*")


def load_variants(path: str | os.PathLike) -> dict[str, Variant]:
    """A variants file (TOML, or JSON by suffix): [variants.NAME] with base, reference, [engine] keys."""
    from tiergram.settings import ConfigError, EngineSettings, read_file, section

    raw = read_file(path)
    if set(raw) != {"variants"} or not isinstance(raw["variants"], dict):
        raise ConfigError(f"{path}: expected only [variants.NAME] tables, got {sorted(raw)}")
    out = {}
    for name, body in raw["variants"].items():
        where = f"{path}: [variants.{name}]"
        if not NAME.fullmatch(name):
            raise ConfigError(f"{where}: a name is letters, digits and _.%-")
        if not isinstance(body, dict) or not isinstance(body.get("base"), str):
            raise ConfigError(f"{where}: needs base = the server it copies (device, host, file, file-N%, mooncake)")
        body = dict(body)
        base, reference, hot = body.pop("base"), body.pop("reference", None), body.pop("hot_rows", None)
        if hot is not None and not isinstance(hot, bool):
            raise ConfigError(f"{where}: hot_rows: expected true or false (the sweep's hot-rows file), got {hot!r}")
        for key in ("placement", "mooncake_master", "device"):  # the base's, or the sweep's
            if key in body:
                raise ConfigError(f"{where}: {key} is the base server's; make a variant of another base instead")
        engine = section(EngineSettings, body, where, partial=True)
        if hot is not None:
            engine["hot_rows"] = hot
        out[name] = Variant(base=base, engine=engine, reference=reference)
    return out


def file_label(fraction: float) -> str:
    """file-10% for a cache of 10% of the table."""
    return f"file-{100 * fraction:g}%"


def round_order(members: list[str], r: int) -> list[str]:
    """The servers' turns in round r, balanced over 2 x len(members) rounds (docs/serving.md)."""
    base = members if r % 2 == 0 else members[::-1]
    k = (r // 2) % max(1, len(members))
    return base[k:] + base[:k]
