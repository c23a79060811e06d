"""`tiergram bench lookup`: gather + dequant rate against a limit that moves the same bytes, and a numpy baseline.

The limit (`_native.gather_limit`: the same ids, table mapping and threads, every row byte read and the output bytes
written, no decode) is the best over prefetch distances and store kinds, so no such choice of tiergram's own gather
flatters the ratio (docs/benchmarks.md, "Host-tier lookup").
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from tiergram import _native
from tiergram.bench.common import cached_table, draw_ids, rates_interleaved
from tiergram.codecs import FP8_E4M3FN_VALUES, get_codec
from tiergram.format import TableFile, TableManifest, create_random_table
from tiergram.paths import cache_dir
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
    table_gib: float | None = None  # a table of this size (rows per head to fit); None: rows_per_head
    keep_table: bool = False  # keep a --table-gib table in the bench cache (default: removed afterwards)

    def __post_init__(self) -> None:
        if self.table_gib is not None:
            if not self.table_gib > 0:
                raise ValueError(f"--table-gib must be > 0, got {self.table_gib}")
            probe = TableManifest(codec=self.codec, dim=self.dim, head_rows=(1,))
            pages = int(self.table_gib * 2**30) // probe.page_size
            self.rows_per_head = max(1, pages * probe.rows_per_page // self.heads)


@dataclass
class LookupBenchResult:
    config: LookupBenchConfig
    row_bytes: int
    table_bytes: int
    threads: int
    per_dist: dict[str, dict[str, float | str]] = field(default_factory=dict)
    memory: dict = field(default_factory=dict)  # HostTier.stats(): bytes, shared, huge pages

    @property
    def summary(self) -> dict[str, float]:
        """Headline figures: the worst distribution's rates (a conservative reading)."""
        worst = min(self.per_dist.values(), key=lambda d: d["tiergram_rows_per_s"] / d["limit_rows_per_s"])
        return {k: worst[k] for k in ("tiergram_rows_per_s", "limit_rows_per_s", "numpy_rows_per_s", "vs_limit",
                                      "vs_numpy")}


def numpy_lookup(data: np.ndarray, table: TableFile, ids: np.ndarray) -> np.ndarray:
    """The baseline others use: numpy fancy-index gather, then a vectorised dequant -> float32 [N, H, D]."""
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


LIMIT_AHEAD = (8, 16, 32)  # prefetch distances (rows per thread) the same-bytes limit is measured with


def run(cfg: LookupBenchConfig, progress: bool = True) -> LookupBenchResult:
    """Measure limit, tiergram and numpy rates for each id distribution."""
    if cfg.threads:
        _native.set_num_threads(cfg.threads)
    m = TableManifest(codec=cfg.codec, dim=cfg.dim, head_rows=(cfg.rows_per_head,) * cfg.heads,
                      provenance={"tool": "tiergram bench lookup", "init": "normal(0, 1), seed 0"})
    path = cache_dir("bench") / f"bench-{cfg.codec}-{cfg.heads}x{cfg.rows_per_head}x{cfg.dim}.tgram"
    table = cached_table(path, m, lambda p: create_random_table(p, m, seed=0, progress=progress))  # created once
    res = LookupBenchResult(cfg, m.row_bytes, m.data_bytes, _native.num_threads())
    rng = np.random.default_rng(cfg.seed)
    try:
        with TieredTable(table.path, tier="host", dtype=getattr(torch, cfg.dtype), progress=progress) as store:
            tier = store.tier
            res.memory = tier.stats()
            out = torch.empty((cfg.positions, cfg.heads, m.dim), dtype=store.dtype)
            same_bytes = np.empty((cfg.positions, cfg.heads, m.dim * out.element_size()), dtype=np.uint8)
            for dist in cfg.dists:
                ids = draw_ids(dist, (cfg.positions, cfg.heads), table.head_rows, rng)
                args = (tier.data, ids, tier.head_offsets, tier.head_rows, m.page_size, m.rows_per_page, m.codec_id,
                        m.dim)
                fns = {"tiergram": lambda ids=ids: store.lookup(ids, out=out)}
                for ahead in LIMIT_AHEAD:
                    for stream in (False, True):
                        fns[f"limit: prefetch {ahead}, {'non-temporal' if stream else 'normal'} stores"] = (
                            lambda a=ahead, s=stream, args=args: _native.gather_limit(*args, same_bytes, s, a))
                fns["numpy"] = lambda ids=ids: numpy_lookup(tier.data, table, ids)
                r = rates_interleaved(fns, cfg.positions * cfg.heads, rounds=cfg.rounds, seconds=cfg.seconds)
                best = max((k for k in r if k.startswith("limit")), key=r.__getitem__)
                limit = r[best]
                res.per_dist[dist] = {"tiergram_rows_per_s": r["tiergram"], "limit_rows_per_s": limit,
                                      "limit_variant": best.removeprefix("limit: "), "numpy_rows_per_s": r["numpy"],
                                      "vs_limit": r["tiergram"] / limit, "vs_numpy": r["tiergram"] / r["numpy"]}
    finally:
        if cfg.table_gib is not None and not cfg.keep_table:
            table.path.unlink(missing_ok=True)
    return res


