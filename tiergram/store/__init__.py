"""The store contract: TieredTable.lookup(row_ids [B, L, H]) -> rows [B, L, H, D]."""

from tiergram.store.contract import RowStore, RowTicket
from tiergram.store.table import TieredTable
from tiergram.store.ticket import Ticket

__all__ = ["RowStore", "RowTicket", "Ticket", "TieredTable"]
