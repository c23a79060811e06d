"""Engine configuration as plain dataclasses: sampling, per-layer table placement, the engine itself."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

from tiergram.engine.validate import check_max_tokens
from tiergram.settings import (
    CACHE_POLICIES,
    CODECS,
    FILE_MODES,
    PLACEMENTS,
    EngineShared,
    LayerSettings,
    ServeSettings,
    at_least,
)


def serving_torch_threads(requested: int = 0) -> int:
    """torch's CPU threads for a serving engine: `requested`, or (0) the CPUs less one (docs/serving.md)."""
    if requested < 0:
        raise ValueError(f"torch threads must be >= 0, got {requested}")
    if requested:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus - 1)


@dataclass
class SamplingParams:
    """How one request's tokens are chosen and when it stops."""

    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    top_k: int = 0  # 0: all tokens
    seed: int | None = None  # None: a fresh random seed per request
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # replay: emit exactly these tokens (max_tokens becomes their count; eos and stop tokens do not end it)
    forced_tokens: list[int] | None = None

    def __post_init__(self) -> None:
        if self.forced_tokens is not None:
            self.forced_tokens = [int(t) for t in self.forced_tokens]
            self.max_tokens = len(self.forced_tokens)
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        self.validate()

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ValueError naming the first bad field (token ids checked against vocab_size when given)."""
        if self.forced_tokens is not None and not self.forced_tokens:
            raise ValueError("forced_tokens is empty: give at least one token, or None to sample")
        check_max_tokens(self.max_tokens)
        if not self.temperature >= 0:  # also refuses NaN
            raise ValueError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        at_least(self, 0, "top_k")
        if self.seed is not None and (isinstance(self.seed, bool) or int(self.seed) != self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if vocab_size is not None:
            for name in ("stop_token_ids", "forced_tokens"):
                bad = [t for t in getattr(self, name) or [] if not 0 <= t < vocab_size]
                if bad:
                    raise ValueError(f"{name} holds {bad[0]}, outside the vocabulary [0, {vocab_size})")


@dataclass
class Placement:
    """Where one Engram layer's table lives and how it is encoded."""

    kind: str  # "device" (resident in compute-device memory), "host" (DRAM), "file" (SSD, O_DIRECT)
    cache_bytes: int = 0  # file only: host cache of encoded rows
    cache_policy: str = "lru"  # file only: lru | lfu | lookahead (the engine announces one step ahead only)
    codec: str = "fp8_e4m3"  # table file codec: fp32 | bf16 | int8 | fp8_e4m3
    file_mode: str = "direct"  # file only: direct (O_DIRECT) | buffered | mmap
    master: str = ""  # mooncake only: HOST:PORT of the mooncake_master holding the table (docs/remote.md)
    # file / mooncake: read rows into the cache ahead of their step; off only to measure it (docs/engine.md)
    read_ahead: bool = True
    # host memory this layer's table may use (None: no limit); EngineConfig.host_memory_bytes is split into it
    host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        for what, value, names in (("placement kind", self.kind, PLACEMENTS), ("codec", self.codec, CODECS),
                                   ("cache policy", self.cache_policy, CACHE_POLICIES),
                                   ("file_mode", self.file_mode, FILE_MODES)):
            if value not in names:
                raise ValueError(f"unknown {what} {value!r} (valid: {', '.join(names)})")
        at_least(self, 0, "cache_bytes")
        at_least(self, 1, "host_memory_bytes")
        LayerSettings(self.kind, self.cache_bytes).check()
        if (self.kind == "mooncake") != bool(self.master):
            raise ValueError("placement 'mooncake' needs master (HOST:PORT of the mooncake_master), and only it "
                             f"takes one; got kind {self.kind!r}, master {self.master!r}")

    @classmethod
    def from_any(cls, obj: Placement | str | dict[str, Any]) -> Placement:
        """A Placement from itself, a kind name ("host"), or a dict of its fields."""
        return obj if isinstance(obj, Placement) else cls(kind=obj) if isinstance(obj, str) else cls(**obj)


@dataclass
class DegradePolicy:
    """Under I/O pressure skip Engram reads before letting steps stall (docs/engine.md, "Degrade policy")."""

    stall_bound_s: float | None = None  # None: off (level 0 always); 0: always over
    window_steps: int = 8  # steps in the moving average, and the least steps spent at a level before leaving it
    recover_factor: float = 0.5  # step down below bound * recover_factor
    predictor_path: str | None = None  # a SkipPredictor .npz (tiergram predictor --save); None: no level 2

    def __post_init__(self) -> None:
        if self.stall_bound_s is not None and not self.stall_bound_s >= 0:
            raise ValueError(f"DegradePolicy.stall_bound_s must be >= 0 or None (off), got {self.stall_bound_s}")
        at_least(self, 1, "window_steps")
        if not 0 <= self.recover_factor <= 1:
            raise ValueError(f"DegradePolicy.recover_factor must lie in [0, 1], got {self.recover_factor}")
        if self.predictor_path is not None:
            self.predictor_path = str(self.predictor_path)


