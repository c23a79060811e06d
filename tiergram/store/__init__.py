"""The store contract: TieredTable.lookup(row_ids [B, L, H]) -> rows [B, L, H, D]."""

from tiergram.store.table import TieredTable

__all__ = ["TieredTable"]
