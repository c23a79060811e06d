"""The planner: the step model on hand-computed cases, spec files parsed and refused with clear errors, the
`tiergram plan` commands end to end (predict, validate, calibrate on a tiny model)."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiergram.cli import main
from tiergram.plan.model import (
    DiskSpec,
    EngramGeometry,
    HardwareSpec,
    ModelSpec,
    MoeGeometry,
    Placement,
    Workload,
    _shared,
    concurrency_limit,
    interpolate,
    predict_front,
    predict_point,
    step_terms,
)
from tiergram.plan.predict import SWEEP_SCHEMA, read_sweep, validate, validate_text
from tiergram.plan.specs import SpecError, load_hardware, load_model, shipped

# A model and a CPU machine small enough to compute by hand.
MODEL = ModelSpec(name="hand", n_layers=4, active_params=1e6, weight_bytes=2e5, active_weight_bytes=2e5,
                  kv_bytes_per_token=100.0, engram=EngramGeometry(layers=(1, 2), heads=4, row_bytes=40,
                                                                  rows_per_layer=1000))
CPU = HardwareSpec(name="hand-cpu", kind="cpu", device_memory_bytes=1e6, device_bw=1e10, compute_flops=2e9,
                   step_overhead_s=2e-3, per_seq_s=1e-4, host_memory_bytes=1e9, host_bw=1e10, gather_rows_s=1e6,
                   link_bw=0.0, disk=DiskSpec(drives=1, iops_curve=((1.0, 1000.0),)), per_token_s=1e-3)
WL = Workload(input_len=10, output_len=5, max_num_seqs=1000)


def test_device_step_and_throughput_by_hand() -> None:
    # c = 2: a request is 5 steps (prefill + 4 decodes); each step computes 2 x (10 + 5 - 1) / 5 = 5.6 tokens
    p = predict_point(MODEL, CPU, WL, Placement("device"), 2)
    assert p.terms["compute"] == pytest.approx(5.6e-3)
    assert p.terms["overhead"] == pytest.approx(2e-3 + 2 * 1e-4)
    assert p.step_s == pytest.approx(7.8e-3)
    assert p.throughput_tok_s == pytest.approx(2 * 15 / (5 * 7.8e-3))  # 2 users x 15 tokens per 5 steps
    assert p.interactivity == pytest.approx(1 / 7.8e-3)
    assert p.binding == "compute"


def test_host_step_adds_the_gather_on_a_cpu() -> None:
    p = predict_point(MODEL, CPU, WL, Placement("host"), 2)
    rows = 5.6 * 8  # tokens x 2 layers x 4 heads
    assert p.terms["engram cpu"] == pytest.approx(rows / 1e6)
    assert p.step_s == pytest.approx(7.8e-3 + rows / 1e6)


def test_file_step_exposes_what_compute_before_the_first_engram_layer_does_not_hide() -> None:
    p = predict_point(MODEL, CPU, WL, Placement("file", cache_fraction=0.1, hit_rate=0.5), 2)
    rows = 5.6 * 8
    io = rows * 0.5 / 1000 + 1 / 1000  # misses at 1000 pages/s, plus the first read's latency (QD1: 1 ms)
    hide = 0.25 * 5.6e-3  # block 1 of 4: a quarter of the compute runs before the first Engram layer
    exposed = io - hide - rows / 1e6
    assert p.terms["engram exposed"] == pytest.approx(exposed)
    assert p.terms["disk busy"] == pytest.approx(rows * 0.5 / 1000)  # below the step: the disk does not bind
    assert p.step_s == pytest.approx(5.6e-3 + rows / 1e6 + exposed + 2.2e-3)
    assert p.binding == "engram (disk)"
    assert p.hit_rate == 0.5


def test_page_read_cpu_spreads_over_the_cores_beside_the_step_unstretched() -> None:
    """The reader threads' CPU for a step's misses runs beside the step's compute: with the spec's core count the
    step takes it over the cores and not stretched by the server's step curve (the gather, on the engine's thread,
    is); a spec without its cores adds it whole and stretched."""
    disk = DiskSpec(drives=1, iops_curve=((1.0, 1e6),), cpu_s_per_page=10e-6)
    curve = ((1.0, 1.5), (16.0, 1.5))
    pl = Placement("file", cache_fraction=0.1, hit_rate=0.5)
    rows = 5.6 * 8
    gather, reads = rows / 1e6, rows * 0.5 * 10e-6
    spread = predict_point(MODEL, replace(CPU, disk=disk, cores=2, server_step_curve=curve), WL, pl, 2)
    whole = predict_point(MODEL, replace(CPU, disk=disk, server_step_curve=curve), WL, pl, 2)
    assert spread.terms["engram cpu"] == pytest.approx(1.5 * gather + reads / 2)
    assert whole.terms["engram cpu"] == pytest.approx(1.5 * (gather + reads))
    assert whole.step_s - spread.step_s == pytest.approx(1.5 * reads - reads / 2)


def test_prompt_rows_first_waits_for_decode_rows_and_the_read_in_progress() -> None:
    fast = replace(CPU, disk=DiskSpec(drives=1, iops_curve=((1.0, 1e4),)))  # 0.1 ms per page, at any depth
    wl = replace(WL, prompt_rows_first=True)
    pl = Placement("file", cache_fraction=0.1, hit_rate=0.5)
    p = predict_point(MODEL, fast, wl, pl, 2)
    rows = 5.6 * 8
    waited = rows * 4 / 14  # decode tokens' share of a request's computed tokens: (5 - 1) / (10 + 5 - 1)
    io = waited * 0.5 / 1e4 + 1e-4
    hide, cpu = 0.25 * 5.6e-3, rows / 1e6
    disk = rows * 0.5 / 1e4  # every miss, the prompt's too, is read
    wait = 10 * 8 * 0.5 / 1e4 + 1e-4  # one prompt's misses, read before it joins: the request waits that long
    step0 = 5.6e-3 + cpu + max(0.0, io - hide - cpu) + 2.2e-3
    # the prompt reads' share of the disk's time x the step's own reads again (the disk interleaves the two)
    queue = (disk * 10 / 14) / step0 * (waited * 0.5 / 1e4)
    assert p.terms["disk busy"] == pytest.approx(disk)
    assert p.terms["read queue"] == pytest.approx(queue)
    assert p.terms["engram exposed"] == pytest.approx(max(0.0, io - hide - cpu) + queue)
    assert p.terms["prompt rows wait"] == pytest.approx(wait)
    assert p.throughput_tok_s == pytest.approx(2 * 15 / (5 * p.step_s + wait))
    # alone, a prompt starts at once: its step waits for every row, as without the setting
    assert predict_point(MODEL, fast, wl, pl, 1).step_s == pytest.approx(predict_point(MODEL, fast, WL, pl, 1).step_s)
    assert predict_point(MODEL, fast, wl, Placement("host"), 2).step_s == pytest.approx(
        predict_point(MODEL, fast, WL, Placement("host"), 2).step_s)


def test_a_cache_preloaded_with_hot_rows_takes_the_hot_curve() -> None:
    curves = replace(MODEL, hit_rate_curve=((0.01, 0.2), (0.1, 0.3)), hot_hit_rate_curve=((0.01, 0.4), (0.1, 0.7)))
    cold = predict_point(curves, CPU, WL, Placement("file", cache_fraction=0.1), 2)
    hot = predict_point(curves, CPU, WL, Placement("file", cache_fraction=0.1, hot_rows=True), 2)
    assert (cold.hit_rate, hot.hit_rate) == (pytest.approx(0.3), pytest.approx(0.7))
    assert hot.step_s < cold.step_s and hot.terms["disk busy"] == pytest.approx(cold.terms["disk busy"] * 0.3 / 0.7)
    assert "hot rows" in Placement("file", cache_fraction=0.1, hot_rows=True).label
    with pytest.raises(ValueError, match="no hot_hit_rate_curve"):
        predict_point(MODEL, CPU, WL, Placement("file", cache_fraction=0.1, hot_rows=True), 2)
    with pytest.raises(ValueError, match="hot_rows applies to the file placement"):
        Placement("host", hot_rows=True)


def test_a_disk_that_cannot_read_every_miss_within_the_step_sets_it() -> None:
    slow = replace(CPU, disk=DiskSpec(drives=1, iops_curve=((1.0, 1e6), (128.0, 100.0))))  # fast QD1, slow at depth
    p = predict_point(MODEL, slow, replace(WL, prompt_rows_first=True), Placement("file", hit_rate=0.0), 2)
    assert p.step_s == pytest.approx(p.terms["disk busy"]) and p.binding == "engram (disk)"


def test_other_host_traffic_steals_copy_time_from_the_cores() -> None:
    hw = replace(CPU, cores=2)
    wl = replace(WL, host_traffic_bps=5e9)  # half of one core's copy rate (host_bw 10 GB/s)
    p = predict_point(MODEL, hw, wl, Placement("device"), 2)
    assert p.step_s == pytest.approx(7.8e-3 * 2 / 1.5)
    assert predict_point(MODEL, CPU, wl, Placement("device"), 2).step_s == pytest.approx(7.8e-3)  # cores unknown


def test_token_budget_stretches_a_request_over_more_steps() -> None:
    wl = replace(WL, max_num_batched_tokens=16)
    p = predict_point(MODEL, CPU, wl, Placement("device"), 8)
    steps = 8 * 14 / 16  # 7 > 5 output tokens: the budget binds
    assert p.step_s == pytest.approx(2e-3 + 8e-4 + 16 * 1e-3)  # every step is full: 16 tokens
    assert p.throughput_tok_s == pytest.approx(8 * 15 / (steps * p.step_s))


def test_memory_limits_by_hand() -> None:
    # one sequence: ceil(15 / 16) = 1 block of 16 tokens x 100 B = 1600 B of K/V
    table = 2 * 1000 * 40
    dev = concurrency_limit(MODEL, CPU, WL, Placement("device"))
    assert (dev.concurrency, dev.binding) == ((10**6 - 2e5 - table) // 1600, "device memory")
    host = concurrency_limit(MODEL, CPU, WL, Placement("host"))
    assert (host.concurrency, host.binding) == ((10**6 - 2e5) // 1600, "device memory")
    capped = concurrency_limit(MODEL, CPU, replace(WL, max_num_seqs=16), Placement("host"))
    assert (capped.concurrency, capped.binding) == (16, "max_num_seqs")
    # K/V offload: what the device cannot hold goes to host DRAM (here 1 MB more of it)
    hw = replace(CPU, host_memory_bytes=table + 1e6)
    off = concurrency_limit(MODEL, hw, replace(WL, max_num_seqs=5000), Placement("host", kv_offload=True))
    assert (off.concurrency, off.binding) == (500 + 625, "host memory")
    assert not predict_front(MODEL, replace(CPU, device_memory_bytes=1e5), WL, Placement("device")).points


GPU = HardwareSpec(name="hand-gpu", kind="gpu", device_memory_bytes=1e9, device_bw=1e12, compute_flops=1e12,
                   step_overhead_s=0.0, per_seq_s=0.0, host_memory_bytes=1e10, host_bw=1e11, gather_rows_s=1e6,
                   link_bw=1e9, disk=DiskSpec(drives=2, iops_curve=((1.0, 1e4), (100.0, 1e6))))


def test_gpu_host_fetch_crosses_the_link_and_hides_behind_the_first_block() -> None:
    hw = replace(GPU, link_bw=1e8)
    p = predict_point(MODEL, hw, WL, Placement("host"), 2)
    tokens = 5.6
    compute = max(tokens * 2e6 / 1e12, min(2e5, tokens * 2e5) / 1e12 + 2 * (10 + 2.5) * 100 / 1e12)
    link = tokens * 8 * 40 / 1e8
    assert p.terms["compute"] == pytest.approx(compute)
    assert p.terms["engram fetch"] == pytest.approx(link)
    assert p.terms["engram exposed"] == pytest.approx(link - 0.25 * compute)
    assert p.step_s == pytest.approx(compute + link - 0.25 * compute)


def test_shared_link_and_curves() -> None:
    assert _shared(1.0, 3.0) == 2.0  # the smaller transfer finishes at twice its own time
    assert _shared(3.0, 1.0) == 4.0
    assert interpolate(((1.0, 10.0), (100.0, 1000.0)), 10.0, log_x=True) == pytest.approx(505.0)
    assert interpolate(((1.0, 10.0), (100.0, 1000.0)), 0.5) == 10.0
    # two drives share the queue depth: each sees 50 of 100 in flight
    assert GPU.disk.pages_per_s(100) == pytest.approx(2 * interpolate(GPU.disk.iops_curve, 50, log_x=True))


@settings(max_examples=40, deadline=None)
@given(c=st.integers(1, 256), hit=st.floats(0.0, 1.0), more=st.floats(0.0, 0.5))
def test_more_hits_never_slow_a_step_and_more_users_never_shorten_it(c: int, hit: float, more: float) -> None:
    for hw in (CPU, GPU):
        lo = step_terms(MODEL, hw, WL, Placement("file", hit_rate=hit), c)[0]
        hi = step_terms(MODEL, hw, WL, Placement("file", hit_rate=min(1.0, hit + more)), c)[0]
        assert hi <= lo + 1e-12
        assert step_terms(MODEL, hw, WL, Placement("host"), c + 1)[0] >= step_terms(
            MODEL, hw, WL, Placement("host"), c)[0] - 1e-12


# ------------------------------------------------------------------------------------------------ specs

def test_shipped_specs_load() -> None:
    names = shipped()
    assert {"h200", "b200", "gb300", "deepseek-v4.1-flash"} <= set(names)
    for name in ("h200", "b200", "gb300"):
        hw = load_hardware(name)
        assert hw.kind == "gpu" and hw.link_bw > 0 and hw.device_memory_bytes > 1e11
    m = load_model("deepseek-v4.1-flash")
    assert m.engram.rows_per_token == 48
    assert m.engram.table_bytes == (384_006_168 + 384_016_682) * 264  # the released tables, 188.83 GiB
    assert m.hide_fraction == pytest.approx(1 / 40)
    # a one-token step reads the spec's active weights; a huge batch every expert, i.e. all the weights
    assert m.step_weight_bytes(1, 1) == pytest.approx(m.active_weight_bytes)
    assert m.step_weight_bytes(1e6, 1e6) == pytest.approx(m.weight_bytes, rel=0.01)
    assert m.prefill_flops_per_token / m.flops_per_token == pytest.approx(7.89 / 16.13)


def test_the_released_engram_rows_are_the_head_primes() -> None:
    from tiergram.hashing import engram_head_table_sizes

    sizes = engram_head_table_sizes([16_000_000] * 3, 4, 8, [1, 14])
    rows = tuple(sum(sum(order) for order in sizes[layer]) for layer in (1, 14))
    assert load_model("deepseek-v4.1-flash").engram.rows_per_layer == rows


def test_a_fixed_kv_state_per_sequence_counts_in_memory_and_in_the_step() -> None:
    # the same 1600 B of K/V per sequence plus 400 B that does not grow with the context (a sliding window)
    m = replace(MODEL, kv_state_bytes_per_seq=400.0)
    table = 2 * 1000 * 40
    dev = concurrency_limit(m, CPU, WL, Placement("device"))
    assert dev.concurrency == (10**6 - 2e5 - table) // 2000 and dev.device_bytes_per_seq == 2000
    hw = replace(GPU, compute_flops=1e18)  # the step reads memory: weights + K/V
    base = predict_point(MODEL, hw, WL, Placement("device"), 2).terms["compute"]
    got = predict_point(m, hw, WL, Placement("device"), 2).terms["compute"]
    assert got == pytest.approx(base + 2 * 400 / 1e12)  # each sequence reads its state once per step


def test_prompt_tokens_cost_the_prefill_flops() -> None:
    # a step of 5.6 tokens, 4/14 of them decode: prompt tokens multiply a quarter of the parameters
    m = replace(MODEL, prefill_active_params=0.25e6)
    p = predict_point(m, CPU, WL, Placement("device"), 2)
    decode = 5.6 * 4 / 14
    assert p.terms["compute"] == pytest.approx((decode * 2e6 + (5.6 - decode) * 0.5e6) / 2e9)
    assert m.step_flops(10, 10) == MODEL.step_flops(10, 10)  # decode tokens as before


def test_a_moe_step_reads_its_distinct_experts() -> None:
    # 4 of 16 experts in 2 blocks of 100 B each: 400 B of non-expert weights + 8 x 100 B a token = 1200 B active
    moe = MoeGeometry(experts=16, experts_per_token=4, layers=2, expert_bytes=100.0, prefill_layers=1)
    m = replace(MODEL, weight_bytes=400 + 16 * 2 * 100, active_weight_bytes=1200.0, moe=moe)
    assert m.step_weight_bytes(1, 1) == pytest.approx(1200)
    two = 16 * (1 - (12 / 16) ** 2)  # distinct experts 2 tokens touch per block: 7
    assert two == pytest.approx(7) and m.step_weight_bytes(2, 2) == pytest.approx(400 + 2 * 7 * 100)
    # prompt tokens touch only the prefill block: 2 prompt tokens and 0 decode read 7 + 0 experts
    assert m.step_weight_bytes(2, 0) == pytest.approx(400 + 7 * 100)
    assert m.step_weight_bytes(1e4, 1e4) == pytest.approx(m.weight_bytes)
    # the dense rule would read min(W, N x W_act) = all 3600 B at 3 tokens; the MoE one much less
    assert m.step_weight_bytes(3, 3) < replace(m, moe=None).step_weight_bytes(3, 3)


GOOD = """
[hardware]
name = "x"
kind = "cpu"
device_memory_gb = 1
device_bw_gbps = 10
compute_tflops = 0.1
step_overhead_us = 1000
per_seq_us = 10
host_memory_gb = 8
host_bw_gbps = 10
gather_mrows_s = 10
link_gbps = 0

