"""Mixture-of-experts FFN for the reference model: a router, top-k routed SwiGLU experts (per token, no dropping),
an optional shared expert (docs/model.md)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from tiergram.model.config import ModelConfig, MoESettings


class MoE(nn.Module):
    """x [..., d] -> [..., d]: sum over the top-k experts of weight * SwiGLU_e(x), plus the shared expert."""

    def __init__(self, d_model: int, settings: MoESettings):
        super().__init__()
        from tiergram.model.model import SwiGLU  # here, not at the top: model.py imports this module

        self.n_experts, self.top_k = settings.n_experts, settings.top_k
        self.router = nn.Linear(d_model, settings.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d_model, settings.expert_ffn) for _ in range(settings.n_experts))
        self.shared = SwiGLU(d_model, settings.shared_ffn) if settings.shared_ffn else None
        self.aux_loss: torch.Tensor | None = None  # load-balancing loss of the last training-mode forward (scalar)
        self.record = False  # keep the last forward's choices in last_choices
        self.last_choices: torch.Tensor | None = None  # int64 [..., k]
        self.forced: torch.Tensor | None = None  # int64 [..., k]: use these experts instead of the top-k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, d] -> (choices int64 [N, k], combine weights float [N, k], router probabilities float [N, E])."""
        logits = self.router(x).float()  # routing in fp32 so bf16 autocast cannot flip a close call
        probs = logits.softmax(-1)
        if self.forced is not None:
            choices = self.forced.reshape(-1, self.top_k).to(x.device)
            if choices.shape[0] != x.shape[0]:
                raise ValueError(f"forced expert choices cover {choices.shape[0]} tokens, the input has {x.shape[0]}")
        else:
            choices = logits.topk(self.top_k, dim=-1).indices
        weights = logits.gather(-1, choices).softmax(-1)
        return choices, weights, probs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] (any leading shape: [B, T, d] in the model, [N, d] in the engine) -> [..., d]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        choices, weights, probs = self.route(flat)
        if self.record:
            self.last_choices = choices.reshape(*shape[:-1], self.top_k).detach()
        self.aux_loss = load_balancing_loss(probs, choices, self.n_experts) if self.training else None
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            token, slot = (choices == e).nonzero(as_tuple=True)
            if token.numel():
                y = expert(flat[token]) * weights[token, slot, None].to(flat.dtype)
                out.index_add_(0, token, y.to(out.dtype))
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape)


def load_balancing_loss(probs: torch.Tensor, choices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Switch Transformer's E * sum_i f_i * P_i: probs [N, E] float, choices int64 [N, k] -> scalar (1 = balanced)."""
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    counts = torch.zeros(n_experts, device=probs.device, dtype=probs.dtype)
    counts.index_add_(0, choices.flatten(), torch.ones(choices.numel(), device=probs.device, dtype=probs.dtype))
    f = counts / choices.numel()  # share of the N*k routed assignments per expert (no gradient: counts)
    return n_experts * (f * probs.mean(0)).sum()


def make_ffn(config: ModelConfig, layer: int, dense: nn.Module) -> nn.Module:
    """Block `layer`'s FFN: an MoE when the config routes that block, else `dense` unchanged."""
    if config.moe is None or layer not in config.moe.layers:
        return dense
    return MoE(config.d_model, config.moe)


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{block index: its MoE} of an EngramLM (empty for a dense model)."""
    return {i: b.mlp for i, b in enumerate(model.blocks) if isinstance(b.mlp, MoE)}


def aux_loss(model: nn.Module) -> torch.Tensor | None:
    """coef * the mean over MoE layers of their last forward's load-balancing loss; None for a dense model."""
    losses = [m.aux_loss for m in moe_layers(model).values() if m.aux_loss is not None]
    return model.config.moe.aux_loss_coef * torch.stack(losses).mean() if losses else None


@contextmanager
def routing(model: nn.Module, *, record: bool = False,
            force: dict[int, torch.Tensor] | None = None) -> Iterator[dict[int, MoE]]:
    """Within the block: record MoE choices (last_choices) and/or force {block: int64 [..., k]}; yields {block: MoE}."""
    layers = moe_layers(model)
    force = dict(force or {})
    bad = set(force) - set(layers)
    if bad:
        raise ValueError(f"forced choices for blocks {sorted(bad)}, but the MoE blocks are {sorted(layers)}")
    try:
        for i, m in layers.items():
            m.record, m.last_choices, m.forced = record, None, force.get(i)
        yield layers
    finally:
        for m in layers.values():
            m.record, m.forced = False, None

