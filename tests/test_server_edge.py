"""The server's edge, tried as a hostile client would: slow and lying clients meet deadlines and caps, odd input
gets 4xx, a disconnect is a disconnect, only key holders and allowed hosts get in, errors show no internals, the
engine-process front end forgets every request, the engine loop survives its own exceptions."""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server import PROMPT, complete, make_tiny_model, metrics, running, serve_subprocess, stream, wait_for
from test_server_limits import assert_openai_error

from tiergram.settings import ServerSettings, is_loopback

CTX = 128
DEADLINE = 1.0  # the edge's header and body deadlines in these tests
SLACK = 4.0  # answered within the deadline and this (a busy 2-core machine)
EDGE = ServerSettings(header_timeout=DEADLINE, body_timeout=DEADLINE, max_connections=40, max_reading=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("edge-model"))


@pytest.fixture(scope="module")
def url(model_dir):
    with running(model_dir, app_kw={"settings": EDGE}, max_model_len=CTX) as base:
        yield base


def connect(base: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=30)


def answer(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes, and how long that took."""
    t0, out = time.monotonic(), b""
    while chunk := sock.recv(65536):
        out += chunk
    return out, time.monotonic() - t0


def status_of(raw: bytes) -> int:
    return int(raw.split(b" ", 2)[1])


HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"


def server_errors(base: str) -> dict[str, float]:
    return {k: v for k, v in metrics(base).items() if k.startswith("tiergram_requests_total") and 'status="5' in k}


# ------------------------------------------------------------------------------------ deadlines and caps

@pytest.mark.parametrize("sent", [
    b"",  # an idle connection
    b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n",  # half a header
    HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\": ",  # a Content-Length larger than the body that follows
], ids=["idle", "half-header", "lying-length"])
def test_a_stalled_request_is_answered_408_within_its_deadline(url, sent):
    with connect(url) as sock:
        sock.sendall(sent)
        raw, took = answer(sock)
    assert status_of(raw) == 408 and b'"code": "request_timeout"' in raw, raw
    assert took < DEADLINE + SLACK


def test_the_next_request_on_a_kept_alive_connection_has_a_header_deadline_too(url):
    with connect(url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\nGET /health HTTP/1.1\r\nHost: loc")
        raw, took = answer(sock)
    assert raw.startswith(b"HTTP/1.1 200") and b"HTTP/1.1 408 Request Timeout" in raw, raw
    assert took < DEADLINE + SLACK


def test_a_trickled_body_meets_a_total_deadline_not_an_idle_timeout(url):
    """A byte every 0.2 s never lets an idle timeout fire; the body's deadline counts from its headers."""
    with connect(url) as sock:
        sock.sendall(HEAD + b"Content-Length: 1000\r\n\r\n")
        t0, closed = time.monotonic(), False
        while time.monotonic() - t0 < DEADLINE + SLACK:
            try:
                sock.sendall(b" ")
            except OSError:  # the server closed it
                closed = True
                break
            time.sleep(0.2)
            sock.setblocking(False)
            try:
                got = sock.recv(65536)
            except BlockingIOError:
                got = None
            sock.setblocking(True)
            if got is not None:
                assert status_of(got) == 408, got
                closed = True
                break
        assert closed, "a trickled body held its connection past the deadline"
    assert still_serves(url)


def still_serves(base: str) -> bool:
    r = complete(base, prompt=PROMPT, max_tokens=2, ignore_eos=True)
    return r.status_code == 200


def test_many_half_headers_are_all_closed_by_the_deadline(url):
    socks = [connect(url) for _ in range(30)]
    for s in socks:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: loc")
    assert still_serves(url)  # meanwhile
    t0 = time.monotonic()
    for s in socks:
        raw, _ = answer(s)
        assert status_of(raw) == 408
        s.close()
    assert time.monotonic() - t0 < DEADLINE + SLACK
    wait_for(lambda: metrics(url)["tiergram_http_connections"] <= 1)


def test_connections_beyond_the_cap_get_503_with_retry_after_at_once(model_dir):
    edge = ServerSettings(header_timeout=30, max_connections=5)
    with running(model_dir, app_kw={"settings": edge}, max_model_len=CTX) as base:
        held = [connect(base) for _ in range(5)]
        time.sleep(0.2)
        with connect(base) as extra:
            extra.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            raw, took = answer(extra)
        assert status_of(raw) == 503 and b"retry-after: 1" in raw.lower() and b"too_many_connections" in raw, raw
        assert took < SLACK
        for s in held:
            s.close()
        wait_for(lambda: httpx.get(f"{base}/health").status_code == 200)
        m = metrics(base)
        assert m['tiergram_requests_total{endpoint="other",status="503"}'] >= 1


def test_requests_beyond_the_reading_cap_get_429_with_retry_after(model_dir):
    """Requests still reading their body hold the reading slots; one more is refused at once, and served again
    once the slow one's deadline has freed its slot."""
    edge = ServerSettings(body_timeout=DEADLINE, max_reading=2)
    with running(model_dir, app_kw={"settings": edge}, max_model_len=CTX) as base:
        slow = [connect(base) for _ in range(2)]
        for s in slow:
            s.sendall(HEAD + b"Content-Length: 50\r\n\r\n{")
        wait_for(lambda: metrics(base)["tiergram_requests_reading"] == 2)
        r = complete(base, prompt=PROMPT, max_tokens=2)
        err = assert_openai_error(r, 429)
        assert err["code"] == "too_many_reading" and r.headers["retry-after"] == "1"
        for s in slow:
            assert status_of(answer(s)[0]) == 408
            s.close()
        wait_for(lambda: metrics(base)["tiergram_requests_reading"] == 0)
        assert still_serves(base)
        assert metrics(base)['tiergram_requests_total{endpoint="/v1/completions",status="408"}'] == 2


def test_a_full_queue_answers_429_with_retry_after(model_dir):
    with running(model_dir, max_waiting=0, max_model_len=CTX) as base:
        r = complete(base, prompt=PROMPT, max_tokens=2)
        assert assert_openai_error(r, 429)["code"] == "queue_full" and r.headers["retry-after"] == "1"


# ------------------------------------------------------------------------------------------- odd input

@pytest.mark.parametrize("name", ["temperature", "top_p", "presence_penalty", "frequency_penalty"])
def test_a_400_digit_number_is_a_400(url, name):
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi", "%s": %s}' % (name.encode(), b"9" * 400),
                   headers={"content-type": "application/json"})
    assert "too large" in assert_openai_error(r, 400, name)["message"]


