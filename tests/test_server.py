"""The HTTP server end to end: a real engine with a real tiny model, uvicorn on loopback, httpx as the client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from support import spread

from tiergram.corpus import PAD, build_corpus, directory_source, load_tokenizer, train_tokenizer
from tiergram.engine import EngineConfig, LLMEngine, Placement
from tiergram.model import EngramLM, make_hasher, tiny_config
from tiergram.model.checkpoint import save_pretrained
from tiergram.server import EngineProcess, create_app, serve_in_thread
from tiergram.server.metrics import parse

FIXTURE = Path(__file__).parent / "data" / "corpus_fixture"
CONTEXT = 1024  # long enough that a request can run for seconds (aborts, queueing, draining)
PROMPT = "def insort(a, x):\n    lo = 0"


def make_tiny_model(root: Path, spread_weights: bool = False) -> Path:
    """A randomly initialised tiny Engram LM with a 1024-token context and a BPE trained on the fixture corpus.

    spread_weights: test_engine's larger weights, so that greedy outputs vary and depend on the Engram rows."""
    corpus = build_corpus(root / "cache", [directory_source("fixture", FIXTURE, "CC0-1.0")], progress=False)
    tok_path = train_tokenizer(corpus, 512, progress=False)
    tok = load_tokenizer(tok_path)
    cfg = tiny_config(tok.get_vocab_size())
    cfg.max_seq = CONTEXT
    cfg.engram.pad_id = tok.token_to_id(PAD)
    torch.manual_seed(0)
    model = EngramLM(cfg, make_hasher(cfg, tokenizer=tok))
    if spread_weights:
        model = spread(model, seed=0)
    return save_pretrained(model, root / "tiny-engram", tokenizer=tok_path)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("server-model"))


@contextmanager
def running(model_dir: Path, placement: Placement | str = "host", hook=None, app_kw=None, mode: str = "thread",
            **engine_kw):
    """A real LLMEngine behind uvicorn on a free loopback port, in a thread; yields the base URL. mode "thread":
    the engine is stepped by a thread of this process; "process": it runs in an EngineProcess (no hook then)."""
    config = EngineConfig(str(model_dir), placement, **engine_kw)
    if mode == "process":
        assert hook is None, "a hook reaches an engine of this process only"
        engine = EngineProcess(config, torch_threads=1)
    else:
        engine = LLMEngine(config)
    if hook is not None:
        hook(engine)
    try:
        with serve_in_thread(create_app(engine, **(app_kw or {})), start_timeout_s=30) as base:
            yield base
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["thread", "process"])
def url(model_dir, request):
    """Every test of this module that takes `url` runs against both: the engine on a thread, in its own process."""
    with running(model_dir, mode=request.param) as base:
        yield base


def complete(base: str, **body) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


