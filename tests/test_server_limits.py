"""Limits on every input: each hostile request gets a 4xx in the OpenAI error shape before any work is done, and
the server serves a normal request right after; the metric names /metrics served before prometheus-client."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from test_server import PROMPT, complete, make_tiny_model, metrics, running

from tiergram.engine import Placement
from tiergram.settings import ServerSettings

CTX = 128  # a short context keeps every accepted request short


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("limits-model"))


@pytest.fixture(scope="module")
def url(model_dir):
    with running(model_dir, max_model_len=CTX) as base:
        yield base


def post(base: str, content: bytes, path: str = "/v1/completions", **headers: str) -> httpx.Response:
    return httpx.post(f"{base}{path}", content=content, headers={"content-type": "application/json", **headers},
                      timeout=60)


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...], param: str | None = None) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def still_serves(base: str) -> None:
    r = complete(base, prompt=PROMPT, max_tokens=3, temperature=0, ignore_eos=True)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 3, r.text


HOSTILE_FIELDS = [
    ({"prompt": "x" * (32 * CTX + 1)}, 400, "prompt"),  # characters beyond the limit
    ({"prompt": [5] * CTX}, 400, "prompt"),  # tokens: no room for one output token
    ({"prompt_token_ids": [5] * (CTX + 1)}, 400, "prompt_token_ids"),
    ({"prompt_token_ids": [5, 10**6]}, 400, "prompt_token_ids"),
    ({"prompt": PROMPT, "max_tokens": CTX + 1}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 10**30}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "5"}, 400, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 2.5}, 400, "max_tokens"),
    ({"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"prompt": PROMPT, "stop": "s" * 257}, 400, "stop"),
    ({"prompt": PROMPT, "stop": [""]}, 400, "stop"),
    ({"prompt": PROMPT, "stop": 7}, 400, "stop"),
    ({"prompt": PROMPT, "n": 2}, 400, "n"),
    ({"prompt": PROMPT, "n": "1"}, 400, "n"),
    ({"prompt": PROMPT, "logprobs": 5}, 400, "logprobs"),
    ({"prompt": PROMPT, "echo": True}, 400, "echo"),
    ({"prompt": PROMPT, "temperature": 2.5}, 400, "temperature"),
    ({"prompt": PROMPT, "temperature": -1e-9}, 400, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, 400, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, 400, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.0000001}, 400, "top_p"),
    ({"prompt": PROMPT, "top_k": -1}, 400, "top_k"),
    ({"prompt": PROMPT, "top_k": 10**6}, 400, "top_k"),
    ({"prompt": PROMPT, "seed": 2**64}, 400, "seed"),
    ({"prompt": PROMPT, "frequency_penalty": 0.5}, 400, "frequency_penalty"),
    ({"prompt": PROMPT, "logit_bias": {"5": 100}}, 400, "logit_bias"),
    ({"prompt": PROMPT, "bogus_field": 1}, 400, "bogus_field"),
    ({"prompt": PROMPT, "stream": "yes"}, 400, "stream"),
    ({"prompt": PROMPT, "stream_options": {"include_usage": True, "x": 1}}, 400, "stream_options"),
    ({"prompt": PROMPT, "ignore_eos": 1}, 400, "ignore_eos"),
    ({"prompt": PROMPT, "stream_options": []}, 400, "stream_options"),  # falsy wrong types (found by the fuzzing)
    ({"prompt": PROMPT, "stop_token_ids": ""}, 400, "stop_token_ids"),
    ({"prompt": PROMPT, "stop_token_ids": 0}, 400, "stop_token_ids"),
    ({"prompt": PROMPT, "model": 17}, 400, "model"),
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, 2, 10**6]}, 400, "prompt"),
    ({"prompt": [1, -2]}, 400, "prompt"),
    ({"prompt": [1, True]}, 400, "prompt"),
    ({"prompt": PROMPT, "stop_token_ids": [10**6]}, 400, "stop_token_ids"),
    ({"prompt": PROMPT, "stop_token_ids": list(range(65))}, 400, "stop_token_ids"),
    ({"prompt": PROMPT, "forced_tokens": [10**6]}, 400, "forced_tokens"),
    ({"prompt": PROMPT, "forced_tokens": [3] * CTX}, 400, "forced_tokens"),
    ({"prompt": PROMPT, "model": "gpt-4"}, 404, "model"),
]


@pytest.mark.parametrize("body,status,param", HOSTILE_FIELDS, ids=[str(i) for i in range(len(HOSTILE_FIELDS))])
def test_hostile_fields_get_4xx(url, body, status, param):
    assert_openai_error(complete(url, **body), status, param)


HOSTILE_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "tool", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x" * (32 * CTX + 1)}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}] * 1025}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize("body,param", HOSTILE_CHAT, ids=[str(i) for i in range(len(HOSTILE_CHAT))])
def test_hostile_chat_gets_4xx(url, body, param):
    assert_openai_error(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60), 400, param)


HOSTILE_BODIES = [
    (b"", 400), (b"{not json", 400), (b"[1, 2]", 400), (b"null", 400), (b'"a string"', 400),
    (b'{"prompt": "\xff\xfe not utf-8"}', 400), (b'{"prompt": "hi", "temperature": NaN}', 400),
    (b'{"prompt": "hi", "top_p": Infinity}', 400), (b'{"prompt": "\\ud800 lone surrogate"}', 400),
    (b'{"messages": [{"role": "user", "content": "\\udfff"}], "prompt": "\\ud800"}', 400),
    (b"[" * 100_000 + b"]" * 100_000, (400, 413)),
    (b'{"prompt": "' + b"a" * (1 << 20) + b'"}', 413),
]


@pytest.mark.parametrize("content,status", HOSTILE_BODIES, ids=[str(i) for i in range(len(HOSTILE_BODIES))])
def test_hostile_bodies_get_4xx(url, content, status):
    assert_openai_error(post(url, content), status)
    assert_openai_error(post(url, content, "/v1/chat/completions"), status)


def test_after_every_hostile_input_a_normal_request_is_served(url):
    still_serves(url)
    m = metrics(url)
    assert not any(k.startswith("tiergram_requests_total") and 'status="5' in k for k in m), m
    assert m["tiergram_engine_faults_total"] == 0


def test_a_streamed_oversized_body_is_refused(url):
    """A body sent without Content-Length (chunked) is cut off at the limit too."""
    r = httpx.post(f"{url}/v1/completions", content=iter([b'{"prompt": "', b"a" * (2 << 20), b'"}']),
                   headers={"content-type": "application/json"}, timeout=60)
    assert_openai_error(r, 413)


def test_temperature_1e_40_beside_a_greedy_request(url):
    """The request that took the server down: a tiny temperature, with a greedy request in the same batch."""
    results: dict[str, httpx.Response] = {}

    def send(name: str, **body) -> None:
        results[name] = complete(url, prompt=PROMPT, max_tokens=12, ignore_eos=True, **body)

    threads = [threading.Thread(target=send, args=("tiny",), kwargs={"temperature": 1e-40}),
               threading.Thread(target=send, args=("greedy",), kwargs={"temperature": 0})]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results["tiny"].status_code == 200 and results["greedy"].status_code == 200
    assert results["tiny"].json()["choices"][0]["token_ids"] == results["greedy"].json()["choices"][0]["token_ids"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_429_costs_nothing(model_dir):
    """With the queue full, the answer is 429 before the body is parsed, tokenized or any row is read ahead."""
    with running(model_dir, Placement("file", cache_bytes=64 << 10), max_waiting=0, max_model_len=CTX) as base:
        before = metrics(base)
        for content in (b"{not even json", json.dumps({"prompt": PROMPT * 20}).encode()):
            err = assert_openai_error(post(base, content), 429)
            assert err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        after = metrics(base)
        assert after["tiergram_engram_pages_read_total"] == before["tiergram_engram_pages_read_total"]
        assert after['tiergram_request_finished_total{reason="rejected"}'] == 2
        assert after["tiergram_requests_in_flight"] == 0


def test_a_long_prompt_is_tokenized_off_the_event_loop(model_dir):
    threads: list[str] = []

    def record(engine) -> None:
        real = engine.tokenizer

        class Recording:  # the real tokenizer, noting which thread calls encode
            def __getattr__(self, name):
                return getattr(real, name)

            def encode(self, text):
                threads.append(threading.current_thread().name)
                return real.encode(text)

        engine.tokenizer = Recording()

    with running(model_dir, hook=record, max_model_len=CTX) as base:
        complete(base, prompt="a b", max_tokens=1)
        long = ("def f(x):\n    return x\n" * 200)[: 32 * CTX - 10]
        r = complete(base, prompt=long, max_tokens=1)
        assert_openai_error(r, 400, "prompt")  # beyond the context in tokens, found out on a worker thread
    assert len(threads) == 2 and threads[0] != threads[1]


# ------------------------------------------------------------------------------------------ metric names

# Every metric name /metrics served before it moved to prometheus-client (docs/serving.md lists them).
METRIC_NAMES = [
    "tiergram_requests_total", "tiergram_request_finished_total", "tiergram_time_to_first_token_seconds_bucket",
    "tiergram_time_to_first_token_seconds_sum", "tiergram_time_to_first_token_seconds_count",
    "tiergram_inter_token_latency_seconds_bucket", "tiergram_inter_token_latency_seconds_count",
    "tiergram_e2e_request_latency_seconds_bucket", "tiergram_e2e_request_latency_seconds_count",
    "tiergram_prompt_tokens_total", "tiergram_generation_tokens_total", "tiergram_requests_in_flight",
    "tiergram_draining", "tiergram_num_requests_running", "tiergram_num_requests_waiting", "tiergram_kv_blocks_total",
    "tiergram_kv_blocks_used", "tiergram_kv_cache_usage_ratio", "tiergram_kv_blocks_affordable",
    "tiergram_device_table_bytes", "tiergram_num_preemptions_total", "tiergram_engine_steps_total",
    "tiergram_engine_step_seconds_total", "tiergram_engine_computed_tokens_total", "tiergram_engram_cache_hit_rate",
    "tiergram_engram_cache_hits_total", "tiergram_engram_cache_probes_total", "tiergram_engram_bytes_read_total",
    "tiergram_engram_pages_read_total", "tiergram_engram_exposed_stall_seconds_total",
    "tiergram_engram_prefill_stall_seconds_total", "tiergram_engine_prefill_steps_total",
    "tiergram_engram_last_step_stall_seconds", "tiergram_degrade_level", "tiergram_engram_skipped_rows_total",
    "tiergram_degrade_steps_total", "process_cpu_seconds_total",
]


def test_metrics_keep_every_name(url):
    still_serves(url)
    names = {key.split("{")[0] for key in metrics(url)}
    assert not set(METRIC_NAMES) - names, sorted(set(METRIC_NAMES) - names)
    assert "tiergram_engine_faults_total" in names and "process_resident_memory_bytes" in names
    assert "tiergram_engram_pages_stalled_total" in names
    assert {"tiergram_engine_prompt_rows_waits_total", "tiergram_engine_prompt_rows_wait_seconds_total",
            "tiergram_engine_prompt_rows_timeouts_total"} <= names
    assert not any(n.endswith("_created") for n in names)


# ------------------------------------------------------------------------------------------------- CLI

def test_serve_device_auto_and_one_line_errors(model_dir):
    from tiergram.cli import build_parser
    from tiergram.cli.serve import engine_config

    args = build_parser().parse_args(["serve", str(model_dir), "--device", "auto"])
    import torch

    assert engine_config(args).device == ("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        return
    proc = subprocess.run([sys.executable, "-m", "tiergram", "serve", str(model_dir), "--device", "cuda",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "CUDA" in lines[0], proc.stderr


def test_limits_are_configurable(model_dir):
    limits = ServerSettings(max_body_bytes=300, max_prompt_chars=20, max_stop=1, max_stop_chars=3)
    with running(model_dir, app_kw={"settings": limits}, max_model_len=CTX) as base:
        assert_openai_error(complete(base, prompt="x" * 21), 400, "prompt")
        assert_openai_error(complete(base, prompt="x", stop=["a", "b"]), 400, "stop")
        assert_openai_error(complete(base, prompt="x", stop="abcd"), 400, "stop")
        assert_openai_error(complete(base, prompt=[100] * 110), 413)
        r = complete(base, prompt="x" * 20, stop="abc", max_tokens=2, ignore_eos=True)
        assert r.status_code == 200, r.text
        schema = httpx.get(f"{base}/openapi.json").json()
        prompt = schema["components"]["schemas"]["CompletionRequest"]["properties"]["prompt"]["oneOf"][0]
        assert prompt["maxLength"] == 20
