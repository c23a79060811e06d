"""The server under fuzzing, a real OpenAI client, overload, disconnect storms, storage faults and kill -9: the
short form of `tiergram bench soak` (tiergram/bench/soak.py), on the tiny test model, bound to 127.0.0.1."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from test_server import PROMPT, make_tiny_model, metrics, running

from tiergram.bench import soak
from tiergram.engine import Placement

CTX = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("faults-model"), spread_weights=True)


def test_schemathesis_fuzzing_finds_no_5xx_and_no_undocumented_answer(model_dir):
    with running(model_dir, max_model_len=CTX, max_num_seqs=4) as base:
        report = soak.fuzz_api(base, examples=15, seed=1, timeout_s=90)
        assert report["cases"] >= 40 and not report["failures"], report["failures"]
        assert not any(s.startswith("5") for s in report["statuses"]), report["statuses"]
        assert any(s.startswith("4") for s in report["statuses"]) and "200" in report["statuses"]
        hostile = soak.send_hostile(base, CTX)
        assert hostile["tried"] >= 30 and not hostile["failures"], hostile["failures"]
        assert soak.serves_normally(base)
        assert metrics(base)["tiergram_engine_faults_total"] == 0


def test_the_official_openai_client_works_unchanged(model_dir):
    import openai  # a dev dependency: a missing install fails here instead of skipping

    with running(model_dir, max_model_len=CTX) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        [model] = client.models.list().data
        c = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=6, temperature=0)
        assert c.choices[0].finish_reason in ("length", "stop") and c.usage.completion_tokens <= 6
        text = c.choices[0].text
        streamed = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=6, temperature=0, stream=True)
        assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == text
        if len(text) > 2:
            cut = client.completions.create(model=model.id, prompt=PROMPT, max_tokens=6, temperature=0,
                                            stop=[text[1:3]])
            assert cut.choices[0].text == text[:text.find(text[1:3])] and cut.choices[0].finish_reason == "stop"
        chat = client.chat.completions.create(model=model.id, messages=[{"role": "user", "content": "Sort a list."}],
                                              max_tokens=5, temperature=0)
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 5
        chunks = list(client.chat.completions.create(model=model.id, max_tokens=5, temperature=0, stream=True,
                                                     messages=[{"role": "user", "content": "Sort a list."}]))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model.id, prompt=PROMPT, max_tokens=CTX + 1)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=2)


def test_overload_at_twice_capacity_loses_nothing(model_dir):
    """2x (running + waiting) streaming clients: every request is answered (completed or 429), the queue never
    exceeds max_waiting, no 5xx."""
    with running(model_dir, max_model_len=CTX, max_num_seqs=2, max_waiting=2) as base:
        rep = soak.overload(base, clients=8, requests=120, max_tokens=6, retry_after_s=0.005)
        m = metrics(base)
    assert rep["sent"] == 120 and rep["lost"] == rep["server_errors_5xx"] == rep["client_errors_4xx"] == 0, rep
    assert rep["completed"] + rep["rejected_429"] == rep["sent"], rep
    assert rep["completed"] > 0 and rep["rejected_429"] > 0, rep
    assert rep["max_waiting_seen"] <= 2 and rep["ttft_p90_s"] > 0
    assert not any('status="5' in k for k in m if k.startswith("tiergram_requests_total"))
    assert m['tiergram_requests_total{endpoint="/v1/completions",status="429"}'] == rep["rejected_429"]


def test_a_disconnect_storm_gives_every_kv_block_back(model_dir):
    with running(model_dir, max_num_seqs=16) as base:
        storm = soak.disconnect_storm(base, clients=12, timeout_s=60)
        assert storm["kv_blocks_used_peak"] > storm["kv_blocks_used_start"] == 0, storm
        assert storm["kv_blocks_used_after"] == 0 and storm["aborted"] >= 12, storm
        m = metrics(base)
        assert m["tiergram_requests_in_flight"] == 0 and m["tiergram_num_requests_running"] == 0
        assert soak.serves_normally(base)


def test_slow_clients_meet_their_deadlines_and_normal_requests_are_served(model_dir):
    """The soak's slow-client phase, small: 40 clients of every kind against 1-s deadlines for 4 s."""
    from tiergram.settings import ServerSettings

    edge = ServerSettings(header_timeout=1.0, body_timeout=1.0)
    with running(model_dir, app_kw={"settings": edge}, max_model_len=CTX) as base:
        slow = soak.slow_clients(base, clients=40, seconds=4.0, baseline_s=1.0)
        slow["served_after"] = soak.serves_normally(base)
    assert all(soak.slow_checks(slow, header_s=1.0, body_s=1.0).values()), slow
    assert all("408" in v["statuses"] and v["opened"] >= 10 for v in slow["kinds"].values()), slow["kinds"]
    assert slow["connections"]["peak"] >= 20 and slow["normal_beside_slow"]["requests"] > 0, slow
    assert soak.slow_text(slow)[0].startswith("slow clients: 40 for 4 s")


def test_injected_read_faults_fail_requests_cleanly_and_nothing_wrong_is_served(model_dir):
    prompts = soak.fault_prompts(12, seed=2)
    out = soak.storage_faults(model_dir, prompts, rates=(0.01, 1.0))
    one, every = out["injected_0.01"], out["injected_1"]
    assert one["wrong"] == one["other"] == 0 and one["ok"] + one["failed_cleanly"] == 12, one
    assert every["failed_cleanly"] == 12 and every["wrong"] == every["ok"] == 0, every
    assert one["served_after"] and every["served_after"] and every["engine_faults"] >= 12
    assert one["served_once_cleared"] and every["served_once_cleared"]


def test_a_page_corrupted_on_disk_is_never_served(model_dir, tmp_path):
    model = soak.copy_export(model_dir, tmp_path / "model")
    prompts = soak.fault_prompts(16, seed=3)
    with running(model, Placement("file")) as base:
        want = soak.greedy_tokens(base, prompts, 4)
    table, page = soak.page_read_by(model, prompts[0])  # one page, which the first prompt reads
    soak.corrupt_page(table, page)
    with running(model, Placement("file")) as base:
        got = soak.compare_to_reference(soak.greedy_tokens(base, prompts, 4), want)
        assert got["wrong"] == got["other"] == 0 and got["failed_cleanly"] >= 1 and got["ok"] > 0, got
        health = httpx.get(f"{base}/health").json()  # 200, or 503 "unhealthy" once 8 steps in a row failed
        assert health["faults"] == got["failed_cleanly"] and "cannot read page" in health["last_fault"]
        assert soak.answers_cleanly(base)
    from tiergram.format import TableFile

    assert TableFile.open(table).verify() == [page]  # the damage is there for `table verify` to find


def test_kill_9_under_load_then_restart_serves_again(model_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    cfg = soak.SoakConfig(model_dir=str(model), torch_threads=1)
    out = soak.crash_restart(cfg, load_s=2.0)
    assert out["served_after_restart"] and out["tables_verified"] >= 1, out
    assert not out["tables_with_bad_pages"] and not out["stale_shm_files"], out
