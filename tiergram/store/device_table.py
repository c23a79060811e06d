"""DeviceTable: the store contract with rows delivered into accelerator memory (docs/accelerator.md)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import CancelledError, ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch

from tiergram import _native
from tiergram.codecs import check_out_dtype
from tiergram.format import TableFile
from tiergram.format.ids import check_in_range, check_row_ids
from tiergram.kernels import RowLayout, gather_dequant, pick_backend
from tiergram.store.contract import TableBase
from tiergram.store.device_cache import DeviceRowCache
from tiergram.store.stats import StoreStats, per_head_counts
from tiergram.store.ticket import Ticket
from tiergram.tiers import FileTier, HostTier
from tiergram.tiers.device import DeviceTier, PinnedHost, resolve_device

TIERS = ("device", "host", "file")


class DeviceTicket(Ticket):
    """A fetch in flight on the table's side stream; `wait()` makes the current stream wait on its event."""

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """The rows [..., H, D] on the device (the caller's stream ordered after them); raises the fetch's error."""
        rows, event = self._future.result(timeout)
        if event is not None:
            torch.cuda.current_stream(rows.device).wait_event(event)
        return rows

    def done(self) -> bool:
        """True once the rows are on the device (or the fetch failed or was cancelled)."""
        if not self._future.done():
            return False
        if self._future.cancelled() or self._future.exception() is not None:
            return True
        _rows, event = self._future.result()
        return event is None or event.query()


