"""Engram tables for the engine: exported into the model directory on first use, opened per placement."""

from __future__ import annotations

import fcntl
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from tiergram.engine.config import Placement
from tiergram.hashing import NgramHasher
from tiergram.model.checkpoint import CONFIG, EXPORT_SUBDIR, WEIGHTS
from tiergram.model.export import export_model, table_filename
from tiergram.model.hot_rows import load_hot_rows
from tiergram.model.model_dir import ModelDir
from tiergram.store import TieredTable
from tiergram.store.device_table import DeviceTable
from tiergram.store.table import PRELOAD_PARTS, budget_cache_bytes


def export_dir_for(model: ModelDir, layers: list[int], codecs: set[str]) -> ModelDir:
    """The directory with a table file per layer and codec: an exported one, or DIR/export (re)exported under a lock."""
    if model.exported:
        missing = [model.table_path(layer, c).name for c in sorted(codecs) for layer in layers
                   if not model.table_path(layer, c).is_file()]
        if missing:
            raise ValueError(f"{model.path} is an exported model without {', '.join(missing)}: export its training "
                             "directory with that codec, or pick a placement codec it has")
        return model
    model_dir = model.path
    out = model_dir / EXPORT_SUBDIR
    out.mkdir(exist_ok=True)
    trained = (model_dir / WEIGHTS).stat().st_mtime_ns
    with open(out / ".engine-export.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another engine exporting the same directory waits here
        for codec in sorted(codecs):
            files = [out / table_filename(layer, codec) for layer in layers] + [out / WEIGHTS, out / CONFIG]
            if not all(f.is_file() and f.stat().st_mtime_ns >= trained for f in files):
                export_model(model_dir, codec, out, progress=False)
    return ModelDir.open(out)


def open_table(path: Path, placement: Placement, device: torch.device) -> Any:
    """A row source for one layer: DeviceTable on the device (and for host / file on a GPU), else TieredTable."""
    if placement.kind == "device":
        return DeviceTable(path, device=device, tier="device")
    cache_bytes, budget = check_host_memory(path, placement)
    if placement.kind == "mooncake":
        if device.type == "cuda":
            raise ValueError("placement 'mooncake' is served by the CPU engine only (the GPU path reads host or "
                             "file tables)")
        from tiergram.tiers.mooncake import ensure_pushed  # optional dependency (the remote extra)

        path = ensure_pushed(path, placement.master)
    elif device.type == "cuda":
        return DeviceTable(path, device=device, tier=placement.kind, cache_bytes=placement.cache_bytes,
                           cache_policy=placement.cache_policy, file_mode=placement.file_mode)
    return TieredTable(path, tier=placement.kind, cache_bytes=cache_bytes, cache_policy=placement.cache_policy,
                       file_mode=placement.file_mode, host_memory_bytes=budget)


# a DeviceTable's preload gathers each warm-up part into a scratch [positions, H, D] on the device: parts of at most
DEVICE_PRELOAD_POSITIONS = 4096


def preload_hot_rows(sources: dict[int, Any], path: str, hasher: NgramHasher) -> dict[int, int]:
    """Fill each cached table with its hottest rows from a hot-rows file, coldest first; {layer: rows preloaded}."""
    hot = load_hot_rows(path, hasher)
    loaded = {}
    cached = {layer: src for layer, src in sources.items()
              if isinstance(src, TieredTable | DeviceTable) and src.cache is not None}
    bar = tqdm(total=len(cached), desc="preloading hot rows", unit="table", disable=None)
    for layer, src in cached.items():
        capacity = int(src.stats()["cache"]["capacity_rows"])
        heads = hot.per_head(layer, hasher.head_sizes(layer), capacity)
        n = max((h.size for h in heads), default=0)
        # [n, H] coldest first; a head with fewer hot rows repeats its coldest one (or row 0 if it has none)
        ids = np.stack([np.concatenate([np.full(n - h.size, h[-1] if h.size else 0, dtype=np.int64), h[::-1]])
                        for h in heads], axis=1)
        if isinstance(src, TieredTable):
            src.preload(ids, progress=bar.disable is False)
        else:
            for part in np.array_split(ids, max(PRELOAD_PARTS, -(-n // DEVICE_PRELOAD_POSITIONS))):
                if part.size:
                    src.warm(part).wait()
        bar.update()
        loaded[layer] = int(sum(h.size for h in heads))
    bar.close()
    return loaded


def check_host_memory(path: Path, placement: Placement) -> tuple[int | None, int | None]:
    """(cache_bytes, host_memory_bytes) for a host / file table in its host-memory share; ValueError if too big."""
    budget = placement.host_memory_bytes
    if budget is None:
        return placement.cache_bytes, None
    from tiergram.format import TableFile

    m = TableFile.open(path).manifest
    if placement.kind == "host":
        if m.data_bytes > budget:
            raise ValueError(f"host placement: {path.name} (layer {m.layer_id}) needs {m.data_bytes:,} bytes "
                             f"({m.data_bytes / 2**30:.2f} GiB) of host memory, more than its share of {budget:,} "
                             f"bytes ({budget / 2**30:.2f} GiB) of the host-memory budget; use placement 'file' (its "
                             "cache is sized to the budget) or raise --host-memory")
        return 0, budget
    if not placement.cache_bytes:
        return None, budget  # the tier sizes its cache from the budget (what staging and index leave)
    room = budget_cache_bytes(budget, m.row_bytes, "python")  # the larger index: a safe bound
    if placement.cache_bytes > room:
        raise ValueError(f"{placement.kind} placement: a cache of {placement.cache_bytes:,} bytes for {path.name} does "
                         f"not fit its share of {budget:,} bytes of the host-memory budget (staging and the cache's "
                         f"index leave {room:,} bytes for rows); lower --cache-bytes or leave it out to size the cache "
                         "from the budget")
    return placement.cache_bytes, budget


def device_bytes(source: Any, placement: Placement, device: torch.device) -> int:
    """Device bytes of a table: its data region when device-placed, its HBM cache on a GPU, else 0."""
    if placement.kind == "device":
        return int(source.manifest.data_bytes)
    return int(placement.cache_bytes) if device.type == "cuda" else 0


def table_stats(sources: dict[int, Any], placements: dict[int, Placement]) -> dict[str, Any]:
    """The tables' counters summed (hit rate, bytes and pages read, warmed rows), and per layer."""
    total: Counter[str] = Counter()
    sums = dict.fromkeys(("pages_read", "pages_first_read", "pages_stalled", "warmed_rows"), 0)
    hits = probed = 0
    per_layer = {}
    for layer, source in sources.items():
        s = source.stats()
        total.update(s["bytes_read"])
        for key in sums:
            sums[key] += s.get(key, 0)
        if "cache" in s:
            hits, probed = hits + s["hits"], probed + s["hits"] + s["misses"]
        p = placements[layer]
        per_layer[layer] = {"placement": p.kind, "codec": p.codec, "cache_bytes": p.cache_bytes,
                            "hit_rate": s["hit_rate"] if "cache" in s else None, "lookups": s["lookups"],
                            "bytes_read": s["bytes_read"], "pages_read": s["pages_read"],
                            "warmed_rows": s.get("warmed_rows", 0)}
    return {"cache_hit_rate": hits / probed if probed else None, "cache_hits": hits, "cache_probes": probed,
            "bytes_read": dict(total), **sums, "per_layer": per_layer}
