"""The Engram layer: rows [B, L, H, D] -> gated value (+ causal short conv) [B, L, hc, d_model], with the math
and parameter layout of DeepSeek's engram_demo_v1.py minus the hashing (tiergram.hashing)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tiergram.engram.tables import TrainableTable
from tiergram.format.ids import check_row_ids


@dataclass
class EngramConfig:
    """Geometry of one Engram layer: H heads of head_sizes[h] rows, D values a row, E = H·D inputs."""

    d_model: int
    head_sizes: list[int]  # rows per hash head, in hashing order
    dim: int  # D: values per row
    max_ngram_size: int  # the short conv's dilation
    hc_mult: int = 1  # hyper-connection branches: one key/gate per branch, one shared value
    conv_kernel: int = 4  # 0 disables the short conv (DeepSeek-V4.1 has none)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("d_model", "dim", "max_ngram_size", "hc_mult"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"EngramConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.head_sizes or any(int(n) < 1 for n in self.head_sizes):
            raise ValueError(f"EngramConfig.head_sizes must be a non-empty list of positive ints, "
                             f"got {self.head_sizes}")
        if self.conv_kernel < 0 or self.norm_eps <= 0:
            raise ValueError(f"EngramConfig: conv_kernel must be >= 0 and norm_eps > 0, got "
                             f"{self.conv_kernel}, {self.norm_eps}")

    @property
    def n_heads(self) -> int:
        """H: hash heads (all n-gram orders together)."""
        return len(self.head_sizes)

    @property
    def engram_dim(self) -> int:
        """E = H·D: width of the concatenated rows a position retrieves."""
        return self.n_heads * self.dim


class RMSNorm(nn.Module):
    """x / sqrt(mean(x²) + eps) · weight over the last dim; same parameter name as torch.nn.RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[..., dim] -> [..., dim], same dtype (statistics in float32, so bf16 keeps its accuracy)."""
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class ShortConv(nn.Module):
    """Per-branch RMSNorm, then a causal depthwise dilated Conv1d over time on hc·d channels, then SiLU."""

    def __init__(self, hidden: int, kernel_size: int = 4, dilation: int = 1, hc_mult: int = 1,
                 norm_eps: float = 1e-5):
        super().__init__()
        self.hc_mult = hc_mult
        channels = hidden * hc_mult
        # padding both sides, then keeping the first L outputs: causal
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels, bias=False,
                              padding=(kernel_size - 1) * dilation, dilation=dilation)
        self.norms = nn.ModuleList([RMSNorm(hidden, norm_eps) for _ in range(hc_mult)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[B, L, hc, d] -> [B, L, hc, d]."""
        b, length, hc, d = x.shape
        normed = torch.cat([self.norms[i](x[:, :, i, :]) for i in range(hc)], dim=-1)  # [B, L, hc·d]
        y = self.conv(normed.transpose(1, 2))[..., :length]  # [B, hc·d, L]
        return F.silu(y).transpose(1, 2).reshape(b, length, hc, d)


class Engram(nn.Module):
    """One Engram layer. forward(hidden [B, L, hc, d], row_ids [B, L, H] | rows [B, L, H, D]) -> [B, L, hc, d]."""

    def __init__(self, config: EngramConfig, table: nn.Module | None = None):
        super().__init__()
        self.config = config
        if table is None:
            table = TrainableTable(config.head_sizes, config.dim)
        elif isinstance(table, TrainableTable) and (table.head_sizes != list(config.head_sizes)
                                                    or table.dim != config.dim):
            raise ValueError(f"table geometry (heads {table.head_sizes}, dim {table.dim}) does not match "
                             f"the config (heads {config.head_sizes}, dim {config.dim})")
        self.table = table
        d, e, hc = config.d_model, config.engram_dim, config.hc_mult
        self.value_proj = nn.Linear(e, d)
        self.key_projs = nn.ModuleList([nn.Linear(e, d) for _ in range(hc)])
        self.norm1 = nn.ModuleList([RMSNorm(d, config.norm_eps) for _ in range(hc)])  # keys
        self.norm2 = nn.ModuleList([RMSNorm(d, config.norm_eps) for _ in range(hc)])  # queries
        self.short_conv = (ShortConv(d, config.conv_kernel, config.max_ngram_size, hc, config.norm_eps)
                           if config.conv_kernel > 0 else None)

    def forward(self, hidden: torch.Tensor, row_ids: torch.Tensor | None = None,
                rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [B, L, hc, d] and one of row_ids int64 [B, L, H] or rows [B, L, H, D] -> [B, L, hc, d]."""
        value = self.gated_value(hidden, row_ids, rows)[0]
        return value if self.short_conv is None else value + self.short_conv(value)

    def gated_value(self, hidden: torch.Tensor, row_ids: torch.Tensor | None = None,
                    rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(gated value [B, L, hc, d] before the short conv, gates [B, L, hc])."""
        hidden, e = self._inputs(hidden, row_ids, rows)
        gates = self._gates(hidden, e)
        return gates.unsqueeze(-1) * self.value_proj(e).unsqueeze(2), gates  # one value, gated per branch

    def gates(self, hidden: torch.Tensor, row_ids: torch.Tensor | None = None,
              rows: torch.Tensor | None = None) -> torch.Tensor:
        """Per-branch gates [B, L, hc] in (0, 1), without computing the value (for study tools)."""
        return self._gates(*self._inputs(hidden, row_ids, rows))

    def _gates(self, hidden: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        """hidden [B, L, hc, d], e [B, L, E] -> sigmoid(signed_sqrt(<norm(W_k e), norm(h)> / √d)) [B, L, hc]."""
        out = []
        for i in range(self.config.hc_mult):
            key = self.norm1[i](self.key_projs[i](e))
            query = self.norm2[i](hidden[:, :, i, :])
            g = (key * query).sum(-1) / math.sqrt(self.config.d_model)
            # signed square root damps large dot products; the clamp keeps its gradient finite at 0
            g = g.sign() * g.abs().clamp_min(1e-6).sqrt()
            out.append(g.sigmoid())
        return torch.stack(out, dim=-1)

    def _inputs(self, hidden: torch.Tensor, row_ids: torch.Tensor | None,
                rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Validate shapes; -> (hidden [B, L, hc, d], concatenated rows e [B, L, E]) in the module's dtype."""
        cfg = self.config
        if hidden.ndim != 4 or hidden.shape[2:] != (cfg.hc_mult, cfg.d_model):
            raise ValueError(f"hidden must have shape [B, L, {cfg.hc_mult}, {cfg.d_model}], "
                             f"got {tuple(hidden.shape)}")
        if (row_ids is None) == (rows is None):
            raise ValueError("pass exactly one of row_ids (looked up in the table) or rows (already fetched)")
        if row_ids is not None:
            if tuple(row_ids.shape[:2]) != tuple(hidden.shape[:2]):
                raise ValueError(f"row_ids shape {tuple(row_ids.shape)} does not match hidden's [B, L] "
                                 f"{tuple(hidden.shape[:2])}")
            if not getattr(self.table, "checks_row_ids", False):
                check_row_ids(row_ids, cfg.head_sizes)
            rows = self.table(row_ids)
        want = (*hidden.shape[:2], cfg.n_heads, cfg.dim)
        if tuple(rows.shape) != want:
            raise ValueError(f"rows must have shape {list(want)} ([B, L, H, D]), got {tuple(rows.shape)}")
        weight = self.value_proj.weight
        e = rows.to(device=weight.device, dtype=weight.dtype).flatten(-2)  # head-major: head 0's D first
        return hidden.to(weight.dtype), e
