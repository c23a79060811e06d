"""Gather + dequant in plain torch ops: runs on any device; the fallback where Triton cannot run, and a second check."""

from __future__ import annotations

import torch

from tiergram.kernels.layout import RowLayout

_NAN_BITS = 0x7FC00000
_UE8M0_ZERO = 2.0**-127  # what ue8m0 byte 0 stands for: a float32 subnormal, exact


def decode_raw(raw: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Encoded rows uint8 [R, row_bytes] -> float32 [R, D], bit-exact with tiergram.codecs."""
    d, n = layout.dim, raw.shape[0]
    raw = raw.contiguous()
    if layout.codec == "fp32":
        return raw.view(torch.float32).clone()
    if layout.codec == "bf16":
        return raw.view(torch.bfloat16).float()
    if layout.codec == "int8":
        q = raw[:, :d].contiguous().view(torch.int8).float()
        return q * raw[:, d:].contiguous().view(torch.float32)
    q = raw[:, :d].contiguous().view(torch.float8_e4m3fn).float().view(n, d // 32, 32)
    e = raw[:, d:].to(torch.int32)
    scale = (e << 23).view(torch.float32)
    scale = torch.where(e == 0, torch.tensor(_UE8M0_ZERO, device=raw.device), scale)
    scale = torch.where(e == 255, torch.tensor(_NAN_BITS, dtype=torch.int32, device=raw.device).view(torch.float32),
                        scale)
    return (q * scale[:, :, None]).view(n, d)


def raw_rows(data: torch.Tensor, ids: torch.Tensor, head_offsets: torch.Tensor, layout: RowLayout) -> torch.Tensor:
    """Encoded rows uint8 [R, row_bytes] of checked flat ids [R] (+ head offsets [H]) from data uint8 [bytes]."""
    g = (ids.view(-1, head_offsets.numel()) + head_offsets).reshape(-1)
    base = (g // layout.rows_per_page) * layout.page_size + (g % layout.rows_per_page) * layout.row_bytes
    cols = torch.arange(layout.row_bytes, device=data.device)
    return data[base[:, None] + cols[None, :]] if g.numel() else data.new_empty((0, layout.row_bytes))


def gather_dequant_torch(data: torch.Tensor, ids: torch.Tensor, head_offsets: torch.Tensor, layout: RowLayout,
                         out: torch.Tensor, cache: torch.Tensor | None = None, slots: torch.Tensor | None = None,
                         fill: torch.Tensor | None = None) -> None:
    """out [R, D] = rows of checked flat ids [R] (+ head offsets) from data uint8 [bytes], as the Triton kernel: slots
    [R] >= 0 read cache [S, row_bytes] rows, and a miss with fill [R] >= 0 is also written to that slot."""
    raw = raw_rows(data, ids, head_offsets, layout)
    if cache is not None:
        hit = slots >= 0
        raw[hit] = cache[slots[hit]]
        if fill is not None:
            put = (fill >= 0) & ~hit
            cache[fill[put]] = raw[put]
    out.view(-1, layout.dim).copy_(decode_raw(raw, layout))
