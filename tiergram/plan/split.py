"""One host memory split between the host K/V tier and the Engram tables, as the planner predicts it: the reuse
(plan.prefix) iterated with the step model (plan.model); docs/planner.md, "One host budget"."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tiergram.plan.model import HardwareSpec, ModelSpec, Placement, Point, Workload, kv_room, predict_point
from tiergram.plan.prefix import Conversations, Reuse, reuse


@dataclass(frozen=True)
class Split:
    """One server's host budget and where it goes."""

    host_memory_bytes: float
    kv_host_fraction: float
    kind: str  # the Engram tables' tier: "host" or "file"
    hot_rows: bool = False  # file: the cache starts with the most read rows

    @property
    def kv_host_bytes(self) -> float:
        return self.host_memory_bytes * self.kv_host_fraction

    @property
    def engram_bytes(self) -> float:
        return self.host_memory_bytes - self.kv_host_bytes

    @property
    def label(self) -> str:
        return f"{self.kind} + {self.kv_host_fraction:.0%} K/V"


def conversations_workload(conv: Conversations, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                           block_size: int = 16) -> Workload:
    """The step model's workload for conversations (prompt lengths their mean, the last turn's for the K/V)."""
    mean_prompt = sum(conv.prompt_len(k) for k in range(1, conv.turns + 1)) / conv.turns
    return Workload(input_len=mean_prompt, output_len=conv.answer_len, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, block_size=block_size,
                    max_input_len=conv.prompt_len(conv.turns), max_output_len=conv.answer_len, think_s=conv.think_s)


def file_cache_fraction(model: ModelSpec, engram_bytes: float) -> float:
    """The file tier's row cache as a fraction of the tables, as the engine sizes it from the Engram share."""
    from tiergram.store.table import budget_cache_bytes

    g = model.engram
    per_layer = int(engram_bytes // len(g.layers))
    try:
        cache = budget_cache_bytes(per_layer, g.row_bytes, "native") * len(g.layers)
    except ValueError:
        return 0.0
    return min(1.0, cache / g.table_bytes)


def split_placement(model: ModelSpec, split: Split) -> Placement:
    """The step model's placement of a split; ValueError where the host placement's tables do not fit its share."""
    if split.kind == "host":
        if model.engram.table_bytes > split.engram_bytes:
            raise ValueError(f"{split.label}: the host placement needs {model.engram.table_bytes:,.0f} bytes of "
                             f"tables, more than the {split.engram_bytes:,.0f} its share of the budget leaves")
        return Placement("host")
    if split.kind != "file":
        raise ValueError(f"a split places the tables on host or file, not {split.kind!r}")
    return Placement("file", cache_fraction=file_cache_fraction(model, split.engram_bytes), hot_rows=split.hot_rows)


def kv_blocks(model: ModelSpec, hw: HardwareSpec, wl: Workload, split: Split) -> tuple[int, int]:
    """(device pool blocks, host tier slots) of a split: the device room the weights leave, and the K/V share."""
    block_bytes = wl.block_size * model.kv_bytes_per_token
    device = kv_room(model, hw, split_placement(model, split))[0]
    return int(device // block_bytes), int(split.kv_host_bytes // block_bytes)


def predict_conversations(model: ModelSpec, hw: HardwareSpec, conv: Conversations, split: Split, c: int,
                          wl: Workload | None = None, sessions_before: float = math.inf,
                          hit_rate: float | None = None) -> tuple[Point, Reuse]:
    """A closed loop of c users holding conversations against one split: the point and its prefix reuse."""
    wl = wl or conversations_workload(conv)
    placement = split_placement(model, split)
    if hit_rate is not None and placement.kind == "file":
        placement = replace(placement, hit_rate=hit_rate)
    device, host = kv_blocks(model, hw, wl, split)
    point = predict_point(model, hw, wl, placement, c)
    for _ in range(10):  # reuse <-> step time: a few rounds settle it
        got = reuse(conv, wl.block_size, device, host, c, point.running, point.cycle_s, sessions_before)
        point = predict_point(model, hw, replace(wl, cached_len=got.cached_len, kv_host_len=got.host_len), placement,
                              c)
    point.placement = split.label
    return point, got


def best_splits(points: dict[str, list[Point]]) -> dict[int, tuple[str, float]]:
    """{concurrency: (the split with the most throughput, its margin over the next best as a ratio)}."""
    out = {}
    for c in sorted({p.concurrency for pts in points.values() for p in pts}):
        ranked = sorted(((p.throughput_tok_s, name) for name, pts in points.items() for p in pts
                         if p.concurrency == c), reverse=True)
        margin = ranked[0][0] / ranked[1][0] if len(ranked) > 1 and ranked[1][0] > 0 else math.inf
        out[c] = (ranked[0][1], margin)
    return out