@pytest.mark.parametrize("body,status,param", [
    (b'{"prompt": "hi", "model": "\\ud800"}', 404, "model"),
    (b'{"prompt": "hi", "\\udfff": 1}', 400, "\\udfff"),
    (b'{"messages": [{"role": "user", "content": "hi", "\\ud800x": 1}]}', 400, "messages[0].\\ud800x"),
], ids=["model", "field", "message-field"])
def test_an_echoed_lone_surrogate_is_escaped(url, body, status, param):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
    assert assert_openai_error(r, status, param)["message"]
    assert not server_errors(url)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_client_gone_mid_body_is_a_counted_disconnect_not_a_500(url):
    records = Records()
    logging.getLogger("uvicorn.error").addHandler(records)
    try:
        key = 'tiergram_requests_total{endpoint="/v1/completions",status="499"}'
        before = metrics(url).get(key, 0)
        with connect(url) as sock:
            sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{\"prompt\": \"a")
            wait_for(lambda: metrics(url)["tiergram_requests_reading"] == 1)
        wait_for(lambda: metrics(url).get(key, 0) == before + 1)
    finally:
        logging.getLogger("uvicorn.error").removeHandler(records)
    assert not server_errors(url)
    assert not [r for r in records.records if r.exc_info or r.levelno >= logging.ERROR], records.records
    assert metrics(url)["tiergram_requests_reading"] == 0


