"""The planner's prefix reuse and host-budget split: the block arithmetic by hand, the reuse model's bounds and
monotonicity (hypothesis), the think-time closed loop, the split's cache sizing as the engine sizes it, and a
conversations sweep validated point by point with the load generator's own think draws."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.plan.model import DiskSpec, EngramGeometry, HardwareSpec, ModelSpec, Placement, Workload, predict_point
from tiergram.plan.predict import round_thinks, sweep_sessions, validate
from tiergram.plan.prefix import Conversations, reuse
from tiergram.plan.specs import SpecError, with_hit_rates
from tiergram.plan.split import Split, file_cache_fraction, kv_blocks, predict_conversations, split_placement
from tiergram.store.table import STAGING_RESERVE_BYTES

CONV = Conversations(doc_len=96, question_len=12, answer_len=16, turns=4, docs=8, think_s=0.2)
MODEL = ModelSpec(name="hand", n_layers=4, active_params=1e6, weight_bytes=2e5, active_weight_bytes=2e5,
                  kv_bytes_per_token=100.0, engram=EngramGeometry(layers=(1, 2), heads=4, row_bytes=264,
                                                                  rows_per_layer=1_000_000),
                  hit_rate_curve=((0.01, 0.3), (0.5, 0.6)), hot_hit_rate_curve=((0.01, 0.5), (0.5, 0.8)))
CPU = HardwareSpec(name="hand-cpu", kind="cpu", device_memory_bytes=1e6, device_bw=1e10, compute_flops=2e9,
                   step_overhead_s=2e-3, per_seq_s=1e-4, host_memory_bytes=1e9, host_bw=1e10, gather_rows_s=1e6,
                   link_bw=0.0, disk=DiskSpec(drives=1, iops_curve=((1.0, 1000.0), (128.0, 50000.0))),
                   per_token_s=1e-3)


def test_conversation_block_arithmetic_by_hand() -> None:
    # prompts 108, 136, 164, 192; turn k reuses the full blocks turn k-1 computed (its prompt + 15 answer tokens)
    assert [CONV.prompt_len(k) for k in range(1, 5)] == [108, 136, 164, 192]
    assert CONV.doc_hit_tokens(16) == 96
    assert [CONV.history_hit_tokens(k, 16) for k in (2, 3, 4)] == [112, 144, 176]
    assert CONV.queried() == 107 + 135 + 163 + 191
    assert CONV.blocks_held(4, 16) == math.ceil(208 / 16)
    assert sum(CONV.weights) == pytest.approx(1.0)


def test_reuse_with_room_for_everything_is_the_ideal() -> None:
    got = reuse(CONV, 16, device_blocks=10_000, host_blocks=0, concurrency=4, running=2, cycle_s=0.5)
    assert got.doc_hit == pytest.approx(1.0) and got.history_hit == pytest.approx(1.0)
    assert got.hit_rate == pytest.approx((96 + 112 + 144 + 176) / CONV.queried())
    assert got.host_hit_rate == 0.0
    # first opens miss: after one session only the documents it could have opened can be cached
    cold = reuse(CONV, 16, device_blocks=10_000, host_blocks=0, concurrency=4, running=2, cycle_s=0.5,
                 sessions_before=1)
    assert cold.doc_hit == pytest.approx(sum(p * p for p in CONV.weights))


def test_the_host_tier_keeps_what_the_device_pool_cannot() -> None:
    small = reuse(CONV, 16, device_blocks=48, host_blocks=0, concurrency=6, running=4, cycle_s=0.45)
    tier = reuse(CONV, 16, device_blocks=48, host_blocks=2000, concurrency=6, running=4, cycle_s=0.45)
    assert tier.hit_rate > small.hit_rate + 0.2
    assert tier.host_hit_rate == pytest.approx(tier.hit_rate - small.hit_rate)


@settings(max_examples=60, deadline=None)
@given(dev=st.integers(0, 400), host=st.integers(0, 400), extra=st.integers(1, 400), c=st.integers(1, 16),
       run_share=st.floats(0.05, 1.0), cycle=st.floats(0.05, 5.0))
def test_reuse_is_bounded_and_grows_with_room(dev: int, host: int, extra: int, c: int, run_share: float,
                                              cycle: float) -> None:
    ideal = (96 + 112 + 144 + 176) / CONV.queried()
    a = reuse(CONV, 16, dev, host, c, c * run_share, cycle)
    b = reuse(CONV, 16, dev, host + extra, c, c * run_share, cycle)
    for got in (a, b):
        assert 0.0 <= got.host_hit_rate <= got.hit_rate <= ideal + 1e-9
    assert b.hit_rate >= a.hit_rate - 1e-9


def test_reuse_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="block"):
        reuse(CONV, 0, 10, 0, 1, 1, 1.0)
    with pytest.raises(ValueError, match="positive"):
        Conversations(0, 12, 16)


def test_think_time_empties_seats_and_lengthens_the_cycle() -> None:
    wl = Workload(input_len=100, output_len=10, max_num_seqs=64)
    busy = predict_point(MODEL, CPU, wl, Placement("host"), 8)
    thinking = predict_point(MODEL, CPU, Workload(input_len=100, output_len=10, max_num_seqs=64, think_s=0.5),
                             Placement("host"), 8)
    assert busy.running == 8
    assert 1 <= thinking.running < 8
    request = thinking.cycle_s - 0.5
    assert thinking.running == pytest.approx(8 * request / thinking.cycle_s, rel=0.02)  # the fixed point holds
    assert thinking.throughput_tok_s == pytest.approx(8 * 110 / thinking.cycle_s)
    assert thinking.step_s < busy.step_s  # fewer sequences per step


def test_cached_prompt_tokens_are_not_computed() -> None:
    cold = predict_point(MODEL, CPU, Workload(input_len=400, output_len=8), Placement("host"), 4)
    warm = predict_point(MODEL, CPU, Workload(input_len=400, output_len=8, cached_len=300), Placement("host"), 4)
    assert warm.throughput_tok_s > cold.throughput_tok_s
    assert warm.terms["compute"] < cold.terms["compute"]


def test_split_sizes_the_file_cache_as_the_engine_does() -> None:
    per_layer = 256 << 20
    frac = file_cache_fraction(MODEL, 2 * per_layer)
    rows = (per_layer - STAGING_RESERVE_BYTES) // (264 + 96)  # the native index's 96 bytes a row
    assert frac == pytest.approx(2 * rows * 264 / MODEL.engram.table_bytes)
    assert file_cache_fraction(MODEL, 2 * STAGING_RESERVE_BYTES) == 0.0  # staging leaves nothing
    pl = split_placement(MODEL, Split(2 * per_layer, 0.5, "file", hot_rows=True))
    assert pl.hot_rows and pl.cache_fraction == pytest.approx(file_cache_fraction(MODEL, per_layer))
    with pytest.raises(ValueError, match="host placement needs"):
        split_placement(MODEL, Split(1e6, 0.0, "host"))


def test_split_blocks_and_a_prediction() -> None:
    split = Split(800e6, 0.25, "host")
    wl = Workload(input_len=150, output_len=16)
    device, host = kv_blocks(MODEL, CPU, wl, split)
    assert host == int(200e6 // (16 * 100))
    assert device == int((1e6 - 2e5) // (16 * 100))
    point, got = predict_conversations(MODEL, CPU, CONV, split, 4)
    assert point.placement == "host + 25% K/V"
    assert 0 < got.hit_rate <= 1 and point.throughput_tok_s > 0


def test_think_draws_are_the_load_generators() -> None:
    cfg = {"seed": 3, "rounds": 2, "requests_per_user": 4, "warmup_per_user": 1}
    thinks = round_thinks(cfg, CONV, 2)
    draws = np.random.default_rng(4).exponential(0.2, 2 * 3)  # round 1: seed + 1, 2 sessions x 3 thinks
    assert thinks[1] == pytest.approx([draws[0::2].sum(), draws[1::2].sum()])
    # levels 1 then 2: one warm-up and two rounds of one session at c = 1 before c = 2's warm-up and half its rounds
    assert sweep_sessions({**cfg, "_levels": [{"concurrency": 1}, {"concurrency": 2}]}, CONV, 2) == (2, 3 + 1 + 2)


def test_hit_rates_come_from_a_cache_bench_run(tmp_path: Path) -> None:
    good = tmp_path / "hit.json"
    good.write_text(json.dumps({"hit_rate": {"lru": {"0.01": 0.2, "0.1": 0.4}, "lru-hot": {"0.01": 0.5}},
                                "config": {"capacity_of": "table"}}))
    m = with_hit_rates(MODEL, good)
    assert m.hit_rate_curve == ((0.01, 0.2), (0.1, 0.4)) and m.hot_hit_rate_curve == ((0.01, 0.5),)
    touched = tmp_path / "touched.json"
    touched.write_text(json.dumps({"hit_rate": {"lru": {}}, "config": {"capacity_of": "touched"}}))
    with pytest.raises(SpecError, match="capacity-of table"):
        with_hit_rates(MODEL, touched)
    with pytest.raises(SpecError, match="not a `tiergram bench cache"):
        with_hit_rates(MODEL, tmp_path / "missing.json")


def _conversation_sweep() -> dict:
    """A two-server conversations sweep (host with and without a host K/V tier) at c = 1 and 2."""
    cfg = {"model_dir": "hand", "input_len": 96, "output_len": 16, "workload": "conversations", "turns": 4,
           "docs": 8, "think_time_s": 0.2, "rounds": 3, "requests_per_user": 4, "warmup_per_user": 1, "seed": 0,
           "max_num_seqs": 64, "max_num_batched_tokens": 512, "block_size": 16, "variants": {
               "host-kv50": {"base": "host", "engine": {"kv_host_fraction": 0.5}}}}
    servers = {name: {"settings": {"engine": {"placement": "host", "host_memory": 2e9, "kv_host_fraction": f}}}
               for name, f in (("host", 0.0), ("host-kv50", 0.5))}
    points = [{"placement": name, "concurrency": c, "throughput_tok_s": 500.0 * c, "duration_s": 5.0,
               "exposed_stall_s": 0.0, "prefix_hit_rate": 0.8} for name in servers for c in (1, 2)]
    return {"schema": 1, "config": cfg, "servers": servers, "points": points}


def test_validate_predicts_a_conversations_sweep_per_split() -> None:
    res = validate(_conversation_sweep(), MODEL, CPU, speed_from="spec")
    assert {(p["placement"], p["concurrency"]) for p in res["points"]} == {
        (n, c) for n in ("host", "host-kv50") for c in (1, 2)}
    for p in res["points"]:
        assert 0 < p["predicted_prefix_hit"] <= 1 and p["measured_prefix_hit"] == 0.8
    assert set(res["best_split"]) == {1, 2}
    assert res["summary"]["prefix_mean_abs_points"] is not None
    sweep = _conversation_sweep()
    del sweep["servers"]["host"]["settings"]["engine"]["host_memory"]
    with pytest.raises(ValueError, match="without host_memory"):
        validate(sweep, MODEL, CPU, speed_from="spec")


def test_validate_markdown_lists_every_point_with_both_errors() -> None:
    from dataclasses import replace

    from tiergram.plan.predict import validate_markdown

    hw = replace(CPU, serve_tok_s_curve=((1.0, 400.0), (4.0, 1200.0)))
    md = validate_markdown(validate(_conversation_sweep(), MODEL, hw, speed_from="spec", naive=True))
    rows = [line for line in md.splitlines() if line.startswith("| host")]
    assert len(rows) == 4 and all(line.count("|") == 10 for line in rows)
    assert "| host-kv50 | 2 |" in md and "naive:" in md and "best split at c = 2" in md