def events(response: httpx.Response) -> list[dict | str]:
    """The SSE data payloads of a streamed response ("[DONE]" kept as a string)."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def stream(base: str, path: str, **body) -> list[dict | str]:
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return events(r)


def metrics(base: str) -> dict[str, float]:
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return parse(r.text)


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------ the happy paths

def test_models_and_health(url):
    models = httpx.get(f"{url}/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-engram"
    assert models["data"][0]["max_model_len"] == CONTEXT
    health = httpx.get(f"{url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_plain_and_streamed_agree(url):
    r = complete(url, model="tiny-engram", prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 12 and isinstance(choice["text"], str)
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["total_tokens"] == body["usage"][
        "prompt_tokens"] + 12
    evs = stream(url, "/v1/completions", prompt=PROMPT, max_tokens=12, temperature=0, ignore_eos=True,
                 stream_options={"include_usage": True})
    assert evs[-1] == "[DONE]" and evs[-2]["usage"]["completion_tokens"] == 12
    chunks = [e for e in evs[:-2]]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


def test_chat_plain_and_streamed(url):
    messages = [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "Sort a list."}]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": messages, "max_tokens": 8, "temperature": 0,
                                                      "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["role"] == "assistant"
    evs = stream(url, "/v1/chat/completions", messages=messages, max_tokens=8, temperature=0, ignore_eos=True)
    chunks = evs[:-1]
    assert evs[-1] == "[DONE]" and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == body["choices"][0]["message"]["content"]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == body["choices"][0]["token_ids"]


def test_token_prompts_and_forced_tokens(url, model_dir):
    tok = load_tokenizer(model_dir / "tokenizer.json")
    ids = tok.encode(PROMPT).ids
    forced = tok.encode(" = len(a)\n    while lo < hi:").ids
    by_text = complete(url, prompt=PROMPT, max_tokens=5, temperature=0).json()["choices"][0]["token_ids"]
    assert complete(url, prompt=ids, max_tokens=5, temperature=0).json()["choices"][0]["token_ids"] == by_text
    r = complete(url, prompt_token_ids=ids, forced_tokens=forced, temperature=0.7)
    assert r.json()["choices"][0]["token_ids"] == forced
    assert r.json()["choices"][0]["text"] == " = len(a)\n    while lo < hi:"


def test_stop_strings_cut_the_text(url):
    full = complete(url, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[len(full) // 2:len(full) // 2 + 2]
    want = full[:full.find(stop)]
    r = complete(url, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=[stop]).json()
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    evs = stream(url, "/v1/completions", prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True, stop=stop)
    assert "".join(e["choices"][0]["text"] for e in evs[:-1]) == want
    assert evs[-2]["choices"][0]["finish_reason"] == "stop"


def test_metrics_counters_move(url):
    before = metrics(url)
    complete(url, prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    stream(url, "/v1/completions", prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)
    after = metrics(url)
    def moved(key: str) -> float:
        return after[key] - before.get(key, 0)

    assert moved('tiergram_requests_total{endpoint="/v1/completions",status="200"}') == 2
    assert moved("tiergram_time_to_first_token_seconds_count") == 2
    assert moved("tiergram_inter_token_latency_seconds_count") == 10
    assert moved("tiergram_generation_tokens_total") == 12
    assert moved("tiergram_engine_steps_total") > 0
    # 2 prompts prefilled, then 12 tokens decoded
    assert 0 < moved("tiergram_engine_prefill_steps_total") < moved("tiergram_engine_steps_total")
    assert moved('tiergram_engram_bytes_read_total{tier="host"}') > 0
    assert moved("process_cpu_seconds_total") > 0  # the server's own CPU time (the sweep divides it by tokens)
    for name in ("tiergram_num_requests_running", "tiergram_num_requests_waiting", "tiergram_kv_cache_usage_ratio",
                 "tiergram_engram_cache_hit_rate", "tiergram_engram_exposed_stall_seconds_total",
                 'tiergram_e2e_request_latency_seconds_bucket{le="+Inf"}'):
        assert name in after


def test_a_repeated_prefix_reports_cached_tokens(url):
    """usage.prompt_tokens_details.cached_tokens (whole and streamed) and the prefix counters in /metrics."""
    prompt = [int(t) for t in np.random.default_rng(11).integers(2, 60, 40)]
    first = complete(url, prompt=prompt, max_tokens=3, temperature=0).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    before = metrics(url)
    again = complete(url, prompt=prompt[:36] + [7, 7], max_tokens=3, temperature=0).json()["usage"]
    assert again["prompt_tokens_details"] == {"cached_tokens": 32}  # two full 16-token blocks
    last = stream(url, "/v1/completions", prompt=prompt, max_tokens=3, temperature=0,
                  stream_options={"include_usage": True})[-2]
    assert last["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    after = metrics(url)
    def moved(key: str) -> float:
        return after[key] - before[key]

    assert moved("tiergram_prefix_cache_device_hit_tokens_total") == 64
    assert moved("tiergram_prefix_cache_queried_tokens_total") == 37 + 39
    assert 0 < after["tiergram_prefix_cache_hit_rate"] <= 1


# ------------------------------------------------------------------------------------------------- errors

LONG = " ".join(["token"] * 1200)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -0.5}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, 400, "top_p"),
    ({"prompt": LONG}, 400, "prompt"),
    ({"prompt": PROMPT, "max_tokens": CONTEXT}, 400, "max_tokens"),
    ({"prompt": ""}, 400, "prompt"),
    ({"max_tokens": 4}, 400, "prompt"),
    ({"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ({"prompt": PROMPT, "forced_tokens": []}, 400, "forced_tokens"),
    ({"prompt": PROMPT, "n": 2}, 400, "n"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
])
def test_bad_requests_get_openai_errors(url, body, status, param):
    r = complete(url, **body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"]


def test_bad_json_and_chat_messages(url):
    r = httpx.post(f"{url}/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "robot", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].role"
    r = httpx.get(f"{url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_queue_full_answers_429(model_dir, mode):
    with running(model_dir, max_num_seqs=1, max_waiting=1, mode=mode) as base:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}) as running_r:
            lines = running_r.iter_lines()  # (kept: a dropped line iterator would close the connection)
            next(lines)  # the first request holds the only batch slot
            waiting = threading.Thread(target=complete, args=(base,), kwargs={"prompt": PROMPT, "max_tokens": 2})
            waiting.start()
            wait_for(lambda: metrics(base)["tiergram_num_requests_waiting"] == 1)
            r = complete(base, prompt=PROMPT, max_tokens=2)
            assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        waiting.join(30)  # closing the first stream aborted it, so the waiting one ran
        m = metrics(base)
        assert m['tiergram_requests_total{endpoint="/v1/completions",status="429"}'] == 1
        assert m['tiergram_requests_total{endpoint="/v1/completions",status="200"}'] == 2


def test_client_disconnect_aborts_and_frees_kv(url):
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                      json={"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        m = metrics(url)
        assert m["tiergram_num_requests_running"] == 1 and m["tiergram_kv_blocks_used"] > 0
    wait_for(lambda: metrics(url)["tiergram_num_requests_running"] == 0)
    m = metrics(url)
    assert m["tiergram_kv_blocks_used"] == 0 and m['tiergram_request_finished_total{reason="abort"}'] >= 1
    assert m["tiergram_requests_in_flight"] == 0
    # a non-streaming client that gives up is noticed too
    with pytest.raises(httpx.ReadTimeout):
        complete_timeout = httpx.Timeout(60, read=1.0)
        httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True},
                   timeout=complete_timeout)
    wait_for(lambda: metrics(url)["tiergram_num_requests_running"] == 0)
    m = metrics(url)
    assert m["tiergram_kv_blocks_used"] == 0 and m['tiergram_request_finished_total{reason="abort"}'] >= 2


def test_a_failed_step_is_a_500_and_the_server_goes_on(model_dir):
    """A step that raises fails the requests open in it (error event naming the cause) and counts a fault; the
    next request is served. Only steps failing in a row make /health say unhealthy, and it recovers after."""
    failing = {"steps": 0}

    def flaky(engine: LLMEngine) -> None:
        real = engine.step

        def step():
            if failing["steps"] > 0:
                failing["steps"] -= 1
                raise RuntimeError("injected step failure")
            return real()
        engine.step = step

    with running(model_dir, hook=flaky) as base:
        failing["steps"] = 1
        evs = stream(base, "/v1/completions", prompt=PROMPT, max_tokens=50, ignore_eos=True)
        assert "injected step failure" in evs[-2]["error"]["message"] and evs[-1] == "[DONE]"
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json()["faults"] == 1
        assert "injected step failure" in health.json()["last_fault"]
        ok = complete(base, prompt=PROMPT, max_tokens=4, ignore_eos=True)
        assert ok.status_code == 200 and len(ok.json()["choices"][0]["token_ids"]) == 4
        assert httpx.get(f"{base}/health").json()["consecutive_faults"] == 0
        failing["steps"] = 10**6  # a fault that does not go away
        for _ in range(9):
            r = complete(base, prompt=PROMPT, max_tokens=2)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            assert "injected step failure" in r.json()["error"]["message"]
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"
        failing["steps"] = 0
        assert complete(base, prompt=PROMPT, max_tokens=2).status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200
        m = metrics(base)
        assert m['tiergram_request_finished_total{reason="error"}'] == 10
        assert m["tiergram_engine_faults_total"] == 10 and m["tiergram_engine_consecutive_faults"] == 0


@pytest.fixture(scope="module")
def spread_model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("server-spread"), spread_weights=True)


def plant_wrong_rows(engine: LLMEngine, prompt_ids: list[int]) -> None:
    """Overwrite, in the host tables, the rows the prompt's last position reads (every layer and head)."""
    rows = engine.model.hasher.row_ids(np.asarray([prompt_ids], dtype=np.int64))  # {layer: [1, T, H]}
    for layer, ids in rows.items():
        src = engine.sources[layer]
        m = src.manifest
        for h in range(ids.shape[2]):
            page, slot = divmod(int(src.table.head_offsets[h] + ids[0, -1, h]), m.rows_per_page)
            at = page * m.page_size + slot * m.row_bytes
            src.tier.data[at:at + m.row_bytes] = np.full(m.dim, 3.0, np.float32).view(np.uint8)


