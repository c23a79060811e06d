"""`tiergram bench lookup`: gather + dequant rate against the memcpy-gather limit and a numpy baseline."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tiergram import _native
from tiergram.bench.common import cache_dir, draw_ids, rates_interleaved
from tiergram.codecs import FP8_E4M3FN_VALUES, get_codec
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
    rounds: int = 5  # interleaved segments per measurement; the best is kept
    seconds: float = 0.2  # length of one segment
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
    """The baseline others use: numpy fancy-index gather of the rows, then a vectorised numpy dequant
    (fp8: a 256-entry value table and the block scales; other codecs: the reference decoder) to
    float32 [N, H, D]."""
    m = table.manifest
    pages = np.lib.stride_tricks.as_strided(
        data, shape=(m.n_pages, m.rows_per_page, m.row_bytes), strides=(m.page_size, m.row_bytes, 1))
    page, slot = np.divmod((ids + table.head_offsets).reshape(-1), m.rows_per_page)
    raw = pages[page, slot]  # [N*H, row_bytes]
    if m.codec == "fp8_e4m3":
        values = FP8_E4M3FN_VALUES[raw[:, :m.dim]].reshape(raw.shape[0], -1, 32)
        scales = np.exp2(raw[:, m.dim:].astype(np.float32) - 127.0)[:, :, None]
        return (values * scales).reshape(*ids.shape, m.dim)
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
        r = rates_interleaved({
            "limit": lambda: store.tier.gather(ids, raw),  # noqa: B023
            "tiergram": lambda: store.lookup(ids, out=out),  # noqa: B023
            "numpy": lambda: numpy_lookup(store.tier.data, table, ids),  # noqa: B023
        }, n_rows, rounds=cfg.rounds, seconds=cfg.seconds)
        res.per_dist[dist] = {"tiergram_rows_per_s": r["tiergram"], "limit_rows_per_s": r["limit"],
                              "numpy_rows_per_s": r["numpy"],
                              "vs_limit": r["tiergram"] / r["limit"], "vs_numpy": r["tiergram"] / r["numpy"]}
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
        lines.append(f"{dist:<9}{d['limit_rows_per_s'] / 1e6:>10.2f} M/s{d['tiergram_rows_per_s'] / 1e6:>8.2f} M/s"
                     f"{d['numpy_rows_per_s'] / 1e6:>8.2f} M/s{d['vs_limit']:>9.0%}{d['vs_numpy']:>9.1f}x")
    targets = res.summary["vs_limit"] >= 0.70, res.summary["vs_numpy"] >= 2.0
    lines.append(f"memcpy limit: a native gather copying the same encoded rows ({res.row_bytes} B/row; tiergram writes "
                 f"{c.dim * (4 if c.dtype == 'float32' else 2)} B/row of output)")
    lines.append(f"targets (worst distribution): >= 70% of limit: {'met' if targets[0] else 'NOT MET'}; "
                 f">= 2x numpy: {'met' if targets[1] else 'NOT MET'}")
    return "\n".join(lines)
