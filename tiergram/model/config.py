"""ModelConfig: the reference Engram LM's geometry, with the `small` and `tiny` presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngramSettings:
    """Engram layers of the model: where they sit, how they hash, how big their tables are."""

    layers: list[int] = field(default_factory=lambda: [1, 2])  # block indices (0-based) that get an Engram
    max_ngram_size: int = 3  # n-gram orders 2..max_ngram_size
    n_head_per_ngram: int = 4  # hash heads per order; H = (max_ngram_size - 1) * n_head_per_ngram
    engram_vocab_size: list[int] = field(default_factory=lambda: [65536, 65536])  # rows per head, per order
    dim: int = 32  # D: values per table row (a multiple of 32 so fp8_e4m3 export works)
    conv_kernel: int = 4  # causal short conv over the Engram value (0: none)
    seed: int = 0  # hashing seed (multipliers come from seed + 10007 * layer)
    pad_id: int = 1  # token id that left-pads the n-gram context at a sequence start (<|pad|>)

    @property
    def n_heads(self) -> int:
        """H: hash heads per Engram layer (all orders together)."""
        return (self.max_ngram_size - 1) * self.n_head_per_ngram


@dataclass
class ModelConfig:
    """A decoder-only LM: RMSNorm, RoPE, GQA attention, SwiGLU MLP, optional Engram layers."""

    vocab_size: int = 16384
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: n_heads / n_kv_heads query heads share a K/V head
    ffn: int = 688  # SwiGLU hidden width (~8/3 d_model, rounded to 16)
    max_seq: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True  # the LM head reuses the token embedding matrix
    engram: EngramSettings | None = field(default_factory=EngramSettings)

    def __post_init__(self) -> None:
        if isinstance(self.engram, dict):
            self.engram = EngramSettings(**self.engram)
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn", "max_seq"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"ModelConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.n_heads or (self.d_model // self.n_heads) % 2:
            raise ValueError(f"d_model {self.d_model} must split into {self.n_heads} heads of even width (RoPE)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be a multiple of n_kv_heads {self.n_kv_heads}")
        e = self.engram
        if e is not None:
            if not e.layers or len(set(e.layers)) != len(e.layers):
                raise ValueError(f"engram.layers must be distinct block indices, got {e.layers}")
            if min(e.layers) < 0 or max(e.layers) >= self.n_layers:
                raise ValueError(f"engram.layers {e.layers} must lie in 0..{self.n_layers - 1}")
            if len(e.engram_vocab_size) != e.max_ngram_size - 1:
                raise ValueError(f"engram.engram_vocab_size needs {e.max_ngram_size - 1} entries (orders "
                                 f"2..{e.max_ngram_size}), got {e.engram_vocab_size}")
            if not 0 <= e.pad_id < self.vocab_size:
                raise ValueError(f"engram.pad_id {e.pad_id} is outside the vocabulary [0, {self.vocab_size})")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (config.json)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, obj: dict[str, Any]) -> ModelConfig:
        """Inverse of to_dict; unknown keys are an error so a typo never goes unnoticed."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(obj) - known
        if unknown:
            raise ValueError(f"unknown model config keys: {sorted(unknown)}")
        return cls(**obj)

    def without_engram(self) -> ModelConfig:
        """The same backbone with no Engram layers (the ablation baseline)."""
        return dataclasses.replace(self, engram=None)


def small_config(vocab_size: int = 16384) -> ModelConfig:
    """~7M backbone + 2 Engram layers of 8 x ~65.5k x 32 rows (~34M table values); see docs/model.md."""
    return ModelConfig(vocab_size=vocab_size)


def tiny_config(vocab_size: int = 512) -> ModelConfig:
    """A seconds-to-train model for tests and smoke runs."""
    return ModelConfig(
        vocab_size=vocab_size, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn=176, max_seq=64,
        engram=EngramSettings(layers=[1], n_head_per_ngram=2, engram_vocab_size=[1009, 1009], dim=32),
    )


PRESETS = {"small": small_config, "tiny": tiny_config}


def preset(name: str, vocab_size: int) -> ModelConfig:
    """A named preset (small | tiny) for a tokenizer of vocab_size ids."""
    if name not in PRESETS:
        raise ValueError(f"unknown model config {name!r} (valid: {', '.join(PRESETS)})")
    return PRESETS[name](vocab_size)