def to_json(res: LookupBenchResult) -> str:
    """One JSON object: the headline keys at top level, then per-distribution figures and the config."""
    obj = {**res.summary, "row_bytes": res.row_bytes, "table_bytes": res.table_bytes, "threads": res.threads,
           "memory": res.memory, "per_dist": res.per_dist, "config": asdict(res.config)}
    return json.dumps(obj, indent=2)


def to_text(res: LookupBenchResult) -> str:
    """A table of rows/s and ratios per distribution, with what was measured against."""
    c, mem = res.config, res.memory  # HostTier.stats(): the pages the table got, from /proc/self/smaps
    out_b = c.dim * (4 if c.dtype == "float32" else 2)
    size = f"{res.table_bytes / 2**30:.2f} GiB" if res.table_bytes >= 2**30 else f"{res.table_bytes / 2**20:.0f} MiB"
    lines = [f"host lookup: table {size} ({c.heads} heads x {c.rows_per_head} rows, D={c.dim} {c.codec}, "
             f"{res.row_bytes} B/row), {mem['huge_page_bytes'] / 2**20:.0f} of {mem['bytes'] / 2**20:.0f} MiB on huge "
             f"pages, THP mode {mem['thp']}",
             f"{c.positions} positions x {c.heads} heads per call, out {c.dtype} ({out_b} B/row), "
             f"{res.threads} native threads; best of {c.rounds} interleaved rounds",
             f"same-bytes limit: one native pass per row, same ids, table mapping and threads: {res.row_bytes} B read, "
             f"{out_b} B written (no decode); best of prefetch {'/'.join(map(str, LIMIT_AHEAD))} x normal/"
             "non-temporal stores",
             f"{'ids':<9}{'same-bytes limit':>18}{'tiergram':>12}{'vs limit':>10}{'numpy':>12}{'vs numpy':>10}"
             "  limit's best"]
    for dist, d in res.per_dist.items():
        lines.append(f"{dist:<9}{d['limit_rows_per_s'] / 1e6:>14.2f} M/s{d['tiergram_rows_per_s'] / 1e6:>8.2f} M/s"
                     f"{d['vs_limit']:>9.0%}{d['numpy_rows_per_s'] / 1e6:>8.2f} M/s{d['vs_numpy']:>9.1f}x  "
                     f"{d['limit_variant']}")
    target = 0.80 if res.table_bytes >= 2**30 else 0.70
    targets = res.summary["vs_limit"] >= target, res.summary["vs_numpy"] >= 2.0
    lines.append(f"targets (worst distribution): >= {target:.0%} of the same-bytes limit: "
                 f"{'met' if targets[0] else 'NOT MET'}; >= 2x numpy: {'met' if targets[1] else 'NOT MET'}")
    return "\n".join(lines)
