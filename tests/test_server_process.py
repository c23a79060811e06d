"""The engine in a process of its own (EngineProcess): what a thread engine cannot show — a dead engine process,
a failed start, the HTTP process dying, CPU and memory counted over both processes. The API itself runs against
both modes in test_server.py (its `url` fixture)."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from test_server import PROMPT, complete, make_tiny_model, metrics, running, serve_subprocess, wait_for

from tiergram.bench.serve_process import _children, peak_rss
from tiergram.engine import EngineConfig
from tiergram.server import EngineProcess, EngineStartError


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("process-model"))


def test_a_killed_engine_process_fails_open_requests_and_health(model_dir):
    with running(model_dir, mode="process") as base:
        assert complete(base, prompt=PROMPT, max_tokens=3).status_code == 200
        pids = [p for p in _children(os.getpid()) if _cmdline(p).find("multiprocessing") >= 0 and
                "spawn_main" in _cmdline(p)]
        assert pids, "no engine process found"
        events: list[str] = []

        def in_flight() -> None:
            with httpx.stream("POST", f"{base}/v1/completions", timeout=60,
                              json={"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
                events.extend(line for line in r.iter_lines() if line.startswith("data: "))

        t = threading.Thread(target=in_flight)
        t.start()
        wait_for(lambda: len(events) > 2)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        t.join(30)
        assert not t.is_alive()
        errors = [json.loads(e[6:]) for e in events if e.startswith("data: {\"error\"")]
        assert errors and "engine process exited" in errors[0]["error"]["message"], events[-3:]
        assert events[-1] == "data: [DONE]"
        health = httpx.get(f"{base}/health", timeout=10)
        assert health.status_code == 503 and "exited" in health.json()["error"]
        r = complete(base, prompt=PROMPT, max_tokens=2)
        assert r.status_code == 503 and "not running" in r.json()["error"]["message"]


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def test_a_failed_start_names_the_cause(model_dir):
    with pytest.raises(EngineStartError, match="ValueError: max_model_len 99999 exceeds the model's max_seq"):
        EngineProcess(EngineConfig(str(model_dir), "host", max_model_len=99999))


def test_engine_cpu_is_counted_apart_from_the_http_process(model_dir):
    with running(model_dir, mode="process") as base:
        before = metrics(base)["tiergram_engine_process_cpu_seconds_total"]
        assert complete(base, prompt=PROMPT, max_tokens=24, ignore_eos=True).status_code == 200
        wait_for(lambda: metrics(base)["tiergram_engine_process_cpu_seconds_total"] > before)


def test_the_engine_process_dies_with_the_server_and_counts_in_its_memory(model_dir):
    """`tiergram serve --engine-process` runs its engine in a child process: peak RSS sums both, and a SIGKILLed
    server leaves no engine process behind."""
    with serve_subprocess(model_dir, "--engine-process") as (proc, _):
        engine = [p for p in _children(proc.pid) if "spawn_main" in _cmdline(p)]
        assert len(engine) == 1
        with open(f"/proc/{proc.pid}/status") as f:
            own = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))
        assert peak_rss(proc.pid) > own
        proc.kill()
        proc.wait(10)
        wait_for(lambda: not os.path.exists(f"/proc/{engine[0]}") or "Z" in _state(engine[0]), 15)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1].split()[0]
    except OSError:
        return "Z"


def test_errors_cross_the_pipe_as_their_type_and_message():
    """Any exception the engine raises reaches the HTTP process (even one that would not unpickle): the types
    the handlers tell apart (400, 429, 503) come back as themselves, the rest as RuntimeError naming the type."""
    import pickle

    from tiergram.engine import QueueFullError
    from tiergram.server import EngineDeadError
    from tiergram.server.engine_process import WireError

    class Odd(Exception):
        def __init__(self, a, b):  # two required arguments: pickle could not rebuild it
            super().__init__(f"{a}/{b}")

    for error, kind in ((ValueError("bad prompt"), ValueError), (QueueFullError("full"), QueueFullError),
                        (EngineDeadError("gone"), EngineDeadError)):
        back = pickle.loads(pickle.dumps(WireError.of(error))).rebuild()
        assert type(back) is kind and str(back) == str(error)
    back = pickle.loads(pickle.dumps(WireError.of(Odd(1, 2)))).rebuild()
    assert type(back) is RuntimeError and str(back) == "Odd: 1/2"