def test_greedy_output_identical_across_placements(spread_model_dir):
    """The same greedy tokens from every placement, and tokens that depend on the rows served: a wrong row
    planted in the table changes them, so a placement serving wrong rows would fail here."""
    tok = load_tokenizer(spread_model_dir / "tokenizer.json")
    ids = tok.encode(PROMPT).ids

    def run(base: str) -> tuple[list[int], list[int]]:
        plain = complete(base, prompt=PROMPT, max_tokens=16, temperature=0, ignore_eos=True).json()
        evs = stream(base, "/v1/completions", prompt="import heapq\n", max_tokens=16, temperature=0,
                     ignore_eos=True)
        return plain["choices"][0]["token_ids"], [t for e in evs[:-1] for t in e["choices"][0]["token_ids"]]

    want = None
    for placement in (Placement("device"), Placement("host"), Placement("file", cache_bytes=64 << 10)):
        with running(spread_model_dir, placement) as base:
            got = run(base)
        assert len(got[0]) == 16 and len(got[1]) == 16
        if want is None:
            want = got
            assert len(set(want[0])) > 3 and want[0] != want[1]  # not one repeated token
        assert got == want, f"placement {placement.kind} differs"
    with running(spread_model_dir, Placement("host", codec="fp32"),
                 hook=lambda eng: plant_wrong_rows(eng, ids)) as base:
        wrong = run(base)
    with running(spread_model_dir, Placement("host", codec="fp32")) as base:
        right = run(base)
    assert wrong[0] != right[0], "a wrong Engram row did not change the greedy output: the test could not fail"
    assert wrong[1] == right[1]  # the other prompt reads other rows


