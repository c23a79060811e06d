"""The step context a serving engine sets around `EngramLM.forward(ids [1, N])` (nano-vllm's `Context`): the paged
K/V and each Engram layer's rows of one batched step (docs/engine.md, "The forward")."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch


@dataclass
class Group:
    """Sequences attended together, padded to the group's longest chunk T and longest context P."""

    members: list[int]  # batch indices of its sequences (Bg of them)
    rows: torch.Tensor  # int64 [Ng]: the group's tokens in the step's flat order
    seq: torch.Tensor  # int64 [Ng]: each token's sequence within the group
    col: torch.Tensor  # int64 [Ng]: each token's index within its chunk
    counts: torch.Tensor  # int64 [Bg]: chunk lengths
    key_slots: torch.Tensor  # int64 [Bg, P]: KV slot of each context position (padding reads slot of block 0)
    mask: torch.Tensor  # bool [Bg, 1, T, P]: query j of sequence b may see key p
    t_max: int
    # the Engram short conv's lookback: slots of the W positions before each chunk, and which exist (position >= 0)
    conv_slots: torch.Tensor | None = None  # int64 [Bg, W]
    conv_valid: torch.Tensor | None = None  # bool [Bg, W]


@dataclass
class StepLayout:
    """The step's N tokens of B sequences, flattened in batch order."""

    ids: torch.Tensor  # int64 [N] token ids
    positions: torch.Tensor  # int64 [N] positions in their sequences
    slots: torch.Tensor  # int64 [N] KV slots the new keys/values are written to
    last: torch.Tensor  # int64 [B] flat index of each sequence's last token this step
    groups: list[Group]  # decodes (chunk of 1) and prefill chunks, attended separately to limit padding


@dataclass
class EngramInput:
    """One Engram layer's input for the step: its rows, and which positions the degrade policy skipped."""

    rows: torch.Tensor  # [N, H, D] (zeros at skipped positions)
    keep: torch.Tensor | None = None  # [N] 1 keep / 0 skipped (None: every position kept), in the compute dtype


@dataclass
class StepContext:
    """Set around one engine step's forward; read by Attention, Block and EngramLM when present."""

    layout: StepLayout
    k_cache: torch.Tensor  # [n_layers, slots, n_kv_heads, head_dim]
    v_cache: torch.Tensor  # same shape
    engram: dict[int, Callable[[], EngramInput]] = field(default_factory=dict)  # per layer, called when it runs
    # per Engram layer with a short conv: its gated values [slots, 1, d], paged like the K/V
    e_cache: dict[int, torch.Tensor] = field(default_factory=dict)


_CURRENT: ContextVar[StepContext | None] = ContextVar("tiergram_step_context", default=None)


def current_step() -> StepContext | None:
    """The step context of the forward running in this thread/task, or None (a plain forward)."""
    return _CURRENT.get()


@contextmanager
def step_context(ctx: StepContext) -> Iterator[StepContext]:
    """Make `ctx` the current step context for the forward run inside the `with` block."""
    token = _CURRENT.set(ctx)
    try:
        yield ctx
    finally:
        _CURRENT.reset(token)
