"""Where an Engram layer's rows come from: a trainable in-memory table, or any row source (the store)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import nn

from tiergram.format.ids import check_row_ids


class RowSource(Protocol):
    """Anything that serves rows: `lookup(row_ids int64 [B, L, H]) -> [B, L, H, D]` (e.g. TieredTable)."""

    def lookup(self, row_ids: torch.Tensor) -> torch.Tensor: ...


class TrainableTable(nn.Module):
    """Every head's rows in one sparse nn.Embedding [sum(head_sizes), D]; head h starts at offsets[h]."""

    checks_row_ids = True  # Engram skips its own check for tables that do it themselves

    def __init__(self, head_sizes: Sequence[int], dim: int):
        super().__init__()
        self.head_sizes = [int(n) for n in head_sizes]
        self.dim = int(dim)
        # sparse: a step touches a few rows of millions (train with torch.optim.SparseAdam)
        self.embedding = nn.Embedding(sum(self.head_sizes), self.dim, sparse=True)
        offsets = torch.tensor([0, *self.head_sizes[:-1]], dtype=torch.int64).cumsum(0)
        self.register_buffer("offsets", offsets, persistent=False)  # derived from head_sizes

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """int64 [B, L, H] per-head ids -> rows [B, L, H, D] in the table's dtype."""
        check_row_ids(row_ids, self.head_sizes)
        return self.embedding(row_ids.long() + self.offsets)

    @torch.no_grad()
    def weight_for_export(self) -> tuple[torch.Tensor, list[int]]:
        """(float32 CPU [total_rows, D] copy of every row, head row offsets [H]) for a table writer."""
        return self.embedding.weight.detach().float().cpu().clone(), self.offsets.tolist()


class RowSourceTable(nn.Module):
    """Adapts a RowSource (e.g. the tiered store) into an Engram table, rows in this module's dtype and device."""

    checks_row_ids = False

    def __init__(self, source: RowSource, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not callable(getattr(source, "lookup", None)):
            raise TypeError(f"row source {type(source).__name__} has no lookup(row_ids) method")
        self.source = source
        # an empty buffer is moved and cast by Module.to(), so it carries the dtype/device rows must have
        self.register_buffer("_like", torch.empty(0, dtype=dtype), persistent=False)

    def forward(self, row_ids: torch.Tensor) -> torch.Tensor:
        """int64 [B, L, H] per-head ids -> rows [B, L, H, D] from the source, cast to this module's dtype."""
        rows = self.source.lookup(row_ids)
        if rows.shape[:-1] != row_ids.shape:
            raise ValueError(f"row source returned shape {tuple(rows.shape)} for row ids of shape "
                             f"{tuple(row_ids.shape)}; expected {tuple(row_ids.shape)} + (D,)")
        return self.adopt(rows)

    def adopt(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows [..., H, D] fetched from the source (e.g. a prefetch ticket's) in this module's dtype and device."""
        return rows.to(device=self._like.device, dtype=self._like.dtype)
