"""Mooncake's `mooncake.store.EngramStore` API served by tiergram's tiers: the table pushed to a Mooncake `store`
as `engram-l<layer_id>`, or the file `engram-l<layer_id>.tgram` in a directory `store` (docs/remote.md)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.format import TableManifest, create_table
from tiergram.format.create import ValueSource, stacked_values
from tiergram.store import TieredTable
from tiergram.tiers import mooncake as mc

COMPAT_TIERS = ("host", "file", "mooncake")


class EngramStoreError(RuntimeError):
    """A failed populate, lookup or removal; RuntimeError, as Mooncake's EngramStore raises."""


class EngramStoreConfig:
    """Geometry of one layer's tables: `embedding_dim` (D) and `table_vocab_sizes` (rows of each head)."""

    def __init__(self, embedding_dim: int = 0, table_vocab_sizes: Sequence[int] = ()) -> None:
        self.embedding_dim = embedding_dim
        self.table_vocab_sizes = list(table_vocab_sizes)


class EngramStore:
    """One Engram layer's per-head tables; see the module docstring for where they live."""

    def __init__(self, layer_id: int, config: Any, store: Any = None, *, tier: str | None = None,
                 cache_bytes: int = 0, cache_policy: str = "lru", fallback: str | os.PathLike | None = None) -> None:
        vocab = [int(v) for v in config.table_vocab_sizes]
        dim = int(config.embedding_dim)
        if not vocab:
            raise ValueError("EngramStoreConfig.table_vocab_sizes must not be empty")
        if dim <= 0:
            raise ValueError("EngramStoreConfig.embedding_dim must be positive")
        if any(v <= 0 for v in vocab):
            raise ValueError("EngramStoreConfig.table_vocab_sizes must contain only positive values")
        is_dir = isinstance(store, (str, os.PathLike))
        tier = tier or ("mooncake" if store is not None and not is_dir else "host")
        if tier not in COMPAT_TIERS:
            raise ValueError(f"unknown tier {tier!r} (valid: {', '.join(COMPAT_TIERS)})")
        if tier == "mooncake" and (store is None or is_dir):
            raise ValueError("tier 'mooncake' needs store to be a MooncakeDistributedStore client")
        if tier != "mooncake" and not is_dir:
            raise ValueError(f"tier {tier!r} needs store to be the directory that holds the layer's table file")
        self.layer_id = int(layer_id)
        self.tier = tier
        self.store = store
        self.name = f"engram-l{self.layer_id}"
        self.manifest = TableManifest(codec="fp32", dim=dim, head_rows=tuple(vocab), layer_id=self.layer_id,
                                      provenance={"tool": "tiergram.compat.mooncake.EngramStore"})
        self.path = Path(store) / f"{self.name}.tgram" if is_dir else None
        self._options = {"cache_bytes": cache_bytes, "cache_policy": cache_policy, "fallback": fallback}
        self._table: TieredTable | None = None

    def get_num_heads(self) -> int:
        """Number of hash heads (tables) of this layer."""
        return self.manifest.n_heads

    def get_embedding_dim(self) -> int:
        """Values per row (D)."""
        return self.manifest.dim

    def get_table_vocab_sizes(self) -> list[int]:
        """Rows of each head's table."""
        return list(self.manifest.head_rows)

    def get_store_keys(self) -> list[str]:
        """The keys (mooncake tier: manifest then page objects) or the file (host, file tiers) of this layer."""
        if self.tier == "mooncake":
            return mc.table_keys(self.name, self.manifest.n_pages)
        return [str(self.path)]

    def populate(self, embedding_buffers: list) -> None:
        """Store the per-head float32 numpy arrays [vocab_h, D]; refused when the layer is already stored."""
        m = self.manifest
        if len(embedding_buffers) != m.n_heads:
            raise EngramStoreError("embedding_buffers size must match num_heads")
        for h, b in enumerate(embedding_buffers):
            if not isinstance(b, np.ndarray):
                raise EngramStoreError("embedding_buffers must be NumPy arrays")
            if b.shape != (m.head_rows[h], m.dim):
                raise EngramStoreError(f"embedding buffer shape does not match get_table_vocab_sizes()/"
                                       f"get_embedding_dim(): head {h} is {list(b.shape)}, expected "
                                       f"[{m.head_rows[h]}, {m.dim}]")
        if self.tier == "mooncake":
            with tempfile.TemporaryDirectory(prefix="tiergram-engram-") as tmp:
                path = create_table(Path(tmp) / f"{self.name}.tgram", self.manifest, _rows_of(embedding_buffers),
                                    progress=False)
                try:
                    mc.push_table(path, "", self.name, store=self.store, progress=False)
                except FileExistsError:
                    raise EngramStoreError(f"populate failed: the store already holds layer {self.layer_id} "
                                           f"({mc.manifest_key(self.name)}); remove_from_store() first") from None
                except (OSError, ValueError) as e:
                    raise EngramStoreError(f"populate failed: {e}") from e
            return
        if self.path.exists():
            raise EngramStoreError(f"populate failed: {self.path} already holds layer {self.layer_id}; "
                                   f"remove_from_store() first")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        create_table(self.path, self.manifest, _rows_of(embedding_buffers), progress=False)

    def lookup(self, row_ids: Any) -> np.ndarray:
        """Rows of per-head ids int64 [B, L, H] as float32 [B, L, H, D]; RuntimeError for a bad id or no table."""
        ids = np.asarray(row_ids)
        if ids.ndim != 3 or ids.shape[2] != self.manifest.n_heads:
            raise EngramStoreError("row_ids array must have shape [B, L, H]")
        if ids.dtype.kind not in "iu":
            raise EngramStoreError(f"row_ids must be integers, got {ids.dtype}")
        try:
            return self._open().lookup(ids.astype(np.int64, copy=False)).numpy()
        except EngramStoreError:
            raise
        except (OSError, ValueError, IndexError) as e:
            raise EngramStoreError(f"EngramStore lookup failed: {e}") from e

    def remove_from_store(self, force: bool = False) -> int:
        """Remove this layer's table; the head tables removed (0: not stored). Pages are hard-pinned: always forced."""
        del force
        self.close()
        if self.tier == "mooncake":
            try:
                return self.manifest.n_heads if mc.remove_table(self.store, self.name) else 0
            except OSError as e:
                raise EngramStoreError(f"remove_from_store failed: {e}") from e
        if not self.path.exists():
            return 0
        self.path.unlink()
        return self.manifest.n_heads

    def stats(self) -> dict:
        """The serving table's statistics (TieredTable.stats); empty before the first lookup."""
        return self._table.stats() if self._table is not None else {}

    def close(self) -> None:
        """Release the open table (the stored copy stays)."""
        if self._table is not None:
            self._table.close()
            self._table = None

    def _open(self) -> TieredTable:
        if self._table is None:
            opts = self._options
            if self.tier == "mooncake":
                try:
                    stored, _ = mc.fetch_manifest(self.store, self.name)
                except FileNotFoundError:
                    raise EngramStoreError(f"EngramStore lookup failed: layer {self.layer_id} is not in the store "
                                           f"(populate it first)") from None
                if stored.head_rows != self.manifest.head_rows or stored.dim != self.manifest.dim:
                    raise EngramStoreError(f"EngramStore lookup failed: the stored layer {self.layer_id} has heads "
                                           f"{list(stored.head_rows)} x D={stored.dim}, the config "
                                           f"{list(self.manifest.head_rows)} x D={self.manifest.dim}")
                self._table = TieredTable(mc.table_uri("", self.name), tier="mooncake",
                                          cache_bytes=opts["cache_bytes"], cache_policy=opts["cache_policy"],
                                          remote_options={"store": self.store, "fallback": opts["fallback"]})
            else:
                if not self.path.exists():
                    raise EngramStoreError(f"EngramStore lookup failed: no table {self.path} (populate it first)")
                cache = opts["cache_bytes"] if self.tier == "file" else 0
                self._table = TieredTable(self.path, tier=self.tier, cache_bytes=cache,
                                          cache_policy=opts["cache_policy"])
        return self._table

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to release
            self.close()


def _rows_of(buffers: list) -> ValueSource:
    """A value source over the heads' arrays in global row order: float32 [n, D] for rows [start, start + n)."""
    return stacked_values([b.shape[0] for b in buffers], lambda h, lo, hi: buffers[h][lo:hi])
