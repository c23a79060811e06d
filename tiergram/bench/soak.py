"""`tiergram bench soak`: what hostile input, overload, disconnects, slow clients, storage faults and kill -9 do to
the server (docs/serving.md, "Limits and failure behaviour"); tests/test_server_faults.py runs each phase small."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from tiergram.bench.common import log, percentile
from tiergram.bench.serve_process import ServeSubprocess, layer_tables, scrape
from tiergram.format import TableFile

PROMPT = "def insort(a, x):\n    lo = 0"


# ------------------------------------------------------------------------------------------ the server

def complete(url: str, prompt: str = PROMPT, max_tokens: int = 4, client: httpx.Client | None = None
             ) -> httpx.Response:
    """A greedy completion request of max_tokens tokens (EOS ignored), on `client` when given."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return (client or httpx).post(f"{url}/v1/completions", json=body, timeout=120)


def serves_normally(url: str, expect: list[int] | None = None) -> bool:
    """A normal greedy request gets 200 with its tokens (equal to `expect` when given)."""
    r = complete(url)
    ids = r.json()["choices"][0]["token_ids"] if r.status_code == 200 else []
    return len(ids) == 4 and (expect is None or ids == expect)


def answers_cleanly(url: str) -> bool:
    """A normal request gets 200, or (tables failing) a 500 in the OpenAI shape naming the failed page read."""
    r = complete(url)
    return r.status_code == 200 or (r.status_code == 500
                                    and "cannot read page" in r.json().get("error", {}).get("message", ""))


# ------------------------------------------------------------------------------------------------ fuzzing