[hardware.disk]
drives = 1
cpu_us_per_page = 3
iops_curve = [[1, 10000], [128, 90000]]

[sources]
device_memory_gb = "a"
device_bw_gbps = "a"
compute_tflops = "a"
step_overhead_us = "a"
per_seq_us = "a"
host_memory_gb = "a"
host_bw_gbps = "a"
gather_mrows_s = "a"
link_gbps = "a"
"disk.drives" = "a"
"disk.cpu_us_per_page" = "a"
"disk.iops_curve" = "a"
"""


def test_a_good_hardware_spec_loads(tmp_path: Path) -> None:
    path = tmp_path / "hw.toml"
    path.write_text(GOOD)
    hw = load_hardware(path)
    assert hw.device_memory_bytes == 1e9 and hw.step_overhead_s == pytest.approx(1e-3)
    assert hw.disk.pages_per_s(128) == 90000


@pytest.mark.parametrize("edit, field, problem", [
    (("device_bw_gbps = 10", "device_bw_gbps = \"fast\""), "device_bw_gbps", "expected a number"),
    (("host_memory_gb = 8", "host_memory_gb = -8"), "host_memory_gb", "must be > 0"),
    (("gather_mrows_s = 10\n", ""), "gather_mrows_s", "misses the required field"),
    (("link_gbps = 0\n", "link_gbps = 0\nwarp = 9\n"), "warp", "unknown field"),
    (("kind = \"cpu\"", "kind = \"tpu\""), "kind", "must be 'gpu' or 'cpu'"),
    (("kind = \"cpu\"", "kind = \"gpu\""), "link_gbps", "a gpu needs a host link"),
    (("iops_curve = [[1, 10000], [128, 90000]]", "iops_curve = [[128, 1], [1, 2]]"), "iops_curve",
     "must increase"),
    (("iops_curve = [[1, 10000], [128, 90000]]", "iops_curve = [1, 2]"), "iops_curve", "[x, y] number pairs"),
    (("drives = 1", "drives = 1.5"), "drives", "expected an integer"),
    (('host_bw_gbps = "a"\n', ""), "host_bw_gbps", "[sources] has no entry"),
    (("[hardware.disk]", "[hardware.nodisk]"), "nodisk", "unknown field"),
])
def test_bad_hardware_specs_name_file_field_and_problem(tmp_path: Path, edit: tuple[str, str], field: str,
                                                        problem: str) -> None:
    path = tmp_path / "bad.toml"
    assert edit[0] in GOOD
    path.write_text(GOOD.replace(edit[0], edit[1], 1))
    with pytest.raises(SpecError) as e:
        load_hardware(path)
    msg = str(e.value)
    assert str(path) in msg and field in msg and problem in msg, msg


def test_bad_model_specs_and_names(tmp_path: Path) -> None:
    src = (Path(load_model.__code__.co_filename).parent / "specs" / "deepseek-v4.1-flash.toml").read_text()
    bad = tmp_path / "m.toml"
    bad.write_text(src.replace("layers = [1, 14]", "layers = [1, 44]"))
    with pytest.raises(SpecError, match=r"m\.toml.*`layers`.*must lie in 0\.\.39"):
        load_model(bad)
    bad.write_text(src.replace("rows_per_layer = [384006168, 384016682]", "rows_per_layer = [384006168]"))
    with pytest.raises(SpecError, match="`rows_per_layer`: 1 counts for 2 layers"):
        load_model(bad)
    bad.write_text(src.replace("rows_per_layer = [384006168, 384016682]", "rows_per_layer = 384000000"))
    assert load_model(bad).engram.table_bytes == 2 * 384_000_000 * 264  # one count for every layer
    bad.write_text(src.replace("prefill_layers = 20", "prefill_layers = 41"))
    with pytest.raises(SpecError, match=r"\[model.moe\].*prefill_layers <= layers <= n_layers"):
        load_model(bad)
    bad.write_text(src.replace("expert_mb = 18.80", "expert_mb = 188"))
    with pytest.raises(SpecError, match="`expert_mb`: a token's experts outweigh active_weight_gb"):
        load_model(bad)
    bad.write_text(src.replace('"moe.experts" = ', '"moe.nope" = '))
    with pytest.raises(SpecError, match="no entry for `moe.experts`"):
        load_model(bad)
    bad.write_text(src.replace("[[0.0001, 0.1553]", "[[0.0001, 1.20]"))
    with pytest.raises(SpecError, match="`hit_rate_curve`: hit rate 1.2 .* above 1"):
        load_model(bad)
    bad.write_text(src.replace("[[0.0001, 0.1561]", "[[0.0001, 1.5]"))
    with pytest.raises(SpecError, match="`hot_hit_rate_curve`: hit rate 1.5 .* above 1"):
        load_model(bad)
    bad.write_text("[model\nname=")
    with pytest.raises(SpecError, match="not valid TOML"):
        load_model(bad)
    with pytest.raises(SpecError, match="no \\[model\\] table"):
        load_model("h200")
    with pytest.raises(SpecError, match="no hardware spec named 'h300'.*shipped: .*h200"):
        load_hardware("h300")


# -------------------------------------------------------------------------------------------------- CLI

def test_plan_prints_the_fronts_and_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "front.png"
    assert main(["plan", "deepseek-v4.1-flash", "h200", "--input-len", "131072", "--max-num-seqs", "16384",
                 "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "PREDICTION" in out and "limits" in out and "file 10% cache" in out and "host + KV offload" in out
    assert "device memory" in out  # past 4,096 sequences of 128K tokens the resident tables' HBM binds
    assert png.stat().st_size > 10_000
    assert main(["plan", "deepseek-v4.1-flash", "h200", "--json", "--plot", str(png)]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert {f["placement"] for f in obj["fronts"]} >= {"device", "host", "file 1% cache"}
    assert main(["plan", "deepseek-v4.1-flash", "h200", "--hot-rows", "--json", "--plot", str(png)]) == 0
    fronts = {f["placement"]: f for f in json.loads(capsys.readouterr().out)["fronts"]}
    assert {"file 10% cache", "file 10% cache + hot rows"} <= set(fronts)  # each cache cold and preloaded
    assert main(["plan", "nosuch", "h200"]) == 2
    assert "no model spec named 'nosuch'" in capsys.readouterr().err


def _sweep(model_dir: str, scale: float) -> dict:
    """A sweep JSON in `bench serve`'s format whose throughputs are the prediction x scale (its servers without
    read-ahead: every step waits for all its rows, as the hand-made predictions here assume)."""
    cfg = {"model_dir": model_dir, "placements": ["device", "host", "file"], "input_len": 10, "output_len": 5,
           "max_concurrency": 4, "max_num_seqs": 1000, "max_num_batched_tokens": 512, "block_size": 16,
           "device_memory": None, "cache_fraction": 0.1, "engine": {"read_ahead": False}, "variants": {}}
    wl = Workload(input_len=9, output_len=4.5, max_num_seqs=1000, max_input_len=10, max_output_len=5)
    points = []
    for kind in ("device", "host", "file"):
        for c in (1, 2, 4):
            pl = Placement(kind, cache_fraction=0.1 if kind == "file" else 0.0, hit_rate=0.6 if kind == "file"
                           else None)
            p = predict_point(MODEL, CPU, wl, pl, c)
            measured = scale * p.throughput_tok_s
            points.append({"placement": kind, "concurrency": c, "throughput_tok_s": measured,
                           "interactivity_p50": p.interactivity, "engram_cache_hit_rate": 0.9 if kind == "file"
                           else None,  # read-ahead counts warmed rows as hits: the pages read tell the truth
                           "file_pages_per_s": 0.4 * measured * 8 if kind == "file" else 0.0})
    return {"schema": SWEEP_SCHEMA, "config": cfg, "points": points, "servers": {"device": {"concurrency_limit": 4}}}


def test_validate_compares_point_by_point() -> None:
    res = validate(_sweep("unused", 1.1), MODEL, CPU)
    assert len(res["points"]) == 9
    for r in res["points"]:
        assert set(r) >= {"placement", "concurrency", "predicted_tok_s", "measured_tok_s", "predicted_binding"}
        assert r["ratio"] == pytest.approx(1.1)
        if r["placement"] == "file":
            assert r["hit_rate"] == pytest.approx(0.6) and r["hit_rate_source"] == "sweep (pages read per row)"
    assert res["summary"]["within_15pct"] == 9 and math.isclose(res["summary"]["max_abs_error"], 0.1)
    assert res["limits"]["device"]["measured"] == 4
    assert res["summary"]["steps_compared"] == 0  # the sweep has no server counters: no step compared


def test_validate_sets_the_naive_baseline_beside_the_planner() -> None:
    """--naive: every point also predicted by calibration's own throughput at its concurrency, errors side by side."""
    from dataclasses import replace

    sweep = _sweep("unused", 1.0)
    with pytest.raises(ValueError, match="no serve_tok_s_curve"):
        validate(sweep, MODEL, CPU, naive=True)
    hw = replace(CPU, serve_tok_s_curve=((1, 100.0), (4, 400.0)))
    res = validate(sweep, MODEL, hw, naive=True)
    by_c = {r["concurrency"]: r["naive_tok_s"] for r in res["points"]}
    assert by_c == {1: 100.0, 2: pytest.approx(250.0, abs=0.1), 4: 400.0}  # interpolated in log c
    errs = [abs(r["measured_tok_s"] / r["naive_tok_s"] - 1) for r in res["points"]]
    s = res["summary"]
    assert s["naive_mean_abs_error"] == pytest.approx(sum(errs) / len(errs))
    assert s["naive_within_15pct"] == sum(e <= 0.15 for e in errs) and s["mean_abs_error"] == pytest.approx(0.0)
    assert "naive baseline" in validate_text(res)
    plain = validate(sweep, MODEL, hw)  # without --naive: no baseline
    assert "naive_mean_abs_error" not in plain["summary"] and plain["points"][0]["naive_tok_s"] is None


