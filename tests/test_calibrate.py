"""`tiergram plan calibrate`: the fits on hand-made measurements (plan.calibrate), and the measurements themselves
on a tiny model and a real server (bench.calibrate)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_server import make_tiny_model

from tiergram.cli import main
from tiergram.plan.calibrate import (
    MEASUREMENT_SCHEMA,
    fit,
    fit_file,
    fit_lookups,
    fit_serve,
    fit_steps,
    read_measurements,
    summary,
    to_toml,
)
from tiergram.plan.model import Workload, steps_per_request
from tiergram.plan.specs import load_hardware

OVERHEAD, PER_TOKEN, PER_SEQ = 2e-3, 50e-6, 100e-6  # the engine's step the hand-made samples follow
GATHER = {"per_call_s": 20e-6, "rows_per_s": 4e6}  # the host tier's lookups


def step_s(tokens: float, seqs: float) -> float:
    return OVERHEAD + PER_TOKEN * tokens + PER_SEQ * seqs


def raw_measurements(serve: bool = True) -> dict:
    """A measurement dict in the layout `bench.calibrate.measure` writes, its figures made by hand."""
    samples = [[t, s, step_s(t, s)] for t, s in ((1, 1), (2, 2), (130, 2), (4, 4), (8, 8), (260, 4))]
    runs = []
    wl = Workload(input_len=(102 + 128) / 2, output_len=(25 + 32) / 2)
    for k in range(3):
        for c in (1, 2, 4):
            steps = 100.0
            busy = steps * step_s(c, c) * (1.0 + 0.1 * k)  # the server's steps: 1.0x, 1.1x, 1.2x the engine's
            requests = round(steps * c / steps_per_request(wl, c))
            idle = (5e-3 + steps_per_request(wl, c) * c * 30e-6) * requests / c  # t_req 5 ms, t_http 30 us
            runs.append({"pass": k, "c": c, "wall_s": busy + idle, "requests": requests, "busy_s": busy,
                         "steps": steps, "tokens": steps * c})
    return {"schema": MEASUREMENT_SCHEMA, "when": "2026-12-03 10:00 UTC", "model_dir": "/models/tiny", "cpus": 2,
            "model": {"engram_layers": 2, "heads": 4, "rows_per_token": 8, "flops_per_token": 2e6},
            "cpu_speed_ms": [3.0, 3.2, 3.1, 3.0], "lookups": [[r, GATHER["per_call_s"] + r / GATHER["rows_per_s"]]
                                                             for r in (32, 128, 512, 2048)],
            "steps": {"placement": "device", "torch_threads": 1, "samples": samples},
            "file": {"cache_fraction": 0.1, "hits": [[32, 10e-6 + 32e-7], [512, 10e-6 + 512e-7]],
                     "misses": {"calls": 100, "rows_per_call": 256, "pages": 20000,
                                "cpu_s": 100 * (10e-6 + 256e-7) + 20000 * 5e-6}},
            "disk": {"seconds": 1.0, "iops_curve": [[1, 5000], [8, 30000], [32, 80000], [128, 100000]],
                     "cpu_us_per_page": 4.0, "new_pages_per_s": 100000, "reread_pages_per_s": 400000},
            "host_bandwidth_bytes_s": 10e9, "host_memory_bytes": 24 * 2**30,
            "serve": {"input_len": 128, "output_len": 32, "concurrencies": [1, 2, 4], "passes": 3, "runs": runs}
            if serve else None}


def test_the_fits_recover_the_figures_the_measurements_were_made_from() -> None:
    raw = raw_measurements()
    st = fit_steps(raw["steps"], GATHER, 8, 2)
    assert (st["step_overhead_s"], st["per_token_s"], st["per_seq_s"]) == pytest.approx((OVERHEAD, PER_TOKEN, PER_SEQ))
    assert st["r2"] == pytest.approx(1.0) and st["steps"] == 6
    # timed with host tables, each step's gather (per call x layers + rows / rate) comes off before the fit
    host = {"placement": "host", "samples": [[t, s, d + 2 * GATHER["per_call_s"] + t * 8 / GATHER["rows_per_s"]]
                                             for t, s, d in raw["steps"]["samples"]]}
    assert fit_steps(host, GATHER, 8, 2)["per_token_s"] == pytest.approx(PER_TOKEN)
    assert fit_lookups(raw["lookups"]) == pytest.approx(GATHER)
    fc = fit_file(raw["file"])
    assert (fc["hit_rows_per_s"], fc["per_call_s"], fc["cpu_s_per_page"]) == pytest.approx((1e7, 10e-6, 5e-6))
    srv = fit_serve(raw["serve"], step_s)
    assert (srv["request_overhead_s"], srv["per_seq_http_s"]) == pytest.approx((5e-3, 30e-6), rel=0.02)
    assert srv["server_step_curve"] == [[1, 1.0], [2, 1.0], [4, 1.0]]  # each level's fastest pass
    assert srv["server_step_passes"][2] == [1.0, 1.1, 1.2]
    assert [c for c, _ in srv["request_steps_curve"]] == [1, 2, 4]
    assert all(f >= 1.0 for _, f in srv["request_steps_curve"])  # a request needs its steps
    assert fit_serve(raw["serve"])["server_step_curve"] == []  # no engine step: no curve


def test_a_spec_fitted_from_measurements_loads_with_its_sources(tmp_path: Path) -> None:
    cal = fit(raw_measurements())
    spec = tmp_path / "this.toml"
    spec.write_text(to_toml(cal))
    hw = load_hardware(spec)
    assert hw.per_token_s == pytest.approx(PER_TOKEN) and hw.request_overhead_s == pytest.approx(5e-3, rel=0.02)
    assert hw.disk.cache_pages_per_s == 400000 and hw.cpu_speed_ms == pytest.approx(3.05)
    assert hw.server_step_curve == ((1, 1.0), (2, 1.0), (4, 1.0))
    assert "2026-12-03 10:00 UTC" in cal.sources["per_token_us"] and "c = 1, 2, 4" in cal.sources["per_seq_us"]
    assert "QD128 100,000 pages/s" in summary(cal) and "HTTP path" in summary(cal)
    quiet = fit(raw_measurements(serve=False))
    assert quiet.values["request_overhead_ms"] == 0.0 and "server_step_curve" not in quiet.values
    assert quiet.sources["request_overhead_ms"] == "not measured (calibrate --no-serve)"
    assert "HTTP path" not in summary(quiet)


def test_measurements_of_another_schema_are_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    path.write_text(json.dumps(raw_measurements()))
    assert read_measurements(path)["cpus"] == 2
    path.write_text(json.dumps(dict(raw_measurements(), schema=MEASUREMENT_SCHEMA + 1)))
    with pytest.raises(ValueError, match=rf"m\.json: calibration measurements of schema {MEASUREMENT_SCHEMA + 1}; "
                                         rf"this tiergram reads schema {MEASUREMENT_SCHEMA}"):
        read_measurements(path)
    with pytest.raises(ValueError, match="cannot read the calibration measurements"):
        read_measurements(tmp_path / "none.json")


def test_calibrate_refuses_a_model_beside_measurements_and_a_missing_model(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from tiergram.bench.calibrate import RESIDENT_STEP_TABLE_BYTES, step_placement

    assert step_placement(33 << 20) == "device"  # the demo's tables: timed resident
    assert step_placement(RESIDENT_STEP_TABLE_BYTES + 1) == "host"  # an init-model V4.1 table: as a sweep serves it
    assert main(["plan", "calibrate", "--model", str(tmp_path / "a"), "--measured", str(tmp_path / "m.json")]) == 2
    assert "give no --model" in capsys.readouterr().err
    assert main(["plan", "calibrate", "--model", str(tmp_path / "none")]) == 2
    assert "no trained model there" in capsys.readouterr().err


def test_the_engine_is_timed_on_the_threads_the_server_gives_it(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's steps run at `serving_torch_threads()` (what `tiergram serve` uses), and torch's setting is
    put back afterwards."""
    import torch

    from tiergram.bench.calibrate import engine_steps

    monkeypatch.setattr("tiergram.engine.serving_torch_threads", lambda requested=0: 1)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        steps = engine_steps(str(make_tiny_model(tmp_path / "m")), batches=(1, 2), input_len=8, output_len=4,
                             progress=False)
        assert steps["torch_threads"] == 1 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert steps["placement"] == "device" and steps["samples"]
    assert fit_steps(steps, GATHER, 8, 2)["per_token_s"] >= 0


def test_the_http_path_is_measured_at_each_level_in_three_passes(tmp_path: Path) -> None:
    """A real server, three passes (up, down, up the levels), each run with the server's own step counters."""
    from tiergram.bench.calibrate import serve_runs

    serve = serve_runs(str(make_tiny_model(tmp_path / "m")), concurrencies=(1, 2), input_len=8, output_len=4,
                       requests_per_user=1)
    assert [(r["pass"], r["c"]) for r in serve["runs"]] == [(0, 1), (0, 2), (1, 2), (1, 1), (2, 1), (2, 2)]
    assert all(r["steps"] > 0 and r["busy_s"] > 0 and r["wall_s"] > 0 and r["requests"] == r["c"]
               for r in serve["runs"])
    srv = fit_serve(json.loads(json.dumps(serve)), lambda tokens, seqs: 1e-3)  # as read back from the JSON
    for c, ratio in srv["server_step_curve"]:
        assert len(srv["server_step_passes"][c]) == 3 and ratio == pytest.approx(min(srv["server_step_passes"][c]),
                                                                                 abs=2e-3)
    assert srv["request_overhead_s"] >= 0 and srv["per_seq_http_s"] >= 0