def fuzz_api(url: str, *, examples: int = 25, seed: int = 0, timeout_s: float = 180.0) -> dict[str, Any]:
    """schemathesis on /openapi.json, positive and negative: {cases, statuses, failures}."""
    try:
        import schemathesis
        from hypothesis import HealthCheck, Phase, given, settings
        from hypothesis import seed as hypothesis_seed
        from schemathesis import GenerationMode
        from schemathesis import checks as sc
    except ImportError as e:
        raise RuntimeError(f"API fuzzing needs schemathesis (pip install -e '.[dev]'): {e}") from None
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    checks = [sc.not_a_server_error, sc.status_code_conformance, sc.content_type_conformance,
              sc.response_schema_conformance, sc.negative_data_rejection]
    report: dict[str, Any] = {"cases": 0, "statuses": {}, "failures": []}
    statuses: Counter = Counter()
    deadline = time.monotonic() + timeout_s

    def check(case: Any) -> None:
        response = case.call(base_url=url, timeout=60)
        report["cases"] += 1
        statuses[str(response.status_code)] += 1
        case.validate_response(response, checks=checks)

    def reported(label: str, run: Callable[[], None]) -> None:
        try:
            run()
        except BaseException as e:  # noqa: BLE001 - a failed check (schemathesis raises an exception group)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            report["failures"].append(f"{label}: {str(e).strip()[:600]}")

    for stream in (False, True):  # valid requests of every shape: each kind of answer is checked whatever the draw
        for path, body in (("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "stream": stream, "stop": "\n",
                                                "stream_options": {"include_usage": True} if stream else None}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                     "stream": stream})):
            case = schema[path]["POST"].Case(body=body, media_type="application/json")
            reported(f"{path} {body}", lambda case=case: check(case))
    for result in schema.get_all_operations():
        op = result.ok()
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if op.method.upper() == "POST" else \
            (GenerationMode.POSITIVE,)  # a GET without parameters has no negative form
        for mode in modes:
            @hypothesis_seed(seed)
            @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck))
            @given(op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                if time.monotonic() <= deadline:
                    check(case)

            reported(f"{op.label} ({mode.value})", run)
    report["statuses"] = dict(sorted(statuses.items()))
    return report


# Requests no schema-driven fuzzer would think of: broken bytes, NaN, deep nesting, huge numbers, surrogates.
def hostile_requests(max_model_len: int) -> list[tuple[str, bytes]]:
    """(path, body) pairs that must each be answered 4xx."""
    big = json.dumps({"prompt": "a" * (2 << 20)}).encode()
    bodies = [
        b"", b"{not json", b"[1, 2]", b"null", b"\"text\"", b'{"prompt": "\xff\xfe"}',
        b'{"prompt": "hi", "temperature": NaN}', b'{"prompt": "hi", "top_p": -Infinity}',
        b'{"prompt": "\\ud800"}', b"[" * 50_000 + b"]" * 50_000, big,
        *(json.dumps(body).encode() for body in [
            {"prompt": PROMPT, "max_tokens": 10**40}, {"prompt": PROMPT, "seed": 2**70},
            {"prompt": [0] * (max_model_len + 5)}, {"prompt": [2**63]}, {"prompt": PROMPT, "stop": ["x"] * 100},
            {"prompt": PROMPT, "stop": "y" * 10_000}, {"prompt": PROMPT, "n": 5}, {"prompt": PROMPT, "logprobs": 3},
            {"prompt": PROMPT, "temperature": 1e308}, {"prompt": PROMPT, "top_k": -5},
            {"prompt": PROMPT, "forced_tokens": [-1]}, {"prompt": PROMPT, "surprise": {"a": [1]}},
            {"prompt": {"nested": True}}, {"prompt": PROMPT, "stream_options": []}]),
        *(b'{"prompt": "hi", "%s": %s}' % (name, b"9" * 400) for name in (b"temperature", b"top_p",
                                                                          b"presence_penalty")),
        b'{"prompt": "hi", "model": "\\ud800"}', b'{"prompt": "hi", "\\udfff": 1}',
    ]
    messages = [[{"role": "user", "content": {"x": 1}}], [{"role": "user", "content": "hi"}] * 5000, [["user", "hi"]]]
    chats = [json.dumps({"messages": m}).encode() for m in messages]
    return ([("/v1/completions", b) for b in bodies] + [("/v1/chat/completions", b) for b in bodies[:11]]
            + [("/v1/chat/completions", b) for b in chats])


def send_hostile(url: str, max_model_len: int) -> dict[str, Any]:
    """Send every hostile request: {tried, statuses, failures (those not 4xx in the OpenAI shape)}."""
    statuses: Counter = Counter()
    failures = []
    with httpx.Client(timeout=60) as client:
        for path, body in hostile_requests(max_model_len):
            r = client.post(f"{url}{path}", content=body, headers={"content-type": "application/json"})
            statuses[str(r.status_code)] += 1
            try:
                shaped = set(r.json()["error"]) == {"message", "type", "param", "code"}
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not (400 <= r.status_code < 500 and shaped):
                failures.append(f"{path} {body[:80]!r}: {r.status_code} {r.text[:200]}")
    return {"tried": sum(statuses.values()), "statuses": dict(sorted(statuses.items())), "failures": failures}


# ------------------------------------------------------------------------------------------------ overload

# one_stream's outcomes: completed (200 and a finish_reason), rejected_429, client_errors_4xx, server_errors_5xx (a
# 5xx status or an error event in a stream), lost (no status, a broken stream, or one that ended without a finish)
OUTCOMES = ("completed", "rejected_429", "client_errors_4xx", "server_errors_5xx", "lost")


def one_stream(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, float | None, str]:
    """One streaming request: (one of OUTCOMES, TTFT or None, detail)."""
    t0 = time.perf_counter()
    ttft = None
    try:
        with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                r.read()
                if r.status_code == 429:
                    return "rejected_429", None, ""
                return ("server_errors_5xx" if r.status_code >= 500 else "client_errors_4xx"), None, \
                    f"{r.status_code} {r.text[:200]}"
            finished = done = False
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return "server_errors_5xx", ttft, event["error"]["message"][:200]
                    choice = event["choices"][0] if event.get("choices") else {}
                    if ttft is None and choice.get("token_ids"):
                        ttft = time.perf_counter() - t0
                    finished = finished or choice.get("finish_reason") is not None
            return ("completed" if finished and done else "lost"), ttft, "" if finished else "ended without a finish"
    except (httpx.HTTPError, ValueError) as e:
        return "lost", ttft, f"{type(e).__name__}: {e}"


def overload(url: str, *, clients: int, requests: int | None = None, duration_s: float | None = None,
             max_tokens: int = 8, retry_after_s: float = 0.1, progress: bool = False,
             on_progress: Any = None) -> dict[str, Any]:
    """`clients` streaming clients until `requests` sent or `duration_s` passed; 429s retried."""
    rep: dict[str, Any] = {"clients": clients, "sent": 0, **dict.fromkeys(OUTCOMES, 0), "errors": []}
    lock = threading.Lock()
    ttfts: list[float] = []
    end = time.monotonic() + duration_s if duration_s is not None else float("inf")
    bar = tqdm(total=requests, desc="soak requests", unit="req", disable=not progress)

    def take() -> bool:
        with lock:
            if time.monotonic() >= end or (requests is not None and rep["sent"] >= requests):
                return False
            rep["sent"] += 1
            return True

    def client_loop(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(timeout=120) as client:
            while take():
                body = {"prompt": PROMPT + " " * rng.randint(0, 8), "max_tokens": rng.randint(1, max_tokens),
                        "temperature": rng.choice([0, 0.7, 1e-30]), "ignore_eos": True}
                outcome, ttft, detail = one_stream(client, url, body)
                with lock:
                    rep[outcome] += 1
                    if outcome == "completed" and ttft is not None:
                        ttfts.append(ttft)
                    if detail and len(rep["errors"]) < 10:
                        rep["errors"].append(f"{outcome}: {detail}")
                bar.update(1)
                if on_progress is not None:
                    on_progress(rep)
                if outcome == "rejected_429":
                    time.sleep(retry_after_s)

    t0 = time.perf_counter()
    with scraping(url, 0.1) as samples:
        threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    bar.close()
    rep["seconds"] = time.perf_counter() - t0
    rep["max_waiting_seen"] = int(max((m.get("tiergram_num_requests_waiting", 0) for m in samples), default=0))
    rep["ttft_p50_s"], rep["ttft_p90_s"] = (percentile(ttfts, 50), percentile(ttfts, 90)) if ttfts else (0.0, 0.0)
    return rep


def scrape_until(url: str, done: Callable[[dict[str, float]], bool], timeout_s: float) -> dict[str, float]:
    """The server's /metrics once `done` holds of them, or when timeout_s has passed."""
    deadline = time.monotonic() + timeout_s
    while not done(metrics := scrape(url)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return metrics


@contextmanager
def scraping(url: str, every_s: float) -> Iterator[list[dict[str, float]]]:
    """The server's /metrics, sampled every `every_s` seconds by a thread while the block runs."""
    samples: list[dict[str, float]] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(every_s):
            try:
                samples.append(scrape(url))
            except httpx.HTTPError:
                pass

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield samples
    finally:
        stop.set()
        thread.join()


def disconnect_storm(url: str, *, clients: int, events_before_drop: int = 2, timeout_s: float = 60.0
                     ) -> dict[str, Any]:
    """Clients that drop long streams: K/V blocks used at start, at the peak, and after."""
    start = scrape(url)["tiergram_kv_blocks_used"]
    long = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["max_model_len"] // 2  # runs for a while
    peak = [start]
    statuses: Counter = Counter()
    barrier = threading.Barrier(clients + 1)
    go = threading.Event()

    def drop() -> None:
        with httpx.Client(timeout=120) as client, client.stream(
                "POST", f"{url}/v1/completions",
                json={"prompt": PROMPT, "max_tokens": long, "ignore_eos": True, "stream": True}) as r:
            statuses[str(r.status_code)] += 1
            lines = r.iter_lines()  # kept: a generator dropped at `break` would close the stream early
            seen = 0
            for line in lines:
                seen += line.startswith("data: {")
                if seen >= events_before_drop:
                    break
            try:
                barrier.wait(timeout_s)  # every stream is open and running
            except threading.BrokenBarrierError:
                pass
            go.wait(timeout_s)  # then, once the peak is read, all drop at once

    threads = [threading.Thread(target=drop, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        barrier.wait(timeout_s)
        time.sleep(0.1)  # the server's metrics snapshot is at most 20 ms old
        peak.append(scrape(url)["tiergram_kv_blocks_used"])
    except threading.BrokenBarrierError:
        pass
    go.set()
    for t in threads:
        t.join(timeout_s)
    after = scrape_until(url, lambda m: m["tiergram_kv_blocks_used"] == start, timeout_s)
    return {"clients": clients, "statuses": dict(statuses), "kv_blocks_used_start": start,
            "kv_blocks_used_peak": max(peak), "kv_blocks_used_after": after["tiergram_kv_blocks_used"],
            "aborted": after.get('tiergram_request_finished_total{reason="abort"}', 0.0)}


# ------------------------------------------------------------------------------------------ slow clients

SLOW_KINDS = ("lying_length", "half_header", "trickled_body", "idle")
_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
_SENT = {"lying_length": _HEAD + b'Content-Length: 1000\r\n\r\n{"prompt": ',
         "half_header": b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n",
         "trickled_body": _HEAD + b"Content-Length: 100000\r\n\r\n", "idle": b""}
TRICKLE_EVERY_S = 0.5  # a trickled body's byte interval


async def _slow_client(kind: str, port: int, stop: asyncio.Event, seen: dict[str, Any]) -> None:
    """One slow client of `kind`, connecting again each time the server closes it, until stop."""
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            seen["connect_failed"] += 1
            await asyncio.sleep(0.1)
            continue
        seen["opened"] += 1
        try:
            writer.write(_SENT[kind])
            while True:
                try:
                    got = await asyncio.wait_for(reader.read(4096), TRICKLE_EVERY_S)
                    break
                except asyncio.TimeoutError:
                    if kind == "trickled_body":
                        writer.write(b" ")
            status = got.split(b" ", 2)[1].decode() if got.startswith(b"HTTP/1.1 ") else "closed"
        except OSError:
            status = "reset"
        finally:
            writer.close()
        seen["statuses"][status] += 1
        seen["held_max_s"] = max(seen["held_max_s"], time.monotonic() - t0)


def _normal_requests(url: str, seconds: float) -> dict[str, Any]:
    """Greedy 8-token requests one after the other for `seconds`: how many, their latency p50/p90, failures."""
    latencies, failures = [], 0
    end = time.monotonic() + seconds
    with httpx.Client(timeout=60) as client:
        while time.monotonic() < end:
            t0 = time.perf_counter()
            try:
                ok = complete(url, max_tokens=8, client=client).status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                latencies.append(time.perf_counter() - t0)
            failures += not ok
    return {"requests": len(latencies) + failures, "failures": failures,
            "p50_ms": percentile(latencies, 50) * 1e3, "p90_ms": percentile(latencies, 90) * 1e3}


def slow_clients(url: str, *, clients: int, seconds: float, baseline_s: float = 20.0) -> dict[str, Any]:
    """Normal requests alone, then beside `clients` slow clients: what each side saw."""
    port = int(url.rsplit(":", 1)[1])
    baseline = _normal_requests(url, baseline_s)
    start = scrape(url)
    seen = {k: {"opened": 0, "connect_failed": 0, "statuses": Counter(), "held_max_s": 0.0} for k in SLOW_KINDS}
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def crowd() -> None:
        kinds = [SLOW_KINDS[i % len(SLOW_KINDS)] for i in range(clients)]
        tasks = [asyncio.ensure_future(_slow_client(k, port, stop, seen[k])) for k in kinds]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    crowd_thread = threading.Thread(target=loop.run_until_complete, args=(crowd(),), daemon=True)
    crowd_thread.start()
    with scraping(url, 0.5) as samples:
        time.sleep(1.0)  # every slow client has connected
        loaded = _normal_requests(url, seconds)
    loop.call_soon_threadsafe(stop.set)
    crowd_thread.join(60)
    loop.close()
    after = scrape_until(url, lambda m: m["tiergram_http_connections"] <= start["tiergram_http_connections"], 30)

    def figures(name: str, scale: float = 1.0) -> dict[str, float]:
        peak = max([s[name] for s in samples] or [start[name]])
        return {"start": start[name] / scale, "peak": peak / scale, "after": after[name] / scale}

    return {"clients": clients, "seconds": seconds,
            "kinds": {k: {**v, "statuses": dict(v["statuses"])} for k, v in seen.items()},
            "connections": figures("tiergram_http_connections"), "open_fds": figures("process_open_fds"),
            "rss_mib": figures("process_resident_memory_bytes", 2**20),
            "normal_alone": baseline, "normal_beside_slow": loaded}


# ------------------------------------------------------------------------------------------ storage faults

def greedy_tokens(url: str, prompts: list[str], max_tokens: int) -> list[tuple[int, list[int] | str]]:
    """Each prompt once, greedy: (status, token ids) or (status, error message)."""
    out = []
    with httpx.Client(timeout=120) as client:
        for p in prompts:
            r = complete(url, p, max_tokens, client)
            body = r.json()
            out.append((r.status_code, body["choices"][0]["token_ids"] if r.status_code == 200 else
                        body["error"]["message"]))
    return out


def fault_prompts(n: int, seed: int = 0) -> list[str]:
    """Distinct short code-like prompts (different n-grams, so different table rows)."""
    rng = random.Random(seed)
    words = ["def", "return", "lo", "hi", "mid", "while", "if", "else", "x", "a", "len", "for", "in", "range",
             "import", "self", "print", "list", "None", "True"]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) for _ in range(n)]


def compare_to_reference(got: list[tuple[int, Any]], want: list[tuple[int, Any]]) -> dict[str, int]:
    """Outcomes against the fault-free run: ok, failed_cleanly, wrong and other (both must be 0)."""
    counts = Counter()
    for (status, value), (_, ref) in zip(got, want, strict=True):
        if status == 200:
            counts["ok" if value == ref else "wrong"] += 1
        elif status == 500 and ("PageReadError" in value or "cannot read page" in value):
            counts["failed_cleanly"] += 1
        else:
            counts["other"] += 1
    return {k: counts.get(k, 0) for k in ("ok", "failed_cleanly", "wrong", "other")}


def corrupt_page(path: Path, page: int) -> None:
    """Flip one byte in the middle of a data page of a table file (its checksum no longer matches)."""
    t = TableFile.open(path)
    at = t.data_offset + page * t.manifest.page_size + t.manifest.page_size // 3
    with open(path, "r+b") as f:
        os.pwrite(f.fileno(), bytes([os.pread(f.fileno(), 1, at)[0] ^ 0x5A]), at)


def page_read_by(model_dir: Path, prompt: str, codec: str = "fp8_e4m3") -> tuple[Path, int]:
    """(table file, page) of a row `prompt` reads (first Engram layer, head 0) in an exported model."""
    import numpy as np

    from tiergram.model.checkpoint import hasher_of, load_tokenizer_of, read_config
    from tiergram.model.export import table_filename

    tok = load_tokenizer_of(model_dir)
    rows = hasher_of(read_config(model_dir), tok).row_ids(np.asarray([tok.encode(prompt).ids], dtype=np.int64))
    layer = min(rows)
    path = model_dir / table_filename(layer, codec)
    t = TableFile.open(path)
    return path, int(t.head_offsets[0] + rows[layer][0, -1, 0]) // t.manifest.rows_per_page


def copy_export(model_dir: Path, out: Path) -> Path:
    """An exported copy of a model (its tables can then be damaged without touching the original)."""
    shutil.copytree(layer_tables(str(model_dir))[0].parent, out, ignore=shutil.ignore_patterns("*.lock"))
    return out


# ------------------------------------------------------------------------------------------------ the soak

@dataclass
class SoakConfig:
    """Sizes of the soak's phases."""

    model_dir: str
    requests: int = 10_000  # the overload soak's requests (RSS growth is measured over them)
    max_num_seqs: int = 8  # the engine's capacity is max_num_seqs running + max_waiting queued
    max_waiting: int = 8
    max_model_len: int = 128
    fuzz_examples: int = 50  # per operation and mode
    disconnect_clients: int = 32
    fault_prompts: int = 40
    slow_clients: int = 500  # clients holding connections beside normal requests (0: the phase is skipped)
    slow_seconds: float = 45.0  # beyond the 30-s body deadline, so every kind meets its deadline
    slow_only: bool = False  # only the slow-client phase
    torch_threads: int = 1  # every server's
    seed: int = 0


def _server(cfg: SoakConfig, model: str | Path, placement: str, **engine: Any) -> ServeSubprocess:
    return ServeSubprocess(model, config={"engine": {"placement": placement, "torch_threads": cfg.torch_threads,
                                                     **engine}})


def run(cfg: SoakConfig, progress: bool = True) -> dict[str, Any]:
    """Every phase, against `tiergram serve` subprocesses on loopback: {phase: its figures}."""
    res: dict[str, Any] = {"config": asdict(cfg)}
    if cfg.slow_clients:
        log(progress, f"slow clients: {cfg.slow_clients} beside normal requests for {cfg.slow_seconds:g} s")
        with _server(cfg, cfg.model_dir, "file") as server:
            res["slow"] = slow_clients(server.url, clients=cfg.slow_clients, seconds=cfg.slow_seconds)
            res["slow"]["served_after"] = serves_normally(server.url)
    if cfg.slow_only:
        return res
    # a short context bounds every request the fuzzer may send (max_tokens up to the context)
    with _server(cfg, cfg.model_dir, "host", max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len,
                 max_waiting=cfg.max_waiting) as server:
        url = server.url
        reference = greedy_tokens(url, [PROMPT], 4)[0][1]
        log(progress, f"fuzzing {url}/openapi.json ({cfg.fuzz_examples} cases per operation and mode), hostile input")
        res["fuzz"] = fuzz_api(url, examples=cfg.fuzz_examples, seed=cfg.seed)
        res["hostile"] = {**send_hostile(url, cfg.max_model_len), "served_after": serves_normally(url, reference)}
        clients = 2 * (cfg.max_num_seqs + cfg.max_waiting)
        log(progress, f"overload: {clients} streaming clients (2x capacity), {cfg.requests} requests")
        rss = {"start": scrape(url)["process_resident_memory_bytes"]}
        warm = max(1, cfg.requests // 10)

        def note_rss(rep: dict[str, Any]) -> None:
            if "after_warmup" not in rss and rep["sent"] >= warm:
                rss["after_warmup"] = -1.0  # claimed; scraped below by this thread
                rss["after_warmup"] = scrape(url)["process_resident_memory_bytes"]

        res["load"] = overload(url, clients=clients, requests=cfg.requests, progress=progress, on_progress=note_rss)
        rss["end"] = scrape(url)["process_resident_memory_bytes"]
        res["rss"] = {**rss, "growth_after_warmup": rss["end"] - rss.get("after_warmup", rss["start"]),
                      "requests_after_warmup": cfg.requests - warm}
        log(progress, f"disconnect storm: {cfg.disconnect_clients} clients drop mid-stream")
        res["disconnects"] = disconnect_storm(url, clients=cfg.disconnect_clients)
        res["served_after_all"] = serves_normally(url, reference)
        res["load"]["server_5xx_total"] = sum(v for k, v in scrape(url).items()
                                              if k.startswith("tiergram_requests_total") and 'status="5' in k)
    log(progress, "storage faults: injected read faults (1% of pages, all pages), then a page corrupted on disk")
    res["faults"] = storage_faults(cfg.model_dir, fault_prompts(cfg.fault_prompts, cfg.seed), progress=progress)
    log(progress, "kill -9 under load, restart on the same tables")
    res["crash"] = crash_restart(cfg)
    return res


@contextmanager
def _file_server(model_dir: str | Path) -> Iterator[tuple[str, Any]]:
    """An in-process server of the file placement, no cache (every row from disk): (url, its engine)."""
    from tiergram.engine import EngineConfig, LLMEngine, Placement
    from tiergram.server import create_app, serve_in_thread

    engine = LLMEngine(EngineConfig(str(model_dir), Placement("file"), max_num_seqs=8))
    try:
        with serve_in_thread(create_app(engine)) as url:
            yield url, engine
    finally:
        engine.close()


def storage_faults(model_dir: str | Path, prompts: list[str], *, rates: tuple[float, ...] = (0.01, 1.0),
                   progress: bool = False) -> dict[str, Any]:
    """File servers on a model copy: injected page faults at each rate, then a page corrupted on disk."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tiergram-soak-") as tmp:
        model = copy_export(Path(model_dir), Path(tmp) / "model")
        with _file_server(model) as (url, engine):
            want = greedy_tokens(url, prompts, 4)
            rng = random.Random(0)
            for rate in rates:
                injected = 0
                for src in engine.sources.values():
                    n = src.manifest.n_pages
                    for page in rng.sample(range(n), max(1, round(rate * n))):
                        src.tier.reader.inject_fault(*(("flip", page, 2) if rate < 1 else ("eio", page, 1 << 30)))
                        injected += 1
                got = greedy_tokens(url, prompts, 4)
                for src in engine.sources.values():
                    src.tier.reader.clear_faults()
                health = httpx.get(f"{url}/health").json()
                out[f"injected_{rate:g}"] = {**compare_to_reference(got, want), "requests": len(prompts),
                                             "faulty_pages": injected, "served_after": answers_cleanly(url),
                                             "engine_faults": health["faults"], "health": health["status"],
                                             "served_once_cleared": serves_normally(url)}
                log(progress, f"  {rate:.0%} of pages failing: {out[f'injected_{rate:g}']}")
        corrupt_page(*page_read_by(model, prompts[0]))
        with _file_server(model) as (url, _):
            got = greedy_tokens(url, prompts, 4)
            health = httpx.get(f"{url}/health").json()
            out["corrupt_page_on_disk"] = {**compare_to_reference(got, want), "requests": len(prompts),
                                           "served_after": answers_cleanly(url), "health_after": health["status"],
                                           "engine_faults": health["faults"]}
    return out


def crash_restart(cfg: SoakConfig, *, load_s: float = 3.0) -> dict[str, Any]:
    """kill -9 of a server under load (host placement, shared /dev/shm copies off), restart on the same tables."""
    from tiergram.tiers.host import shared_copies

    model = Path(cfg.model_dir)
    with _server(cfg, model, "host") as server:
        reference = greedy_tokens(server.url, [PROMPT], 4)[0][1]
        t = threading.Thread(target=overload, args=(server.url,), kwargs={"clients": 8, "duration_s": load_s},
                             daemon=True)
        t.start()
        time.sleep(load_s / 2)
        server.kill9()
        t.join(60)
    with _server(cfg, model, "host") as server:
        served = serves_normally(server.url, reference)
    tables = sorted(layer_tables(str(model))[0].parent.glob("engram_layer*"))  # every codec's
    bad = {str(p.name): TableFile.open(p).verify() for p in tables if p.suffix in (".tgt", ".tgram")}
    stale = [str(p) for p in shared_copies() if ".tmp-" in p.name]
    return {"served_after_restart": served, "tables_verified": len(bad),
            "tables_with_bad_pages": sorted(k for k, v in bad.items() if v), "stale_shm_files": stale}


def slow_checks(slow: dict[str, Any], header_s: float = 10.0, body_s: float = 30.0, slack_s: float = 5.0
                ) -> dict[str, bool]:
    """The pass/fail lines of the slow-client phase (deadlines: the server's, by default serve's)."""
    kinds = slow["kinds"]
    held = {k: body_s if k in ("lying_length", "trickled_body") else header_s for k in kinds}
    return {
        "slow clients: each answered 408 or closed within its deadline": all(
            v["held_max_s"] <= held[k] + slack_s and set(v["statuses"]) <= {"408", "closed"} for k, v in kinds.items()),
        "slow clients: every normal request served meanwhile": slow["normal_beside_slow"]["failures"] == 0
        and slow["normal_beside_slow"]["requests"] > 0,
        "slow clients: connections back to start after": slow["connections"]["after"] <= slow["connections"]["start"],
        "slow clients: served a normal request after": bool(slow.get("served_after")),
    }


def checks(res: dict[str, Any]) -> dict[str, bool]:
    """The pass/fail lines of the soak."""
    slow = slow_checks(res["slow"]) if "slow" in res else {}
    if res["config"]["slow_only"]:
        return slow
    fuzz, load, faults, crash = res["fuzz"], res["load"], res["faults"], res["crash"]
    return {
        **slow,
        "fuzz: no check failed, no 5xx": not fuzz["failures"] and not any(s.startswith("5") for s in fuzz["statuses"]),
        "hostile: every one 4xx": not res["hostile"]["failures"],
        "served a normal request after fuzzing and hostile input": res["hostile"]["served_after"],
        "overload: no request lost": load["lost"] == 0,
        "overload: no 5xx": load["server_errors_5xx"] == 0 and load["server_5xx_total"] == 0,
        "overload: queue bounded": load["max_waiting_seen"] <= res["config"]["max_waiting"],
        "disconnects: K/V blocks back to start": res["disconnects"]["kv_blocks_used_after"]
        == res["disconnects"]["kv_blocks_used_start"],
        "faults: nothing wrong served": all(v["wrong"] == 0 and v["other"] == 0 for v in faults.values()),
        "faults: server serves after each": all(v["served_after"] for v in faults.values()),
        "crash: serves after restart, tables verify, no stale shm": crash["served_after_restart"]
        and not crash["tables_with_bad_pages"] and not crash["stale_shm_files"],
        "served a normal request at the end": res["served_after_all"],
    }


def slow_text(slow: dict[str, Any]) -> list[str]:
    """The slow-client phase's figures as lines."""
    alone, beside, c, fds, rss = (slow["normal_alone"], slow["normal_beside_slow"], slow["connections"],
                                  slow["open_fds"], slow["rss_mib"])
    lines = [f"slow clients: {slow['clients']} for {slow['seconds']:g} s; server connections {c['start']:.0f} at "
             f"start, {c['peak']:.0f} at the peak, {c['after']:.0f} after; open fds {fds['start']:.0f} / "
             f"{fds['peak']:.0f} / {fds['after']:.0f}; RSS {rss['start']:.1f} / {rss['peak']:.1f} / {rss['after']:.1f} "
             f"MiB"]
    for kind, v in slow["kinds"].items():
        lines.append(f"  {kind}: {v['opened']} connections, answers {v['statuses']}, longest held "
                     f"{v['held_max_s']:.1f} s")
    lines.append(f"  normal requests alone: {alone['requests']} (failed {alone['failures']}), latency p50 "
                 f"{alone['p50_ms']:.1f} ms, p90 {alone['p90_ms']:.1f} ms; beside the slow clients: "
                 f"{beside['requests']} (failed {beside['failures']}), p50 {beside['p50_ms']:.1f} ms, p90 "
                 f"{beside['p90_ms']:.1f} ms")
    return lines


def to_text(res: dict[str, Any]) -> str:
    """The soak's figures as a report."""
    lines = slow_text(res["slow"]) if "slow" in res else []
    if not res["config"]["slow_only"]:
        ld, rss, fz, hs = res["load"], res["rss"], res["fuzz"], res["hostile"]
        lines += [
            f"fuzzing (schemathesis, /openapi.json): {fz['cases']} cases, statuses {fz['statuses']}, "
            f"{len(fz['failures'])} failed checks",
            f"hostile requests: {hs['tried']} tried, statuses {hs['statuses']}, {len(hs['failures'])} not answered 4xx",
            f"overload: {ld['clients']} streaming clients for {ld['sent']} requests in {ld['seconds']:.1f} s: "
            f"{ld['completed']} completed, {ld['rejected_429']} answered 429, {ld['client_errors_4xx']} 4xx, "
            f"{ld['server_errors_5xx']} 5xx, {ld['lost']} lost; max waiting seen {ld['max_waiting_seen']} (max_waiting "
            f"{res['config']['max_waiting']}); TTFT of admitted p50 {ld['ttft_p50_s'] * 1e3:.1f} ms, p90 "
            f"{ld['ttft_p90_s'] * 1e3:.1f} ms",
            f"RSS: {rss['start'] / 2**20:.1f} MiB at start, {rss.get('after_warmup', 0) / 2**20:.1f} MiB after "
            f"warm-up, {rss['end'] / 2**20:.1f} MiB at the end: growth {rss['growth_after_warmup'] / 2**20:+.2f} MiB "
            f"over {rss['requests_after_warmup']} requests",
            f"disconnect storm: {res['disconnects']}",
            *(f"storage faults, {name}: {v}" for name, v in res["faults"].items()),
            f"kill -9 and restart: {res['crash']}"]
    return "\n".join([*lines, "", *(f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in checks(res).items())])


def to_json(res: dict[str, Any]) -> str:
    """The soak's figures and checks as one JSON object."""
    return json.dumps({**res, "checks": checks(res)}, indent=2, default=str)
