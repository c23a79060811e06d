"""The store contract as a type: what every Engram row table (host, file, device, remote) offers its callers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, Self, runtime_checkable

import torch

from tiergram.format import TableManifest
from tiergram.format.ids import RowIds

if TYPE_CHECKING:
    from tiergram.cache import RowCache
    from tiergram.cache.native import NativeRowCache


@runtime_checkable
class RowTicket(Protocol):
    """A fetch in flight (store.ticket.Ticket, NativeTicket, DeviceTicket): its rows once ready, or its error."""

    def done(self) -> bool:
        """True once the rows are ready (or the fetch failed or was cancelled)."""

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows [..., H, D]; raises the fetch's error, CancelledError, or TimeoutError after `timeout` s."""

    def cancel(self) -> bool:
        """Abandon the fetch; True if it was stopped before delivering."""

    @property
    def cancelled(self) -> bool:
        """True once cancel() was asked and the fetch did not deliver."""


@runtime_checkable
class RowStore(Protocol):
    """Per-head row ids int64 [..., H] in, rows [..., H, D] out: what TieredTable and DeviceTable offer callers."""

    cache: RowCache | NativeRowCache | None  # the hot-row cache (DeviceRowCache is a RowCache), or None

    @property
    def num_heads(self) -> int:
        """H: hash heads, the last axis of the ids."""

    @property
    def dim(self) -> int:
        """D: values per row."""

    def lookup(self, row_ids: RowIds, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows [..., H, D] of ids [..., H] (into `out` if given); IndexError names head and id."""

    def prefetch(self, row_ids: RowIds) -> RowTicket:
        """Start fetching now; `ticket.wait()` gives what `lookup` would, `ticket.cancel()` abandons it."""

    def warm(self, row_ids: RowIds, *, urgent: bool = False) -> RowTicket | None:
        """Read rows into the cache ahead of need (advisory; None without a cache); `urgent`: before the next step."""

    def stats(self) -> dict[str, object]:
        """Counters since open: ids, unique ids, hits, misses per head, bytes per tier, cache occupancy."""

    def close(self) -> None:
        """Release threads, files and registered memory."""


class TableBase:
    """What TieredTable and DeviceTable share: num_heads, dim, cache_stats() and `with`."""

    manifest: TableManifest
    cache: RowCache | NativeRowCache | None

    @property
    def num_heads(self) -> int:
        """H: hash heads, the last axis of the ids."""
        return self.manifest.n_heads

    @property
    def dim(self) -> int:
        """D: values per row."""
        return self.manifest.dim

    def cache_stats(self) -> dict[str, object]:
        """The hot-row cache's occupancy, policy and counters, as stats() reports them under "cache"."""
        c = self.cache
        return {"rows": len(c), "capacity_rows": c.capacity, "bytes": c.nbytes, "policy": c.policy.name,
                **vars(c.counters)}

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