# ------------------------------------------------------------------------------------------- who may call

def test_the_api_key_guards_every_endpoint_but_the_public_ones(model_dir):
    with running(model_dir, app_kw={"settings": ServerSettings(api_key="s3cret")}, max_model_len=CTX) as base:
        for path in ("/v1/models", "/openapi.json"):
            r = httpx.get(f"{base}{path}")
            assert assert_openai_error(r, 401)["code"] == "invalid_api_key" and r.headers["www-authenticate"]
            assert_openai_error(httpx.get(f"{base}{path}", headers={"Authorization": "Bearer wrong"}), 401)
            assert_openai_error(httpx.get(f"{base}{path}", headers={"Authorization": "Basic s3cret"}), 401)
            assert httpx.get(f"{base}{path}", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert_openai_error(complete(base, prompt=PROMPT, max_tokens=2), 401)
        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"Authorization": "Bearer s3cret"})
        assert r.status_code == 200
        assert httpx.get(f"{base}/health").status_code == 200 and httpx.get(f"{base}/metrics").status_code == 200
    no_public_path = ServerSettings(api_key="k", public_paths=[])
    with running(model_dir, app_kw={"settings": no_public_path}, max_model_len=CTX) as base:
        assert_openai_error(httpx.get(f"{base}/health"), 401)
        assert httpx.get(f"{base}/health", headers={"Authorization": "Bearer k"}).status_code == 200


def test_the_cli_takes_the_api_key_from_the_environment(monkeypatch, model_dir):
    from tiergram.cli import build_parser
    from tiergram.cli.serve import settings_of

    monkeypatch.setenv("TIERGRAM_API_KEY", "from-env")
    server = settings_of(build_parser().parse_args(["serve", str(model_dir)])).server
    assert server.api_key == "from-env" and server.public_paths == ["/health", "/metrics"] and not server.debug
    args = build_parser().parse_args(["serve", str(model_dir), "--api-key", "flag", "--allowed-hosts", "a, b"])
    assert settings_of(args).server.api_key == "flag" and settings_of(args).server.allowed_hosts == ["a", "b"]


def test_serve_takes_the_edge_from_its_config_file(model_dir, monkeypatch, tmp_path):
    """`tiergram serve` end to end: the key from the environment, a 1-s header deadline from the --config file's
    [server], loopback hosts only."""
    monkeypatch.setenv("TIERGRAM_API_KEY", "env-key")
    config = tmp_path / "serve.toml"
    config.write_text("[server]\nheader_timeout = 1\nmax_connections = 64\n")
    with serve_subprocess(model_dir, "--config", str(config)) as (_, base):
        assert_openai_error(httpx.get(f"{base}/v1/models"), 401)
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer env-key"}).status_code == 200
        with connect(base) as sock:
            sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: loc")
            raw, took = answer(sock)
        assert status_of(raw) == 408 and took < 1 + SLACK
        assert raw_request(base, b"GET /health HTTP/1.1\r\nHost: evil.example\r\n")[0] == 400