def test_validate_sets_the_servers_step_beside_the_predicted() -> None:
    sweep = _sweep("unused", 1.0)
    wl = Workload(input_len=9, output_len=4.5, max_num_seqs=1000, max_input_len=10, max_output_len=5)
    for pt in sweep["points"]:  # the server stepped 1.5x the predicted step at c = 4, as predicted elsewhere
        pl = Placement(pt["placement"], cache_fraction=0.1 if pt["placement"] == "file" else 0.0,
                       hit_rate=0.6 if pt["placement"] == "file" else None)
        p = predict_point(MODEL, CPU, wl, pl, pt["concurrency"])
        pt["server_step_ms"] = p.step_s * 1e3 * (1.5 if pt["concurrency"] == 4 else 1.0)
        pt["steps_per_request"] = 5.0
    res = validate(sweep, MODEL, CPU)
    for r in res["points"]:
        assert r["measured_step_ms"] / r["predicted_step_ms"] == pytest.approx(1.5 if r["concurrency"] == 4 else 1.0,
                                                                              rel=1e-3)  # ms to 3 decimals
        assert r["predicted_steps_per_request"] == pytest.approx(4.5) and r["measured_steps_per_request"] == 5.0
    s = res["summary"]
    assert (s["steps_compared"], s["step_within_15pct"]) == (9, 6)
    assert s["step_mean_abs_error"] == pytest.approx(3 * 0.5 / 9, rel=1e-3)
    assert "step within 15% of the predicted step at 6/9 points" in validate_text(res)


