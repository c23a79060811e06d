"""ModelConfig: the reference Engram LM's geometry, with the `small`, `tiny`, `small-moe` and `tiny-moe` presets."""

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
class MoESettings:
    """Mixture-of-experts FFNs (tiergram.model.moe): which blocks route, how many experts, how wide."""

    layers: list[int] = field(default_factory=lambda: [1, 2, 3])  # blocks whose FFN is an MoE
    n_experts: int = 8  # routed experts per MoE block
    top_k: int = 2  # experts each token is sent to
    expert_ffn: int = 176  # SwiGLU hidden width of each routed expert
    shared_ffn: int = 0  # SwiGLU hidden width of the always-on shared expert (0: none)
    aux_loss_coef: float = 0.01  # weight of the load-balancing loss added to the LM loss in training

    def expert_params(self, d_model: int) -> int:
        """Routed-expert parameters over all MoE blocks (the sparse FFN parameters; router and shared excluded)."""
        return len(self.layers) * self.n_experts * 3 * d_model * self.expert_ffn


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
    moe: MoESettings | None = None  # None: every block has a dense SwiGLU of width ffn

    def __post_init__(self) -> None:
        if isinstance(self.engram, dict):
            self.engram = EngramSettings(**self.engram)
        if isinstance(self.moe, dict):
            self.moe = MoESettings(**self.moe)
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
        m = self.moe
        if m is not None:
            if not m.layers or len(set(m.layers)) != len(m.layers) or min(m.layers) < 0 \
                    or max(m.layers) >= self.n_layers:
                raise ValueError(f"moe.layers must be distinct block indices in 0..{self.n_layers - 1}, got {m.layers}")
            if not 1 <= m.top_k <= m.n_experts or m.expert_ffn < 1 or m.shared_ffn < 0:
                raise ValueError(f"moe needs 1 <= top_k <= n_experts and expert_ffn >= 1, got top_k {m.top_k}, "
                                 f"n_experts {m.n_experts}, expert_ffn {m.expert_ffn}, shared_ffn {m.shared_ffn}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form (config.json); a dense model has no `moe` key, as before MoE existed."""
        out = dataclasses.asdict(self)
        if out["moe"] is None:
            del out["moe"]
        return out

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


def small_moe_config(vocab_size: int = 16384) -> ModelConfig:
    """The small preset with MoE FFNs in blocks 1-3: 8 experts of width 176, top-2, a shared expert of width 176."""
    return dataclasses.replace(small_config(vocab_size), moe=MoESettings(layers=[1, 2, 3], n_experts=8, top_k=2,
                                                                         expert_ffn=176, shared_ffn=176))


def tiny_moe_config(vocab_size: int = 512) -> ModelConfig:
    """The tiny preset with an MoE FFN in block 1: 4 experts of width 48, top-2, a shared expert of width 48."""
    return dataclasses.replace(tiny_config(vocab_size), moe=MoESettings(layers=[1], n_experts=4, top_k=2,
                                                                        expert_ffn=48, shared_ffn=48))


PRESETS = {"small": small_config, "tiny": tiny_config, "small-moe": small_moe_config, "tiny-moe": tiny_moe_config}


def preset(name: str, vocab_size: int) -> ModelConfig:
    """A named preset (small | tiny | small-moe | tiny-moe) for a tokenizer of vocab_size ids."""
    if name not in PRESETS:
        raise ValueError(f"unknown model config {name!r} (valid: {', '.join(PRESETS)})")
    return PRESETS[name](vocab_size)