# ---------------------------------------------------------------------------------------------- SIGTERM

def test_serve_refuses_negative_torch_threads(model_dir):
    from tiergram.cli import main

    with pytest.raises(SystemExit, match="--torch-threads: must be an integer >= 0, got -1"):
        main(["serve", str(model_dir), "--torch-threads", "-1"])


def test_the_server_leaves_a_core_to_the_http_loop_and_the_reads(monkeypatch):
    """--torch-threads 0 (the default): the CPUs this process may run on less one, at least one; a number is kept."""
    from tiergram.engine import serving_torch_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    assert serving_torch_threads() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    assert serving_torch_threads() == 15 and serving_torch_threads(4) == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {3})
    assert serving_torch_threads() == 1
    with pytest.raises(ValueError, match="torch threads must be >= 0, got -2"):
        serving_torch_threads(-2)


@contextmanager
def serve_subprocess(model_dir: Path, *args: str):
    """`tiergram serve MODEL_DIR --port 0 ARGS` in a subprocess, healthy; yields (process, base URL), killed at
    the end if still running."""
    proc = subprocess.Popen([sys.executable, "-m", "tiergram", "serve", str(model_dir), "--port", "0",
                             "--log-level", "warning", "--torch-threads", "1", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        line = proc.stdout.readline()
        assert " on http://127.0.0.1:" in line, line + proc.stderr.read()
        base = line.strip().rsplit(" on ", 1)[1]
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200, 30)
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("engine_args", [(), ("--engine-process",)], ids=["thread", "process"])
def test_sigterm_drains_then_exits_zero(model_dir, engine_args):
    """The first SIGTERM drains: /health 503, new requests 503, the one in flight runs to its end, exit 0 (with the
    engine in its own process too: it ignores the signal and is stopped after the drain)."""
    with serve_subprocess(model_dir, *engine_args) as (proc, base):
        t0 = time.monotonic()
        got: list[int] = []
        finish: list[str | None] = []

        def in_flight() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        got.extend(choice["token_ids"])
                        finish.append(choice["finish_reason"])

        t = threading.Thread(target=in_flight)
        t.start()
        wait_for(lambda: len(got) > 0)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 503)
        refused = complete(base, prompt=PROMPT, max_tokens=2)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert t.is_alive(), f"the in-flight request ended while draining: {len(got)} tokens, " \
            f"{time.monotonic() - t0:.2f} s"
        t.join(60)
        assert len(got) == 1000 and finish[-1] == "length"
        assert proc.wait(30) == 0
