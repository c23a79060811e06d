"""What the host, file and Mooncake tiers share and offer the table that reads rows through them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from tiergram import _native
from tiergram.format import TableFile

if TYPE_CHECKING:
    PageSource = _native.PageReader | _native.CallbackPageSource


class TableTier:
    """What every tier shares: its table's geometry and its ids checked natively (host, file, mooncake add
    read_rows, gather, stats, close and the native fetch pipeline's page source `reader`)."""

    name: str  # its key in the table's bytes_read: 'host', 'file' or 'mooncake'
    reader: PageSource | None  # file reads, Mooncake's read_pages; None where there is none (host, mmap)
    native_counts: np.ndarray  # int64 [2]: rows and pages the native pipeline read through `reader`

    def __init__(self, table: TableFile) -> None:
        self.table = table
        self.manifest = table.manifest
        self.head_offsets = table.head_offsets  # int64 [H]
        self.head_rows = table.head_rows  # int64 [H]

    def check_ids(self, ids: np.ndarray) -> None:
        """IndexError naming head and id for any id of int64 [N, H] outside its head."""
        _native.check_ids(ids, self.head_rows)


class PageTier(TableTier):
    """A tier that reads pages (file, Mooncake) by its `read_pages`: each distinct page once per call."""

    def read_rows(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """(this thread's staging buffer, int64 byte offsets [n], pages read) of the global rows [n] (ids checked)."""
        m = self.manifest
        page_of_row, slot_in_page = np.divmod(np.asarray(rows, dtype=np.int64), m.rows_per_page)
        pages, which = np.unique(page_of_row, return_inverse=True)
        return self.read_pages(pages), which.reshape(-1) * m.page_size + slot_in_page * m.row_bytes, int(pages.size)

    def gather(self, ids: np.ndarray, out: np.ndarray | torch.Tensor) -> tuple[np.ndarray, int]:
        """Rows of ids int64 [N, H] into out; (the sorted distinct global rows read, pages read)."""
        self.check_ids(ids)
        uniq, inverse = np.unique((ids + self.head_offsets).reshape(-1), return_inverse=True)
        buf, offsets, pages = self.read_rows(uniq)
        _native.decode_at(buf, offsets[inverse.reshape(-1)], self.manifest.codec_id, self.manifest.dim, out)
        return uniq, pages

