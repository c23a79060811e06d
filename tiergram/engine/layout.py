"""Where a step's tokens go: flat token order, KV slots, and the padded attention groups (tiergram.model.context)."""

from __future__ import annotations

import torch

from tiergram.engine.sequence import Sequence
from tiergram.model.context import Group, StepLayout

__all__ = ["Group", "StepLayout", "build_layout"]


def build_layout(seqs: list[Sequence], counts: list[int], block_size: int, device: torch.device,
                 conv_window: int = 0) -> StepLayout:
    """Flatten the scheduled chunks; the slot and mask tensors every layer reuses (conv_window: the conv's W)."""
    b = len(seqs)
    starts = torch.tensor([s.num_computed for s in seqs], dtype=torch.int64)
    n = torch.tensor(counts, dtype=torch.int64)
    offs = torch.cumsum(n, 0) - n
    chunks = [s.token_ids[s.num_computed:s.num_computed + c] for s, c in zip(seqs, counts, strict=True)]
    ids = torch.tensor([t for chunk in chunks for t in chunk], dtype=torch.int64)
    seq_index = torch.repeat_interleave(torch.arange(b), n)
    positions = starts[seq_index] + torch.arange(int(n.sum())) - offs[seq_index]
    width = max(len(s.block_table) for s in seqs)
    tables = torch.zeros(b, width, dtype=torch.int64)
    for i, s in enumerate(seqs):
        tables[i, :len(s.block_table)] = torch.tensor(s.block_table, dtype=torch.int64)
    slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
    decode = [i for i, c in enumerate(counts) if c == 1]
    prefill = [i for i, c in enumerate(counts) if c > 1]
    groups = [_group(m, starts, n, offs, tables, block_size, device, conv_window) for m in (decode, prefill) if m]
    return StepLayout(ids.to(device), positions.to(device), slots.to(device), (offs + n - 1).to(device), groups)


def _group(members: list[int], starts: torch.Tensor, n: torch.Tensor, offs: torch.Tensor, tables: torch.Tensor,
           block_size: int, device: torch.device, conv_window: int) -> Group:
    m = torch.tensor(members, dtype=torch.int64)
    counts, start, ctx = n[m], starts[m], starts[m] + n[m]
    t_max, p_max = int(counts.max()), int(ctx.max())
    seq = torch.repeat_interleave(torch.arange(len(members)), counts)
    col = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[seq]
    rows = offs[m][seq] + col
    p = torch.arange(p_max)
    key_slots = tables[m][:, p // block_size] * block_size + p % block_size  # [Bg, P]
    qpos = start[:, None] + torch.arange(t_max)[None, :]  # [Bg, T]; padded queries still see key 0: no NaN
    mask = (p[None, None, :] <= qpos[:, :, None]) & (p[None, None, :] < ctx[:, None, None])
    group = Group(members, rows.to(device), seq.to(device), col.to(device), counts.to(device), key_slots.to(device),
                  mask[:, None].to(device), t_max)
    if conv_window:
        back = start[:, None] - conv_window + torch.arange(conv_window)[None, :]  # [Bg, W] positions before the chunk
        valid = back >= 0
        back = back.clamp(min=0)
        group.conv_slots = (tables[m].gather(1, back // block_size) * block_size + back % block_size).to(device)
        group.conv_valid = valid.to(device)
    return group
