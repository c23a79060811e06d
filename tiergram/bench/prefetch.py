"""`tiergram bench prefetch`: how much of a fetch a prefetch hides behind the layers before the Engram layer.

Per step: `ticket = store.prefetch(ids)`, a torch compute standing in for the earlier layers (sized to about the
synchronous fetch time, or `compute_ms`), then `ticket.wait()`: the time blocked there is the *exposed stall*,
against a synchronous `store.lookup(ids)` of the same ids, whose rows it must equal (docs/benchmarks.md, "Overlap").
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tiergram.bench.common import draw_ids, log
from tiergram.bench.file_lookup import FileLookupBenchConfig, bench_file_table
from tiergram.format import TableFile
from tiergram.store import TieredTable

STORES = ("host", "file", "file+cache")


@dataclass
class PrefetchBenchConfig:
    """Batch shape, steps, stores and compute of the prefetch benchmark (defaults: V4.1-like fp8 rows, 24 heads)."""

    table_gib: float = 2.0  # the table of `bench lookup --tier file` (shared, created once)
    heads: int = 24
    rows_per_head: int = 0  # 0: as many as table_gib holds
    dim: int = 256
    table: str | None = None
    positions: int = 64  # token positions per step
    steps: int = 200
    warmup: int = 10  # steps run before the measured ones (other ids)
    dist: str = "zipf"
    stores: tuple[str, ...] = STORES
    cache_fraction: float = 0.10  # of the table's data bytes, for "file+cache"
    cache_policy: str = "lru"
    compute_ms: float = 0.0  # 0: per store, about its synchronous fetch time
    hidden: int = 512  # width of the compute's matmuls
    torch_threads: int = 1
    seed: int = 0


@dataclass
class PrefetchBenchResult:
    config: PrefetchBenchConfig
    table: dict[str, object]
    per_store: dict[str, dict[str, object]] = field(default_factory=dict)
    seconds: float = 0.0


def _ms(values: list[float]) -> dict[str, float]:
    a = np.asarray(values) * 1e3
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


class Compute:
    """`layers` x (h = tanh(h @ W)) on hidden states [positions, hidden]: the layers before the Engram layer."""

    def __init__(self, positions: int, hidden: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.h0 = torch.randn(positions, hidden, generator=g)
        self.w = torch.randn(hidden, hidden, generator=g) / hidden**0.5
        self.layers = 1

    def __call__(self) -> torch.Tensor:
        h = self.h0
        for _ in range(self.layers):
            h = torch.tanh(h @ self.w)
        return h

    def size_to(self, seconds: float) -> float:
        """Choose the layer count that takes about `seconds`; returns the measured seconds per call."""
        self.layers = 20
        self()
        t0 = time.perf_counter()
        for _ in range(3):
            self()
        per_layer = (time.perf_counter() - t0) / 60
        self.layers = max(1, round(seconds / per_layer))
        self()
        t0 = time.perf_counter()
        for _ in range(5):
            self()
        return (time.perf_counter() - t0) / 5


def _digest(rows: torch.Tensor) -> str:
    return hashlib.blake2b(rows.contiguous().view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()


def open_store(table: TableFile, kind: str, cfg: PrefetchBenchConfig) -> TieredTable:
    """The store `kind` names: host, file (O_DIRECT), file+cache (O_DIRECT + cache_fraction of the table)."""
    cache = int(cfg.cache_fraction * table.manifest.data_bytes) if kind == "file+cache" else 0
    return TieredTable(table.path, tier=kind.removesuffix("+cache"), cache_policy=cfg.cache_policy, cache_bytes=cache)


def run_store(table: TableFile, kind: str, cfg: PrefetchBenchConfig, warm: list[np.ndarray],
              steps: list[np.ndarray], compute: Compute) -> dict[str, object]:
    """The synchronous pass, then the overlapped pass (on a fresh store when there is a cache: the same history)."""
    store = open_store(table, kind, cfg)
    out: dict[str, object] = {}
    try:
        for ids in warm:
            store.lookup(ids)
        sync, digests = [], []
        for ids in steps:
            t0 = time.perf_counter()
            rows = store.lookup(ids)
            sync.append(time.perf_counter() - t0)
            digests.append(_digest(rows))
        if store.cache is not None:
            store.close()
            store = open_store(table, kind, cfg)
            for ids in warm:
                store.lookup(ids)
        target = cfg.compute_ms / 1e3 if cfg.compute_ms > 0 else float(np.mean(sync))
        compute_alone = compute.size_to(target)
        stalls, match = [], True
        for ids, want in zip(steps, digests, strict=True):
            ticket = store.prefetch(ids)
            compute()
            t0 = time.perf_counter()
            rows = ticket.wait()
            stalls.append(time.perf_counter() - t0)
            match &= _digest(rows) == want
        if store.cache is not None:
            out["hit_rate"] = store.stats()["hit_rate"]
        stall, sync_ms = _ms(stalls), _ms(sync)
        out.update({
            "stall_ms": stall, "sync_stall_ms": sync_ms, "compute_ms": compute_alone * 1e3, "layers": compute.layers,
            "exposed_ratio": stall["mean"] / sync_ms["mean"], "rows_match": bool(match),
            "pages_per_step": store.stats()["pages_read"] / (len(steps) + len(warm)),
            # the read mode in use (None for host): 'buffered' where the filesystem refused O_DIRECT
            "file_mode": store.stats().get("file_mode")})
        return out
    finally:
        store.close()


def run(cfg: PrefetchBenchConfig, progress: bool = True) -> PrefetchBenchResult:
    """Measure every store in cfg.stores on the same id batches."""
    if cfg.positions < 1 or cfg.steps < 1 or cfg.warmup < 0 or cfg.torch_threads < 1:
        raise ValueError("positions, steps and torch_threads must be >= 1, warmup >= 0")
    if not 0 < cfg.cache_fraction <= 1:
        raise ValueError(f"cache_fraction must be in (0, 1], got {cfg.cache_fraction}")
    for kind in cfg.stores:
        if kind not in STORES:
            raise ValueError(f"unknown store {kind!r} (valid: {', '.join(STORES)})")
    t_start = time.perf_counter()
    table = bench_file_table(FileLookupBenchConfig(table_gib=cfg.table_gib, heads=cfg.heads,
                                                   rows_per_head=cfg.rows_per_head, dim=cfg.dim,
                                                   table=cfg.table), progress)
    m = table.manifest
    res = PrefetchBenchResult(cfg, {"path": str(table.path), "bytes": table.data_offset + m.data_bytes,
                                    "rows": m.total_rows, "row_bytes": m.row_bytes})
    rng = np.random.default_rng(cfg.seed)
    shape = (cfg.positions, cfg.heads)
    warm = [draw_ids(cfg.dist, shape, table.head_rows, rng) for _ in range(cfg.warmup)]
    steps = [draw_ids(cfg.dist, shape, table.head_rows, rng) for _ in range(cfg.steps)]
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.torch_threads)
    try:
        compute = Compute(cfg.positions, cfg.hidden, cfg.seed)
        for kind in cfg.stores:
            res.per_store[kind] = d = run_store(table, kind, cfg, warm, steps, compute)
            log(progress, f"  {kind}: stall {d['stall_ms']['mean']:.3f} ms vs synchronous "
                          f"{d['sync_stall_ms']['mean']:.3f} ms")
    finally:
        torch.set_num_threads(threads)
    res.seconds = time.perf_counter() - t_start
    return res


def to_json(res: PrefetchBenchResult) -> str:
    """One JSON object: per store the stall figures and their ratio; the table and the config."""
    return json.dumps({"stores": res.per_store,
                       "exposed_ratio": {k: d["exposed_ratio"] for k, d in res.per_store.items()},
                       "table": res.table, "seconds": res.seconds, "config": asdict(res.config)}, indent=2)


def to_text(res: PrefetchBenchResult) -> str:
    """Per store: synchronous stall, exposed stall with prefetch (mean/p50/p90), compute, the ratio."""
    c = res.config
    lines = [f"prefetch overlap: {c.positions} positions x {c.heads} heads per step, {c.dist} ids, {c.steps} steps, "
             f"table {res.table['path']} ({res.table['bytes'] / 2**30:.2f} GiB), torch threads {c.torch_threads}",
             f"{'store':<12}{'sync stall ms':>22}{'exposed stall ms':>24}{'compute ms':>12}{'exposed/sync':>14}"
             f"{'hit rate':>10}",
             f"{'':<12}{'mean    p50    p90':>22}{'mean    p50    p90':>24}"]
    for kind, d in res.per_store.items():
        s, e = d["sync_stall_ms"], d["stall_ms"]
        hit = f"{d['hit_rate']:>9.0%}" if d.get("hit_rate") is not None else f"{'':>9}"
        lines.append(f"{kind:<12}{s['mean']:>8.2f}{s['p50']:>7.2f}{s['p90']:>7.2f}"
                     f"{e['mean']:>10.2f}{e['p50']:>7.2f}{e['p90']:>7.2f}{d['compute_ms']:>12.2f}"
                     f"{d['exposed_ratio']:>13.0%}{hit}" + ("" if d["rows_match"] else "  ROWS DIFFER"))
    lines.append("exposed stall: end of compute to rows ready, with the prefetch started before the compute; "
                 "sync stall: the whole lookup of the same ids")
    modes = {kind: d["file_mode"] for kind, d in res.per_store.items() if d.get("file_mode")}
    if modes:
        lines.append("file reads: " + ", ".join(f"{kind} {mode}" for kind, mode in modes.items())
                     + ("" if set(modes.values()) == {"direct"} else
                        " (buffered: O_DIRECT refused, the reads went through the page cache, not to the disk)"))
    lines.append(f"({res.seconds:.0f} s)")
    return "\n".join(lines)