class DeviceTable(TableBase):
    """One Engram layer's table served into device memory by the fused gather + dequant kernel (docs/accelerator.md).

    tier 'device': resident in HBM; 'host': in DRAM (shared=True: the /dev/shm copy) read by the kernel through UVA;
    'file': read into pinned staging and copied over. `cache_bytes` adds an HBM hot-row cache (host and file tiers).
    `staging_tokens`: prefetches land in `n_staging` buffers of stable address, used in turn."""

    def __init__(self, path: str | os.PathLike, *, device: torch.device | str | None = None, tier: str = "host",
                 dtype: torch.dtype = torch.float32, cache_bytes: int = 0, cache_policy: str = "lru",
                 shared: bool = False, file_mode: str = "direct", queue_depth: int = 128, kernel_backend: str = "auto",
                 staging_tokens: int = 0, n_staging: int = 2, progress: bool = False) -> None:
        check_out_dtype(dtype)
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r} (valid: {', '.join(TIERS)})")
        if tier == "device" and cache_bytes:
            raise ValueError("a device-tier table is already in device memory: cache_bytes applies to host/file")
        self.device = resolve_device(device)
        self.kernel_backend = pick_backend(self.device, kernel_backend)
        if tier == "host" and self.device.type == "cuda" and self.kernel_backend == "torch":
            raise ValueError("reading a host table from the GPU needs the Triton kernel (UVA); kernel_backend 'torch' "
                             "cannot: use kernel_backend 'auto' or 'triton', or tier 'device'")
        self.table = TableFile.open(Path(path))
        self.manifest = m = self.table.manifest
        self.layout = RowLayout.of(m)
        self.dtype = dtype
        self._offsets = self.table.head_offsets
        self._rows = self.table.head_rows
        self.pinned: PinnedHost | None = None
        if tier == "device":
            self.tier: DeviceTier | HostTier | FileTier = DeviceTier(self.table, self.device, progress=progress)
            self.data: torch.Tensor | None = self.tier.data
        elif tier == "host":
            self.tier = HostTier(self.table, shared=shared, progress=progress)
            try:
                self.pinned = PinnedHost(self.tier.data, self.device)
            except BaseException:
                self.tier.close()
                raise
            self.data = self.pinned.tensor
        else:
            self.tier = FileTier(self.table, mode=file_mode, queue_depth=queue_depth)
            self.data = None
        self.cache = (DeviceRowCache.from_bytes(cache_bytes, m.row_bytes, cache_policy, device=self.device)
                      if cache_bytes else None)
        self.stats_ = StoreStats(m.n_heads, m.row_bytes)
        self._offsets_dev = torch.as_tensor(self._offsets, device=self.device)
        self._zero_dev = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiergram-device")
        self._staging = [torch.empty((staging_tokens, m.n_heads, m.dim), dtype=dtype, device=self.device)
                         for _ in range(n_staging if staging_tokens > 0 else 0)]
        self._next_staging = 0

    def lookup(self, row_ids: np.ndarray | torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Rows for per-head ids [..., H] as [..., H, D] on the device; IndexError names head and id."""
        return self._submit(row_ids, out, staged=False).wait()

    def prefetch(self, row_ids: np.ndarray | torch.Tensor) -> DeviceTicket:
        """Start the fetch on the side stream; `ticket.wait()` returns what `lookup` would."""
        return self._submit(row_ids, None, staged=True)

    def warm(self, row_ids: np.ndarray | torch.Tensor, *, urgent: bool = False) -> DeviceTicket | None:
        """Fetch rows of ids [..., H] into the HBM cache in the prefetches' order (None without a cache)."""
        if self.cache is None:
            return None
        return self._submit(row_ids, None, staged=False)

    def stats(self) -> dict:
        """Lookups, unique ids, hits, misses per head; bytes per tier; cache occupancy and counters."""
        snap = self.stats_.snapshot()
        snap.update(tier=self.tier.name, device=str(self.device), kernel_backend=self.kernel_backend)
        if self.cache is not None:
            snap["cache"] = self.cache_stats()
        return snap

    def close(self) -> None:
        """Finish queued work, unregister host memory, release the tier."""
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._cuda:  # kernels still queued read the tier and write the cache: done before either is freed
            self._stream.synchronize()
        if self.pinned is not None:
            self.pinned.close()
        self.tier.close()

    def _submit(self, row_ids, out: torch.Tensor | None, *, staged: bool) -> DeviceTicket:
        on_device = isinstance(row_ids, torch.Tensor) and row_ids.device.type != "cpu" and row_ids.device == self.device
        ids = check_row_ids(row_ids, self._rows, host=not on_device, check_range=False)
        if isinstance(ids, np.ndarray):
            check_in_range(ids, self._rows)  # a bad host id fails here, in the caller (device ids: before launch)
        out = self._output(tuple(ids.shape), out, staged)
        uniq = batch = None
        if self.cache is not None:
            if isinstance(ids, torch.Tensor):
                ids = ids.cpu().numpy()  # the host decides hits and admission
            uniq = np.unique(ids.reshape(-1, self.num_heads) + self._offsets)
            batch = self.cache.announce(uniq)
        ready = None
        if self._cuda:  # the fetch starts after what the caller queued so far (e.g. reads of older staging)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        cancelled = threading.Event()

        def run() -> tuple[torch.Tensor, torch.cuda.Event | None]:
            if cancelled.is_set():
                if batch is not None:
                    self.cache.retire(batch)
                raise CancelledError
            stream_ctx = torch.cuda.stream(self._stream) if self._cuda else nullcontext()
            with torch.cuda.device(self.device) if self._cuda else nullcontext(), stream_ctx:
                if ready is not None:
                    self._stream.wait_event(ready)
                if self._cuda:  # memory the caller's stream owns, used here: not reused before this stream is past it
                    out.record_stream(self._stream)
                    if isinstance(ids, torch.Tensor):  # the caller may drop its ids once prefetch returns
                        ids.record_stream(self._stream)
                self._fetch(ids, out.view(-1, self.num_heads, self.dim), uniq, batch)
                if not self._cuda:
                    return out, None
                done = torch.cuda.Event()
                done.record(self._stream)
                return out, done

        retire = (lambda: self.cache.retire(batch)) if self.cache is not None else (lambda: None)
        return DeviceTicket(self._executor.submit(run), cancelled, retire)

    def _output(self, id_shape: tuple[int, ...], out: torch.Tensor | None, staged: bool) -> torch.Tensor:
        shape = (*id_shape, self.dim)
        positions = int(np.prod(id_shape[:-1]))
        if out is not None:
            if tuple(out.shape) != shape or out.dtype != self.dtype or not out.is_contiguous() \
                    or out.device != self.device:
                raise ValueError(f"out must be a contiguous {self.dtype} tensor {list(shape)} on {self.device}")
            return out
        if staged and self._staging and positions <= self._staging[0].shape[0]:
            buf = self._staging[self._next_staging]
            self._next_staging = (self._next_staging + 1) % len(self._staging)
            return buf[:positions].view(shape)
        return torch.empty(shape, dtype=self.dtype, device=self.device)

    def _fetch(self, ids: np.ndarray | torch.Tensor, out: torch.Tensor, uniq: np.ndarray | None,
               batch: int | None) -> None:
        """Fill out [N, H, D] on the device (runs on the worker, inside the side stream)."""
        m, h = self.manifest, self.num_heads
        n_ids = np.full(h, out.shape[0], dtype=np.int64)
        if out.shape[0] == 0:
            if batch is not None:
                self.cache.retire(batch)
            self.stats_.record(ids=n_ids)
            return
        if self.cache is not None:
            self._fetch_cached(ids, out, uniq, batch)
        elif self.data is not None:  # device tier, or host tier through UVA
            gather_dequant(self.data, ids.reshape(-1, h), self.layout, self._offsets, self._rows, out=out,
                           device=self.device, offsets_dev=self._offsets_dev, backend=self.kernel_backend)
            self.stats_.record(ids=n_ids, tier_bytes={self.tier.name: out.shape[0] * h * m.row_bytes})
        else:  # file tier: unique rows staged, then gathered by position in the staging buffer
            flat = (ids.cpu().numpy() if isinstance(ids, torch.Tensor) else ids).reshape(-1, h)
            self.tier.check_ids(flat)
            keys, inverse = np.unique(flat + self._offsets, return_inverse=True)
            staged, pages = self._stage(keys)
            gather_dequant(staged, inverse.reshape(-1, 1), RowLayout.packed(m.codec, m.dim), [0], [keys.size],
                           out=out.view(-1, 1, self.dim), device=self.device, offsets_dev=self._zero_dev,
                           backend=self.kernel_backend)
            per_head = per_head_counts(keys, self._offsets)
            self.stats_.record(ids=n_ids, unique=per_head, misses=per_head, tier_bytes={"file": pages * m.page_size},
                               pages=pages)

    def _fetch_cached(self, ids: np.ndarray, out: torch.Tensor, uniq: np.ndarray, batch: int | None) -> None:
        """Probe the HBM cache on the host, then one launch: hits from the cache, misses from the tier (filled)."""
        m, cache, h = self.manifest, self.cache, self.num_heads
        flat = ids.reshape(-1, h)
        try:
            self.tier.check_ids(flat)
            glob = (flat + self._offsets).reshape(-1)
            inverse = np.searchsorted(uniq, glob)
            slots, fill = cache.plan(uniq, batch)
            batch = None  # probing retired it
        finally:
            if batch is not None:
                cache.retire(batch)
        miss = slots < 0
        try:
            first = np.empty(uniq.size, dtype=np.int64)
            first[inverse[::-1]] = np.arange(glob.size - 1, -1, -1)  # first position of every unique key
            fill_id = np.full(glob.size, -1, dtype=np.int64)
            fill_id[first] = fill  # one writer per filled slot
            if self.data is not None:  # host tier: misses read through UVA at their page address
                pages = 0
                gather_dequant(self.data, flat, self.layout, self._offsets, self._rows, cache=cache.slots,
                               slots=slots[inverse], fill=fill_id, out=out, device=self.device,
                               offsets_dev=self._offsets_dev, backend=self.kernel_backend)
            else:  # file tier: misses staged, addressed by their position in the staging buffer
                n_miss = int(miss.sum())
                pos = np.zeros(uniq.size, dtype=np.int64)
                pos[miss] = np.arange(n_miss)
                staged, pages = (self._stage(uniq[miss]) if n_miss
                                 else (torch.zeros(m.row_bytes, dtype=torch.uint8, device=self.device), 0))
                gather_dequant(staged, pos[inverse].reshape(-1, 1), RowLayout.packed(m.codec, m.dim), [0],
                               [max(1, n_miss)], cache=cache.slots, slots=slots[inverse], fill=fill_id,
                               out=out.view(-1, 1, self.dim), device=self.device, offsets_dev=self._zero_dev,
                               backend=self.kernel_backend)
            cache.set_tags(fill[fill >= 0], uniq[fill >= 0])
        finally:
            cache.unpin(slots)  # later launches on this stream run after this one: the slots may be reused
        tier_bytes = pages * m.page_size if self.data is None else int(miss.sum()) * m.row_bytes
        self.stats_.record(ids=np.full(h, flat.shape[0], dtype=np.int64), unique=per_head_counts(uniq, self._offsets),
                           hits=per_head_counts(uniq[~miss], self._offsets),
                           misses=per_head_counts(uniq[miss], self._offsets),
                           tier_bytes={"cache": int((~miss).sum()) * m.row_bytes, self.tier.name: tier_bytes},
                           pages=pages)

    def _stage(self, keys: np.ndarray) -> tuple[torch.Tensor, int]:
        """(rows of global keys [n] as uint8 [n * row_bytes] on the device, pages read), through pinned memory."""
        m = self.manifest
        buf, offsets, pages = self.tier.read_rows(keys)
        host = torch.empty(keys.size * m.row_bytes, dtype=torch.uint8, pin_memory=self._cuda)
        _native.decode_at(buf, offsets, m.codec_id, m.dim, host.numpy().reshape(keys.size, m.row_bytes))
        return (host.to(self.device, non_blocking=True) if self._cuda else host), pages