@dataclass
class EngineConfig(EngineShared):
    """Everything the engine needs (what it shares with [engine], keyword-only: settings.EngineShared)."""

    model_dir: str  # trained model directory (config.json, model.safetensors, tokenizer.json), or an exported one
    placement: Placement | dict[int, Placement]  # one for every Engram layer, or {layer: Placement}
    # weights + device tables + activations + KV cache (None: CUDA's free memory; CPU: $TIERGRAM_DEVICE_BYTES, 2G)
    device_memory_bytes: int | None = None
    num_kv_blocks: int | None = None  # override the KV blocks the budget affords (tests, experiments)
    eos_token_id: int | None = None  # None: the tokenizer's <|endoftext|>, if it has one
    degrade: DegradePolicy = field(default_factory=DegradePolicy)  # off unless degrade.stall_bound_s is set
    # host memory the Engram tables and the host K/V tier may use in all (None: no limit; docs/engine.md)
    host_memory_bytes: int | None = None

    def __post_init__(self) -> None:
        self.model_dir = str(self.model_dir)
        if self.hot_rows is not None:
            self.hot_rows = str(self.hot_rows)
        if isinstance(self.placement, dict) and "kind" not in self.placement:
            self.placement = {int(k): Placement.from_any(v) for k, v in self.placement.items()}
        else:
            self.placement = Placement.from_any(self.placement)
        if not isinstance(self.degrade, DegradePolicy):  # a dict of its fields, or None (off)
            self.degrade = DegradePolicy(**(self.degrade or {}))
        self.check_shared("host_memory_bytes")
        at_least(self, 1, "num_kv_blocks")
        at_least(self, 0, "device_memory_bytes")

    @classmethod
    def from_settings(cls, settings: ServeSettings, model_dir: str | os.PathLike, device: str | None = None
                      ) -> EngineConfig:
        """The EngineConfig `tiergram serve`'s settings describe (`device`: the resolved compute device)."""
        e = settings.engine

        def placement(layer: LayerSettings) -> Placement:  # what a layer leaves out comes from [engine]
            offloaded = layer.tier in ("file", "mooncake")  # (only these tiers have a cache)
            return Placement(kind=layer.tier, cache_bytes=e.cache_bytes * offloaded if layer.cache_bytes is None
                             else layer.cache_bytes, cache_policy=layer.cache_policy or e.cache_policy, codec=e.codec,
                             file_mode=e.file_mode, master=e.mooncake_master if layer.tier == "mooncake" else "",
                             read_ahead=e.read_ahead if layer.read_ahead is None else layer.read_ahead)

        layers = settings.engram.layers
        chosen = {k: placement(v) for k, v in layers.items()} or placement(LayerSettings(e.placement, e.cache_bytes))
        shared = {f.name: getattr(e, f.name) for f in dataclasses.fields(EngineShared)}
        return cls(model_dir=str(model_dir), placement=chosen, device_memory_bytes=e.device_memory,
                   host_memory_bytes=e.host_memory, **{**shared, "device": device or e.device})

    @property
    def kv_host_bytes(self) -> int:
        """Host bytes for the host K/V tier: kv_host_fraction of host_memory_bytes."""
        return int((self.host_memory_bytes or 0) * self.kv_host_fraction)

    @property
    def engram_host_bytes(self) -> int | None:
        """Host bytes for the Engram tables: host_memory_bytes less the K/V tier's (None: no limit)."""
        return None if self.host_memory_bytes is None else self.host_memory_bytes - self.kv_host_bytes

    def host_split(self) -> str:
        """Both shares of host_memory_bytes, as an error message names them."""
        return (f"host_memory_bytes {self.host_memory_bytes}: {self.engram_host_bytes} for the Engram tables, "
                f"{self.kv_host_bytes} for the host K/V tier (kv_host_fraction {self.kv_host_fraction})")

    def placements_for(self, layers: list[int]) -> dict[int, Placement]:
        """{layer: Placement} for the model's Engram layers; ValueError for a missing or unknown layer."""
        if isinstance(self.placement, Placement):
            placements = {layer: self.placement for layer in layers}
        else:
            unknown, missing = set(self.placement) - set(layers), set(layers) - set(self.placement)
            if unknown or missing:
                raise ValueError(f"placement must name exactly the Engram layers {layers}; unknown "
                                 f"{sorted(unknown)}, missing {sorted(missing)}")
            placements = {layer: self.placement[layer] for layer in layers}
        if self.engram_host_bytes is None or not layers:
            return placements
        share = self.engram_host_bytes // len(layers)
        if share < 1:
            raise ValueError(f"{self.host_split()} cannot be split over {len(layers)} Engram layers")
        # a placement that names its own budget keeps it
        return {layer: p if p.host_memory_bytes is not None or p.kind == "device"
                else dataclasses.replace(p, host_memory_bytes=share) for layer, p in placements.items()}