def raw_request(base: str, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    with connect(base) as sock:
        sock.sendall(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        raw, _ = answer(sock)
    return status_of(raw), raw


def test_a_browser_cannot_drive_a_loopback_server(url):
    """DNS rebinding (a foreign Host) and a cross-site simple POST (a foreign Origin) are refused before any work;
    loopback names and same-origin requests are served."""
    port = url.rsplit(":", 1)[1].encode()
    before = metrics(url)
    body = b'{"prompt": "hi", "max_tokens": 2}'
    status, raw = raw_request(url, b"POST /v1/completions HTTP/1.1\r\nHost: evil.example\r\n"
                                   b"Content-Type: text/plain\r\n", body)
    assert status == 400 and b"invalid_host" in raw
    status, raw = raw_request(url, b"POST /v1/completions HTTP/1.1\r\nHost: localhost:" + port + b"\r\n"
                                   b"Origin: https://evil.example\r\nContent-Type: text/plain\r\n", body)
    assert status == 403 and b"origin_not_allowed" in raw and b"access-control" not in raw.lower()
    assert metrics(url)["tiergram_engine_steps_total"] == before["tiergram_engine_steps_total"]
    for host in (b"localhost:" + port, b"127.0.0.1:" + port, b"[::1]:" + port, b"app.localhost"):
        status, raw = raw_request(url, b"GET /v1/models HTTP/1.1\r\nHost: " + host + b"\r\n")
        assert status == 200, (host, raw)
    status, _ = raw_request(url, b"GET /v1/models HTTP/1.1\r\nHost: localhost:" + port + b"\r\n"
                                 b"Origin: http://localhost:" + port + b"\r\n")
    assert status == 200


def test_allowed_hosts_and_cors_origins_when_asked_for(model_dir):
    edge = ServerSettings(allowed_hosts=["api.example"], cors_origins=["https://app.example"])
    with running(model_dir, app_kw={"settings": edge}, max_model_len=CTX) as base:
        assert raw_request(base, b"GET /v1/models HTTP/1.1\r\nHost: api.example:443\r\n")[0] == 200
        assert raw_request(base, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n")[0] == 400
        r = httpx.options(f"{base}/v1/completions", headers={
            "Host": "api.example", "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"Host": "api.example", "Origin": "https://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                       headers={"Host": "api.example", "Origin": "https://other.example"})
        assert assert_openai_error(r, 403)["code"] == "origin_not_allowed"
    with running(model_dir, app_kw={"settings": ServerSettings(allowed_hosts=["*"])}, max_model_len=CTX) as base:
        assert raw_request(base, b"GET /v1/models HTTP/1.1\r\nHost: anything.example\r\n")[0] == 200


def test_what_counts_as_loopback_and_the_default_hosts_of_a_bind():
    assert all(is_loopback(h) for h in ("localhost", "127.0.0.1", "127.1.2.3", "::1", "[::1]", "a.localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "evil.example", "localhost.evil.example"))
    assert ServerSettings().for_bind("127.0.0.1").allowed_hosts is None
    assert ServerSettings().for_bind("::1").allowed_hosts is None
    assert ServerSettings().for_bind("0.0.0.0").allowed_hosts == ["*"]
    assert ServerSettings(allowed_hosts=["api.example"]).for_bind("0.0.0.0").allowed_hosts == ["api.example"]


# ------------------------------------------------------------------------------------ errors show no internals

def test_errors_name_the_problem_not_paths_or_exception_text(model_dir):
    """A failed step's cause reaches the client with its file's name, not its path; an unexpected exception in
    the HTTP layer reaches it as "an internal error" (the log has both); --debug shows them whole."""
    fail = {"step": False, "decode": False}

    def hook(engine) -> None:
        real_step, tok = engine.step, engine.tokenizer

        def step():
            if fail["step"]:
                fail["step"] = False
                raise OSError(5, "cannot read page 3", "/secret/dir/engram_layer1.tgt")
            return real_step()

        class Tok:
            def __getattr__(self, name):
                return getattr(tok, name)

            def decode(self, *a, **kw):
                if fail["decode"]:
                    raise RuntimeError("/secret/dir/vocab broke")
                return tok.decode(*a, **kw)

        engine.step, engine.tokenizer = step, Tok()

    for debug in (False, True):
        with running(model_dir, hook=hook, app_kw={"settings": ServerSettings(debug=debug)}, max_model_len=CTX) as base:
            fail["step"] = True
            msg = assert_openai_error(complete(base, prompt=PROMPT, max_tokens=4), 500)["message"]
            assert "cannot read page 3" in msg and "engram_layer1.tgt" in msg
            assert ("/secret/dir" in msg) is debug
            health = httpx.get(f"{base}/health").json()
            assert "engram_layer1.tgt" in health["last_fault"] and ("/secret" in health["last_fault"]) is debug
            fail["decode"] = True
            msg = assert_openai_error(complete(base, prompt=PROMPT, max_tokens=2), 500)["message"]
            evs = stream(base, "/v1/completions", prompt=PROMPT, max_tokens=2)
            fail["decode"] = False
            for text in (msg, evs[-2]["error"]["message"]):
                assert ("vocab broke" in text and "Traceback" in text) if debug else \
                    ("an internal error" in text and "secret" not in text and "RuntimeError" not in text), text


# ------------------------------------------------------------------------- the front end forgets every request

@pytest.mark.parametrize("mode", ["thread", "process"])
def test_stop_strings_and_disconnects_leave_no_state_behind(model_dir, mode):
    with running(model_dir, mode=mode, max_model_len=CTX, max_num_seqs=16) as base:
        full = complete(base, prompt=PROMPT, max_tokens=24, temperature=0, ignore_eos=True).json()
        text = full["choices"][0]["text"]
        stop = text[2:4]
        assert stop and text.find(stop) < len(text) - 4, text

        def stop_hits(n: int) -> None:
            with httpx.Client(timeout=60) as client:
                for _ in range(n):
                    r = client.post(f"{base}/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": stop})
                    assert r.json()["choices"][0]["finish_reason"] == "stop"

        def disconnects(n: int) -> None:
            with httpx.Client(timeout=60) as client:
                for _ in range(n):
                    with client.stream("POST", f"{base}/v1/completions", json={
                            "prompt": PROMPT, "max_tokens": CTX - 20, "ignore_eos": True, "stream": True}) as r:
                        next(r.iter_lines())

        threads = [threading.Thread(target=stop_hits, args=(50,)) for _ in range(4)]
        threads += [threading.Thread(target=disconnects, args=(25,)) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        wait_for(lambda: metrics(base)["tiergram_num_requests_running"] == 0, 30)
        m = metrics(base)
        assert m["tiergram_requests_tracked"] == 0 and m["tiergram_requests_in_flight"] == 0
        assert m['tiergram_request_finished_total{reason="stop"}'] >= 200
        assert m['tiergram_request_finished_total{reason="abort"}'] >= 100
        assert m["tiergram_kv_blocks_used"] == 0


# ---------------------------------------------------------------------------------- the engine loop's supervisor

def test_an_exception_outside_a_step_fails_open_requests_and_the_loop_goes_on(model_dir):
    """An exception in the engine loop outside a step (a snapshot, an abort) fails the requests open then with a
    clear error and the loop restarts: the next request is served and /health stays up."""
    fail = {"metrics": 0, "abort": 0}

    def hook(engine) -> None:
        real_metrics, real_abort = engine.metrics, engine.abort_request

        def metrics_():
            if fail["metrics"]:
                fail["metrics"] -= 1
                raise RuntimeError("injected snapshot failure")
            return real_metrics()

        def abort(rid):
            if fail["abort"]:
                fail["abort"] -= 1
                raise RuntimeError("injected abort failure")
            return real_abort(rid)

        engine.metrics, engine.abort_request = metrics_, abort

    with running(model_dir, hook=hook, max_model_len=CTX) as base:
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": CTX - 20, "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(lines)
            fail["metrics"] = 1
            rest = [line for line in lines if line]
        assert any("engine loop failed and restarted" in line and "injected snapshot failure" in line
                   for line in rest), rest[-3:]
        assert rest[-1] == "data: [DONE]"
        assert still_serves(base)
        health = httpx.get(f"{base}/health")
        assert health.status_code == 200 and health.json()["faults"] >= 1
        fail["abort"] = 1
        with httpx.stream("POST", f"{base}/v1/completions", timeout=60, json={
                "prompt": PROMPT, "max_tokens": CTX - 20, "ignore_eos": True, "stream": True}) as r:
            next(r.iter_lines())  # closing it aborts, and the abort fails
        wait_for(lambda: metrics(base)["tiergram_requests_tracked"] == 0)
        assert still_serves(base) and httpx.get(f"{base}/health").status_code == 200
        m = metrics(base)
        assert m["tiergram_kv_blocks_used"] == 0 and m["tiergram_engine_faults_total"] >= 2