def test_validate_marks_the_points_the_sweep_saw_read_past_the_disks_limit() -> None:
    """bench serve flags a file server's points read past the disk's new-page limit (a cache under the disk served
    them); validate marks them and gives the count within 15% without them."""
    sweep = _sweep("unused", 1.0)
    for pt in sweep["points"]:
        if pt["placement"] == "file" and pt["concurrency"] == 4:
            pt["throughput_tok_s"] *= 2.0  # the volume's cache: twice the prediction
    sweep["checks"] = {"file_vs_host": {"above_disk_limit": [4]}}
    res = validate(sweep, MODEL, CPU)
    flagged = [(r["placement"], r["concurrency"]) for r in res["points"] if r["past_disk_limit"]]
    assert flagged == [("file", 4)]
    s = res["summary"]
    assert (s["within_15pct"], s["past_disk_limit"], s["within_15pct_on_disk"]) == (8, 1, 8)
    text = validate_text(res)
    assert "[read past the disk's new-page limit: a cache under the disk]" in text
    assert "1 points read past the disk's new-page limit" in text and "without them 8/8 within 15%" in text
    assert validate(_sweep("unused", 1.0), MODEL, CPU)["summary"]["past_disk_limit"] == 0  # no flag, none marked


def test_validate_cli_on_a_spec_calibrated_on_a_tiny_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    from test_server import make_tiny_model

    from tiergram.bench.calibrate import measure
    from tiergram.plan.calibrate import fit, to_toml

    model_dir = make_tiny_model(tmp_path / "m")
    raw = measure(str(model_dir), progress=False, disk_seconds=0.05, gather_seconds=0.05, batches=(1, 2), serve=False)
    spec = tmp_path / "this.toml"
    spec.write_text(to_toml(fit(raw)))
    hw = load_hardware(spec)
    assert hw.kind == "cpu" and hw.per_token_s > 0 and hw.disk.pages_per_s(128) > 0
    # the volume's cache under the disk, measured beside the curve: new pages, then the same pages again
    assert raw["disk"]["new_pages_per_s"] > 0 and raw["disk"]["reread_pages_per_s"] > 0
    assert hw.disk.cache_pages_per_s == raw["disk"]["reread_pages_per_s"]  # into the spec, with its source
    # the measurements kept as JSON fit the same spec through the command line
    (tmp_path / "raw.json").write_text(json.dumps(raw))
    assert main(["plan", "calibrate", "--measured", str(tmp_path / "raw.json"), "--out", str(tmp_path / "b.toml")]) == 0
    assert (tmp_path / "b.toml").read_text() == spec.read_text() and "wrote" in capsys.readouterr().out
    sweep = tmp_path / "sweep.json"
    sweep.write_text(json.dumps(_sweep(str(model_dir), 1.0)))
    assert main(["plan", "validate", str(sweep), "--hardware", str(spec), "--json",
                 "--plot", str(tmp_path / "v.png")]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert len(obj["points"]) == 9 and (tmp_path / "v.png").is_file()
    # a sweep with servers the planner does not model (mooncake) and two servers of one placement (file and its
    # variant file-cold): the plot names each server and skips what is not modelled
    both = _sweep(str(model_dir), 1.0)
    extra = [dict(p, placement=name) for p in both["points"] if p["placement"] == "file"
             for name in ("file-cold", "mooncake")]
    both["points"] += extra
    both["config"]["variants"] = {"file-cold": {"base": "file", "engine": {"hot_rows": False}, "reference": None}}
    sweep.write_text(json.dumps(both))
    assert main(["plan", "validate", str(sweep), "--hardware", str(spec), "--json",
                 "--plot", str(tmp_path / "v2.png")]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert {p["placement"] for p in obj["points"]} == {"device", "host", "file", "file-cold"}
    assert obj["skipped_placements"] == ["mooncake"] and (tmp_path / "v2.png").is_file()
    # the file servers predicted (and plotted) on the limit the sweep measured, here half the spec's (the default)
    both["disk_pages_per_s"] = {"before": hw.disk.pages_per_s(128) / 2}
    sweep.write_text(json.dumps(both))
    assert main(["plan", "validate", str(sweep), "--hardware", str(spec), "--json",
                 "--plot", str(tmp_path / "v3.png")]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["disk"] == {"from": {"file": "sweep", "file-cold": "sweep"},
                           "pages_per_s": {"file": pytest.approx(hw.disk.pages_per_s(128) / 2),
                                           "file-cold": pytest.approx(hw.disk.pages_per_s(128) / 2)}}
    assert (tmp_path / "v3.png").is_file()
    # --disk spec: the spec's disk, whatever the sweep measured
    assert main(["plan", "validate", str(sweep), "--hardware", str(spec), "--json", "--disk", "spec"]) == 0
    obj = json.loads(capsys.readouterr().out)
    assert obj["disk"]["from"] == {"file": "spec", "file-cold": "spec"}
    assert obj["disk"]["pages_per_s"]["file"] == pytest.approx(hw.disk.pages_per_s(128))
    assert main(["plan", "validate", str(tmp_path / "none.json"), "--hardware", str(spec)]) == 2
    assert "cannot read the sweep JSON" in capsys.readouterr().err


def test_the_kv_swap_streamer_moves_blocks_and_refuses_bad_sizes() -> None:
    from tiergram.bench.stream import stream

    assert stream(1e9, 1 << 16, 1 << 20, seconds=0.05, report=False) > 0
    with pytest.raises(ValueError, match="pool"):
        stream(1e9, 1 << 20, 1 << 16, seconds=0.05, report=False)


def test_studies_write_their_plots_and_label_every_figure_a_prediction(tmp_path: Path) -> None:
    from tiergram.plan.studies import run

    md = run(tmp_path, None, progress=False)
    assert md.startswith("All figures below are PREDICTIONS")
    for name in ("offload-vs-resident", "ssd-vs-dram", "kv-engram-contention", "decode-stall-h200", "kv-engram-split"):
        assert (tmp_path / f"{name}.png").stat().st_size > 10_000
    assert "| H200 | host + KV offload |" in md and "top-16 spec. exposed ms" in md
    assert "| H200 | host + 85% K/V |" in md and "B200 best split: c = 256" in md


def test_sweep_placement_names() -> None:
    from tiergram.plan.predict import sweep_placement

    cfg = {"cache_fraction": 0.1, "cache_fractions": [0.01, 0.1]}
    assert sweep_placement("file-1%", cfg).cache_fraction == pytest.approx(0.01)
    assert sweep_placement("file-big", cfg).cache_fraction == pytest.approx(0.01)
    assert sweep_placement("host", cfg) == Placement("host")
    # a variant runs its base's placement; a label is not parsed for one
    cfg["variants"] = {"cold": {"base": "file-1%", "engine": {"hot_rows": False}},
                       "host-process": {"base": "host", "engine": {"engine_process": True}}}
    assert sweep_placement("cold", cfg) == sweep_placement("file-1%", cfg)
    assert sweep_placement("host-process", cfg) == Placement("host")
    with pytest.raises(ValueError, match="'file-1%-plain'"):
        sweep_placement("file-1%-plain", cfg)
    with pytest.raises(ValueError, match="'mooncake'"):
        sweep_placement("mooncake", cfg)


def test_a_sweep_json_is_read_by_its_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A sweep names its schema version; one without it, or of another, is refused."""
    path, sweep = tmp_path / "sweep.json", _sweep("m", 1.0)
    path.write_text(json.dumps(sweep))
    assert read_sweep(path)["schema"] == SWEEP_SCHEMA
    del sweep["schema"]
    path.write_text(json.dumps(sweep))
    with pytest.raises(ValueError, match=r"sweep\.json: sweep schema None; this tiergram reads schema 1 \(measure"):
        read_sweep(path)
    assert main(["plan", "validate", str(path), "--hardware", "h200"]) == 2
    assert "sweep schema None" in capsys.readouterr().err
    path.write_text(json.dumps(dict(sweep, schema=2)))
    with pytest.raises(ValueError, match="sweep schema 2; this tiergram reads schema 1"):
        read_sweep(path)
    path.write_text(json.dumps({"points": []}))
    with pytest.raises(ValueError, match="not a `bench serve` sweep"):
        read_sweep(path)


def test_validate_reports_the_predicted_stall_share_beside_the_measured() -> None:
    res = validate(_sweep("unused", 1.0), MODEL, CPU)
    for r in res["points"]:
        p = predict_point(MODEL, CPU, Workload(input_len=9, output_len=4.5, max_num_seqs=1000, max_input_len=10,
                                               max_output_len=5),
                          Placement(r["placement"], 0.1 if r["placement"] == "file" else 0.0, hit_rate=r["hit_rate"]),
                          r["concurrency"])
        # the engine's wait for rows (what a server's stall measures), not only the part that lengthens the step
        wait = p.terms.get("engram wait", p.terms.get("engram exposed", 0.0))
        assert r["predicted_stall_share"] == pytest.approx(wait / p.step_s, abs=1e-4)
        assert (r["predicted_stall_share"] > 0) == (r["placement"] == "file")
        # both sides are named by one rule: the disk at its limit, the Engram source past 25% stall
        disk = p.terms.get("disk busy", 0.0) / p.step_s
        want = "engram (disk)" if disk >= 1 - 1e-9 else (("engram (disk)" if r["placement"] == "file" else
                                                    f"engram ({'host DRAM' if r['placement'] == 'host' else 'device'})")
                                                   if wait / p.step_s > 0.25 else "compute")
        assert r["predicted_binding"] == want


def test_validate_can_predict_file_points_on_the_disk_the_sweep_measured_on_their_own_tables() -> None:
    """The cloud volume serves recently read extents faster than cold ones: asked to, validate predicts each file
    server on the limit the sweep measured on its own tables (file-big on the big model's), the spec's curve scaled
    to it; the measured disk share is always taken against the point's own tables' limit."""
    from dataclasses import replace

    slow = CPU.disk.pages_per_s(128) / 8
    disk = CPU.disk.at_limit(slow, 128)
    assert disk.pages_per_s(128) == pytest.approx(slow) and disk.latency_s == pytest.approx(8 * CPU.disk.latency_s)
    assert disk.pages_per_s(8) == pytest.approx(CPU.disk.pages_per_s(8) / 8)  # the curve's shape kept
    sweep = _sweep("unused", 1.0)
    sweep["config"]["big_model_dir"] = "big"
    sweep["points"] += [dict(p, placement="file-big") for p in sweep["points"] if p["placement"] == "file"]
    same = validate(sweep, MODEL, CPU)  # no limit measured: the spec's disk
    assert same["disk"] == {"from": {"file": "spec", "file-big": "spec"},
                            "pages_per_s": {"file": pytest.approx(CPU.disk.pages_per_s(128)),
                                            "file-big": pytest.approx(CPU.disk.pages_per_s(128))}}
    sweep |= {"disk_pages_per_s": {"before": CPU.disk.pages_per_s(128)}, "big_disk_pages_per_s": {"before": slow}}
    res = validate(sweep, MODEL, CPU)
    assert res["disk"] == {"from": {"file": "sweep", "file-big": "sweep"},
                           "pages_per_s": {"file": pytest.approx(CPU.disk.pages_per_s(128)),
                                           "file-big": pytest.approx(slow)}}
    got = {(r["placement"], r["concurrency"]): r for r in res["points"]}
    slow_hw = replace(CPU, disk=disk)
    wl = Workload(input_len=9, output_len=4.5, max_num_seqs=1000, max_input_len=10, max_output_len=5)
    for c in (1, 2, 4):
        assert got["file", c]["predicted_tok_s"] == pytest.approx(got["file", c]["measured_tok_s"])
        want = predict_point(MODEL, slow_hw, wl, Placement("file", 0.1, hit_rate=got["file-big", c]["hit_rate"]), c)
        assert got["file-big", c]["predicted_tok_s"] == pytest.approx(want.throughput_tok_s)
        assert got["file-big", c]["predicted_tok_s"] < got["file", c]["predicted_tok_s"]
        # the measured disk share is taken against the big tables' own limit
        assert got["file-big", c]["disk_share"] == pytest.approx(
            got["file", c]["disk_share"] * CPU.disk.pages_per_s(128) / slow, rel=1e-3)
    spec = validate(sweep, MODEL, CPU, disk_from="spec")  # the spec's disk, whatever the sweep measured
    assert spec["disk"]["from"] == {"file": "spec", "file-big": "spec"} and {
        r["placement"]: r["predicted_tok_s"] for r in spec["points"]
                                               if r["concurrency"] == 4}["file-big"] == pytest.approx(
        got["file", 4]["predicted_tok_s"])


def test_binding_by_evidence() -> None:
    """The disk binds only at its limit; short of it, the engine's wait decides between the source and compute."""
    from tiergram.plan.predict import binds

    assert binds("engram (disk)", 1.0, 0.0) == "engram (disk)"  # reading the whole limit
    assert binds("engram (host DRAM)", 1.3, 0.0) == "engram (disk)"  # over a limit probed low: still the disk
    assert binds("engram (disk)", 0.85, 0.10) == "compute"  # a busy disk that keeps up does not set the step
    assert binds("engram (disk)", 0.85, 0.30) == "engram (disk)"
    assert binds("engram (host DRAM)", 0.0, 0.26) == "engram (host DRAM)"
    assert binds("engram (host DRAM)", 0.0, 0.25) == "compute"


def test_the_engines_wait_covers_the_exposed_fetch_and_is_not_added_to_the_step() -> None:
    """A file step's "engram wait" (reads or their CPU, less the layers in front) is at least its "engram exposed"
    (which also lets the fetch's CPU hide the reads), and the step time does not count it."""
    wl = Workload(input_len=64, output_len=16, max_num_seqs=1000, max_input_len=64, max_output_len=16)
    for c in (1, 4, 16):
        p = predict_point(MODEL, CPU, wl, Placement("file", 0.1, hit_rate=0.3), c)
        wait, exposed = p.terms.get("engram wait", 0.0), p.terms.get("engram exposed", 0.0)
        assert wait >= exposed and wait > 0
        parts = sum(p.terms.get(k, 0.0) for k in ("compute", "engram cpu", "engram exposed", "overhead"))
        assert p.step_s == pytest.approx(max(parts, p.terms.get("disk busy", 0.0)), rel=1e-9)


def test_topk_hit_rate_builds_a_missing_corpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The speculation study's top-k hit rate reads the corpus test split, building the corpus first on a fresh
    machine (it read corpus_dir() and failed when the cache had none); rates are shares that grow with k."""
    from support import fixture_corpus, offline_default_sources, tiny_config_for

    from tiergram.corpus import load_tokenizer
    from tiergram.model import EngramLM
    from tiergram.model.checkpoint import save_pretrained
    from tiergram.plan.studies import topk_hit_rate

    tok_corpus = fixture_corpus(tmp_path / "tokcache")
    tok = load_tokenizer(tok_corpus)
    model_dir = tmp_path / "m"
    save_pretrained(EngramLM(tiny_config_for(tok)), model_dir, tokenizer=tok)
    corpus = offline_default_sources(monkeypatch, tmp_path)
    assert not corpus.exists()
    rates = topk_hit_rate(str(model_dir), ks=(1, 4), max_tokens=400, progress=False)
    assert (corpus / "manifest.json").is_file()
    assert 0.0 <= rates[1] <= rates[4] <= 1.0


def test_the_cpu_speed_probe_times_a_fixed_workload() -> None:
    from tiergram.machine import cpu_speed_ms

    assert 0 < cpu_speed_ms(0.05) < 10_000


def test_a_servers_step_factor_stretches_the_cores_work_not_the_disk() -> None:
    curve = ((1.0, 1.0), (4.0, 2.0))  # alone at c = 1, twice as long from c = 4: 1.5 at c = 2 (log c)
    served = replace(CPU, server_step_curve=curve)
    alone, beside = (predict_point(MODEL, hw, WL, Placement("host"), 2) for hw in (CPU, served))
    assert beside.step_s == pytest.approx(1.5 * alone.step_s)  # compute, overheads and the gather: all the cores'
    assert predict_point(MODEL, served, WL, Placement("host"), 1).step_s == pytest.approx(
        predict_point(MODEL, CPU, WL, Placement("host"), 1).step_s)
    slow = replace(CPU, disk=DiskSpec(drives=1, iops_curve=((1.0, 1e6), (128.0, 100.0))))
    disk_bound = [predict_point(MODEL, replace(slow, server_step_curve=k), replace(WL, prompt_rows_first=True),
                                Placement("file", hit_rate=0.0), 2) for k in ((), curve)]
    assert disk_bound[0].step_s == pytest.approx(disk_bound[1].step_s)  # the disk's own time does not stretch
    assert predict_point(MODEL, replace(GPU, server_step_curve=curve), WL, Placement("host"), 2).step_s == \
        pytest.approx(predict_point(MODEL, GPU, WL, Placement("host"), 2).step_s)


def test_rereads_read_at_the_rate_of_a_cache_under_the_disk() -> None:
    """A disk with a cache under it (this VM's volume): a workload's re-reads at the cache's rate, first reads at the
    drives', time per page mixed — by hand: drives 1,000 pages/s at QD 128, cache 10,000, half re-reads:
    1 / (0.5 / 1,000 + 0.5 / 10,000) = 1,818 pages/s, the curve's shape kept."""
    from dataclasses import replace

    disk = DiskSpec(drives=1, iops_curve=((1, 100.0), (128, 1000.0)), cache_pages_per_s=10000.0)
    mixed = disk.with_rereads(0.5)
    assert mixed.pages_per_s(128) == pytest.approx(1 / (0.5 / 1000 + 0.5 / 10000))
    assert mixed.pages_per_s(1) == pytest.approx(100.0 * mixed.pages_per_s(128) / 1000)
    assert disk.with_rereads(0.0) == disk and disk.with_rereads(1.0).pages_per_s(128) == pytest.approx(10000)
    assert replace(disk, cache_pages_per_s=0.0).with_rereads(0.9).pages_per_s(128) == pytest.approx(1000)
    assert replace(disk, cache_pages_per_s=500.0).with_rereads(0.9).pages_per_s(128) == pytest.approx(1000)
    with pytest.raises(ValueError, match="reread_share"):
        disk.with_rereads(1.5)
    # validate: a file point's measured share of first reads sets its mix; without the count, every read is new
    slow = replace(CPU, disk=replace(CPU.disk, iops_curve=tuple((q, r / 50) for q, r in CPU.disk.iops_curve),
                                     cache_pages_per_s=CPU.disk.pages_per_s(128)))
    sweep = _sweep("unused", 1.0)
    plain = {(r["placement"], r["concurrency"]): r for r in validate(sweep, MODEL, slow)["points"]}
    for p in sweep["points"]:
        if p["placement"] == "file":
            p["file_first_read_share"] = 0.25
    got = {(r["placement"], r["concurrency"]): r for r in validate(sweep, MODEL, slow)["points"]}
    wl = Workload(input_len=9, output_len=4.5, max_num_seqs=1000, max_input_len=10, max_output_len=5)
    for c in (1, 2, 4):
        assert got["file", c]["first_read_share"] == 0.25 and plain["file", c]["first_read_share"] is None
        want = predict_point(MODEL, replace(slow, disk=slow.disk.with_rereads(0.75)), wl,
                             Placement("file", 0.1, hit_rate=got["file", c]["hit_rate"]), c)
        assert got["file", c]["predicted_tok_s"] == pytest.approx(want.throughput_tok_s)
        assert got["file", c]["predicted_tok_s"] >= plain["file", c]["predicted_tok_s"]
        assert got["host", c]["predicted_tok_s"] == plain["host", c]["predicted_tok_s"]


def test_a_point_is_predicted_at_the_cpu_speed_the_sweep_probed_beside_it() -> None:
    """This VM's speed drifts by tens of percent within minutes: a sweep point whose speed probe read 1.25x the
    calibration's is predicted with every CPU cost 1.25x (rates / 1.25), memory and the disk's rates unchanged;
    on a CPU machine whose host point is all CPU work, that is the throughput / 1.25 exactly."""
    from dataclasses import replace

    cpu = replace(CPU, cpu_speed_ms=8.0, gather_call_s=1e-4, request_overhead_s=1e-3,
                  disk=replace(CPU.disk, cpu_s_per_page=4e-6, cache_pages_per_s=5e3))
    slow = cpu.at_speed(10.0)
    assert slow.compute_flops == pytest.approx(2e9 / 1.25) and slow.gather_rows_s == pytest.approx(1e6 / 1.25)
    assert slow.step_overhead_s == pytest.approx(2.5e-3) and slow.per_seq_s == pytest.approx(1.25e-4)
    assert slow.gather_call_s == pytest.approx(1.25e-4) and slow.request_overhead_s == pytest.approx(1.25e-3)
    assert slow.disk.cpu_s_per_page == pytest.approx(5e-6)
    assert (slow.host_bw, slow.disk.iops_curve, slow.disk.cache_pages_per_s) == (cpu.host_bw, cpu.disk.iops_curve,
                                                                                 5e3)
    assert cpu.at_speed(8.0) == cpu and replace(cpu, cpu_speed_ms=0.0).at_speed(10.0).compute_flops == 2e9
    assert GPU.at_speed(10.0) == GPU  # a GPU's backbone is not this CPU's
    with pytest.raises(ValueError, match="speed_ms"):
        cpu.at_speed(0.0)
    wl = Workload(input_len=9, output_len=4.5, max_num_seqs=1000, max_input_len=10, max_output_len=5)
    for c in (1, 4):
        assert predict_point(MODEL, slow, wl, Placement("host"), c).throughput_tok_s == pytest.approx(
            predict_point(MODEL, cpu, wl, Placement("host"), c).throughput_tok_s / 1.25)
    # validate: every point at the median of the sweep's probes, the factor reported; --speed spec (or no probe
    # on either side): the spec's
    sweep = _sweep("unused", 1.0)
    for p, ms in zip(sweep["points"], [10.0, 10.0, 9.0, 12.0, 10.0, 10.0, 10.0, 7.0, 11.0], strict=True):
        p["cpu_speed_ms"] = ms
    res = validate(sweep, MODEL, cpu)
    assert res["speed"] == {"from": "sweep", "spec_probe_ms": 8.0, "sweep_probe_ms": 10.0, "factor": 1.25}
    got = {(r["placement"], r["concurrency"]): r for r in res["points"]}
    spec = validate(sweep, MODEL, cpu, speed_from="spec")
    assert spec["speed"] == {"from": "spec", "spec_probe_ms": 8.0, "factor": 1.0}
    want = {(r["placement"], r["concurrency"]): r for r in validate(sweep, MODEL, slow, speed_from="spec")["points"]}
    for key, r in got.items():
        assert r["predicted_tok_s"] == pytest.approx(want[key]["predicted_tok_s"])
    for c in (1, 2, 4):
        assert got["host", c]["predicted_tok_s"] == pytest.approx(spec["points"][3 + (1, 2, 4).index(c)][
            "predicted_tok_s"] / 1.25)
    assert "1.25x the spec's CPU time" in validate_text(res) and "CPU costs at" not in validate_text(spec)
    assert validate(sweep, MODEL, replace(cpu, cpu_speed_ms=0.0))["speed"]["from"] == "spec"


def test_a_request_lives_through_the_steps_run_while_its_user_is_away() -> None:
    """request_steps_curve: at c = 2 a request lives 1.2 x 5 steps (a seat sits empty a sixth of the time), so each
    step computes 5.6 / 1.2 tokens and the cycle holds 6 steps; the tokens' gaps are still one step each."""
    seated = replace(CPU, request_steps_curve=((1.0, 1.0), (2.0, 1.2)))
    p = predict_point(MODEL, seated, WL, Placement("device"), 2)
    tokens = 5.6 / 1.2
    step = 2e-3 + 2 * 1e-4 + tokens * 1e-3
    assert p.terms["compute"] == pytest.approx(tokens * 1e-3)
    assert p.step_s == pytest.approx(step)
    assert p.throughput_tok_s == pytest.approx(2 * 15 / (6 * step))
    assert p.interactivity == pytest.approx(1 / step)
    assert predict_point(MODEL, seated, WL, Placement("device"), 1) == predict_point(MODEL, CPU, WL,
                                                                                      Placement("device"), 1)
    below = replace(CPU, request_steps_curve=((1.0, 0.9), (2.0, 0.9)))  # fewer steps than needed: noise, not taken
    assert predict_point(MODEL, below, WL, Placement("device"), 2) == predict_point(MODEL, CPU, WL,
                                                                                     Placement("device"), 2)
    gpu = predict_point(MODEL, replace(GPU, request_steps_curve=((1.0, 2.0),)), WL, Placement("device"), 2)
    assert gpu == predict_point(MODEL, GPU, WL, Placement("device"), 2)  # measured on this machine's server only
