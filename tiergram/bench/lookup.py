"""`tiergram bench lookup`: gather + dequant rate against the memcpy-gather limit and a numpy baseline."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tiergram import _native
from tiergram.bench.common import cache_dir, draw_ids, rate
from tiergram.codecs import get_codec
from tiergram.format import TableFile, TableManifest, create_table, random_values
from tiergram.store import TieredTable


@dataclass
class LookupBenchConfig:
    """Shapes of the lookup benchmark; defaults follow DeepSeek-V4.1 (24 heads per layer, D = 256, fp8)."""

    heads: int = 24
    rows_per_head: int = 65537
    dim: int = 256
    codec: str = "fp8_e4m3"
    positions: int = 2048  # token positions per lookup call
    dists: tuple[str, ...] = ("uniform", "zipf")
    dtype: str = "float32"
    min_time: float = 1.0
    threads: int = 0  # 0: the native pool's default
    seed: int = 0


@dataclass
class LookupBenchResult:
    config: LookupBenchConfig
    row_bytes: int
    table_bytes: int
    threads: int
    per_dist: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def summary(self) -> dict[str, float]:
        """Headline figures: the worst distribution's rates (a conservative reading)."""
        worst = min(self.per_dist.values(), key=lambda d: d["tiergram_rows_per_s"] / d["limit_rows_per_s"])
        return {k: worst[k] for k in ("tiergram_rows_per_s", "limit_rows_per_s", "numpy_rows_per_s",
                                      "vs_limit", "vs_numpy")}


def bench_table(cfg: LookupBenchConfig, progress: bool = True) -> TableFile:
    """The benchmark's table file in the cache (created once with random N(0,1) rows)."""
    name = f"bench-{cfg.codec}-{cfg.heads}x{cfg.rows_per_head}x{cfg.dim}.tgram"
    path = cache_dir("bench") / name
    manifest = TableManifest(codec=cfg.codec, dim=cfg.dim, head_rows=(cfg.rows_per_head,) * cfg.heads,
                             provenance={"tool": "tiergram bench lookup", "init": "normal(0, 1), seed 0"})
    if path.exists():
        try:
            table = TableFile.open(path)
            if table.manifest.head_rows == manifest.head_rows and table.manifest.codec == cfg.codec:
                return table
        except ValueError:
            pass  # stale or damaged cache file: rebuild
    create_table(path, manifest, random_values(cfg.dim, seed=0), progress=progress)
    return TableFile.open(path)


def numpy_lookup(data: np.ndarray, table: TableFile, ids: np.ndarray) -> np.ndarray:
    """The baseline others use: numpy.take of the rows, then a numpy dequant to float32 [N, H, D]."""
    m = table.manifest
    rows_view = np.lib.stride_tricks.as_strided(
        data, shape=(m.n_pages, m.rows_per_page, m.row_bytes), strides=(m.page_size, m.row_bytes, 1)
    ).reshape(-1, m.row_bytes) if m.page_size != m.rows_per_page * m.row_bytes else data.reshape(-1, m.row_bytes)
    glob = ids + table.head_offsets
    raw = np.take(rows_view, glob.reshape(-1), axis=0)
    return get_codec(m.codec).decode(raw, m.dim).numpy().reshape(*ids.shape, m.dim)


def run(cfg: LookupBenchConfig, progress: bool = True) -> LookupBenchResult:
    """Measure limit, tiergram and numpy rates for each id distribution."""
    if cfg.threads:
        _native.set_num_threads(cfg.threads)
    table = bench_table(cfg, progress)
    store = TieredTable(table.path, tier="host", dtype=getattr(torch, cfg.dtype), progress=progress)
    m = table.manifest
    res = LookupBenchResult(cfg, m.row_bytes, m.data_bytes, _native.num_threads())
    rng = np.random.default_rng(cfg.seed)
    n_rows = cfg.positions * cfg.heads
    raw = np.empty((cfg.positions, cfg.heads, m.row_bytes), dtype=np.uint8)
    out = torch.empty((cfg.positions, cfg.heads, m.dim), dtype=store.dtype)
    for dist in cfg.dists:
        ids = draw_ids(dist, (cfg.positions, cfg.heads), table.head_rows, rng)
        limit = rate(lambda: store.tier.gather(ids, raw), n_rows, min_time=cfg.min_time)  # noqa: B023
        ours = rate(lambda: store.lookup(ids, out=out), n_rows, min_time=cfg.min_time)  # noqa: B023
        base = rate(lambda: numpy_lookup(store.tier.data, table, ids), n_rows, min_time=cfg.min_time)  # noqa: B023
        res.per_dist[dist] = {"tiergram_rows_per_s": ours, "limit_rows_per_s": limit, "numpy_rows_per_s": base,
                              "vs_limit": ours / limit, "vs_numpy": ours / base}
    store.close()
    return res


def to_json(res: LookupBenchResult) -> str:
    """One JSON object: the headline keys at top level, then per-distribution figures and the config."""
    obj = {**res.summary, "row_bytes": res.row_bytes, "table_bytes": res.table_bytes, "threads": res.threads,
           "per_dist": res.per_dist, "config": asdict(res.config)}
    return json.dumps(obj, indent=2)


def to_text(res: LookupBenchResult) -> str:
    """A table of rows/s and ratios per distribution."""
    c = res.config
    lines = [f"host lookup: {c.heads} heads x {c.rows_per_head} rows, D={c.dim} {c.codec} ({res.row_bytes} B/row), "
             f"table {res.table_bytes / 2**20:.0f} MiB, {c.positions} positions/call, out {c.dtype}, "
             f"{res.threads} native threads",
             f"{'ids':<9}{'memcpy limit':>14}{'tiergram':>12}{'numpy':>12}{'vs limit':>10}{'vs numpy':>10}"]
    for dist, d in res.per_dist.items():
        lines.append(f"{dist:<9}{d['limit_rows_per_s'] / 1e6:>11.2f} M/s{d['tiergram_rows_per_s'] / 1e6:>9.2f} M/s"
                     f"{d['numpy_rows_per_s'] / 1e6:>9.2f} M/s{d['vs_limit']:>9.0%}{d['vs_numpy']:>9.1f}x")
    return "\n".join(lines)
