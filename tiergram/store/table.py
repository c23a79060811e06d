"""TieredTable: the store contract — per-head row ids [B, L, H] in, rows [B, L, H, D] out."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from tiergram.format import TableFile
from tiergram.tiers import HostTier

OUT_DTYPES = (torch.float32, torch.bfloat16)


class TieredTable:
    """One Engram layer's table served from a tier; `lookup` is synchronous."""

    def __init__(self, path: str | os.PathLike, *, tier: str = "host", dtype: torch.dtype = torch.float32,
                 shared: bool = False, progress: bool = False) -> None:
        if dtype not in OUT_DTYPES:
            raise ValueError(f"dtype must be one of {OUT_DTYPES}, got {dtype}")
        self.table = TableFile.open(Path(path))
        self.manifest = self.table.manifest
        self.dtype = dtype
        if tier == "host":
            self.tier = HostTier(self.table, shared=shared, progress=progress)
        else:
            raise ValueError(f"unknown tier {tier!r} (valid: host)")

    @property
    def num_heads(self) -> int:
        return self.manifest.n_heads

    @property
    def dim(self) -> int:
        return self.manifest.dim

    def lookup(self, row_ids: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for per-head ids int64 [..., H] as [..., H, D] in self.dtype; IndexError names head and id."""
        ids = _as_ids(row_ids, self.num_heads)
        shape = (*ids.shape, self.dim)
        if out is None:
            out = torch.empty(shape, dtype=self.dtype)
        elif tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous():
            raise ValueError(f"out must be a contiguous {self.dtype} tensor of shape {shape}")
        self.tier.gather(ids.reshape(-1, self.num_heads), out.view(-1, self.num_heads, self.dim))
        return out

    def close(self) -> None:
        """Release the tier's resources."""
        self.tier.close()


def _as_ids(row_ids: np.ndarray | torch.Tensor, n_heads: int) -> np.ndarray:
    """Row ids as a C-contiguous int64 numpy array whose last axis is the heads."""
    if isinstance(row_ids, torch.Tensor):
        row_ids = row_ids.detach().cpu().numpy()
    ids = np.asarray(row_ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"row ids must be integers, got {ids.dtype}")
    if ids.ndim < 1 or ids.shape[-1] != n_heads:
        raise ValueError(f"row ids must have shape [..., {n_heads}] (one id per head), got {list(ids.shape)}")
    return np.ascontiguousarray(ids, dtype=np.int64)
