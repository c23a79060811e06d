"""`tiergram bench serve`: throughput against interactivity of the real server, per table placement.

The InferenceX method: for each placement a real `tiergram serve` process is started on a free loopback port,
and a closed loop of `c` streaming HTTP clients (httpx, async) runs at c = 1, 2, 4, ... up to the engine's
limit (max_num_seqs, or the sequences the K/V budget holds). Each point runs 2c warm-up requests, then 3
rounds of 4c measured ones; in each round the placements take turns (in rotating order) on the same requests,
and a point's throughput is its median round, so a drift of this machine's speed (other jobs, a throttled
disk) cannot favour the placement measured first. Input and output lengths are drawn uniformly from [0.8 L,
L]; prompts and outputs are replayed from held-out real text (the corpus's test split, or the Python stdlib's
source), the output forced token by token from the trace, so every placement serves the same tokens.

Per point: TTFT, inter-token latency (ITL) and end-to-end latency p50/p90/p99 as the client sees them,
interactivity (tokens/s per user = 1000 / ITL ms; `interactivity_p90` = 1000 / ITL p90), total throughput
(prompt + output tokens per second of the measured phase), and from /metrics deltas the Engram cache hit
rate, the exposed prefetch stall and the file tier's page reads per second, which the checks set against the
disk's own limit (the native reader at queue depth 128) measured before and after the sweep. Per placement
the pareto front keeps the points no other point beats on both throughput and interactivity.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.bench.common import FILE_TARGET, HOST_TARGET, cache_dir, save_figure

PLACEMENTS = ("device", "host", "file", "mooncake")
DEFAULT_PLACEMENTS = ("device", "host", "file")  # mooncake needs a master or a private network namespace


@dataclass
class SweepConfig:
    """What to sweep and how the load is shaped."""

    model_dir: str
    placements: tuple[str, ...] = DEFAULT_PLACEMENTS
    input_len: int = 128
    output_len: int = 32
    max_concurrency: int = 64
    requests_per_user: int = 4  # measured requests per point and round = this x concurrency
    warmup_per_user: int = 2  # warm-up requests per point = this x concurrency (before the first round)
    rounds: int = 3  # interleaved rounds per point: each placement in turn serves the same requests
    device_memory: int | None = None  # device memory budget of the engine (bytes)
    cache_fraction: float = 0.10  # file placement: host cache per layer, as a fraction of that layer's table
    cache_policy: str = "lru"  # the engine announces one step ahead: lookahead adds cost, not hits
    read_ahead: bool = True  # file placement: prompt rows read into the cache before their step
    torch_threads: int = 0  # each server's torch CPU threads (0: torch's default)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    block_size: int = 16
    source: str = "auto"  # auto (corpus test split if built, else stdlib), corpus, stdlib
    corpus: str | None = None
    seed: int = 0
    startup_timeout_s: float = 300.0
    plot: str | None = None
    markdown: str | None = None
    # file placement at several cache sizes, each its own server labelled file-<pct>% (None: cache_fraction alone)
    cache_fractions: tuple[float, ...] | None = None
    # a second model (the same backbone and tokenizer, larger tables) served by the file placement as "file-big", with
    # a per-layer cache of big_cache_bytes (None: the same bytes as the first file placement's): tables larger than
    # the host's memory, at a fixed host-memory budget
    big_model_dir: str | None = None
    big_cache_bytes: int | None = None
    host_memory: int | None = None  # every server's --host-memory (bytes)
    # mooncake placement: the mooncake_master's HOST:PORT (None: a local cluster started for the sweep, which needs
    # a private network namespace: docs/remote.md); its cache is the file placement's first fraction
    mooncake_master: str | None = None

    def __post_init__(self) -> None:
        bad = [p for p in self.placements if p not in PLACEMENTS]
        if bad or not self.placements:
            raise ValueError(f"unknown placements {bad} (valid: {', '.join(PLACEMENTS)})")
        if min(self.input_len, self.output_len, self.max_concurrency, self.requests_per_user, self.rounds) < 1:
            raise ValueError("input_len, output_len, max_concurrency, requests_per_user and rounds must be >= 1")
        if self.warmup_per_user < 0 or self.torch_threads < 0:
            raise ValueError(f"warmup_per_user and torch_threads must be >= 0, got {self.warmup_per_user}, "
                             f"{self.torch_threads}")
        if not 0 < self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in (0, 1], got {self.cache_fraction}")
        if self.cache_fractions is not None:
            self.cache_fractions = tuple(float(f) for f in self.cache_fractions)
            if not self.cache_fractions or any(not 0 < f <= 1 for f in self.cache_fractions):
                raise ValueError(f"cache_fractions must each be in (0, 1], got {self.cache_fractions}")

    @property
    def fractions(self) -> tuple[float, ...]:
        """The file placement's cache fractions."""
        return self.cache_fractions or (self.cache_fraction,)

    def labels(self) -> list[str]:
        """Every server of the sweep: the placements, the file one once per cache fraction, then file-big."""
        out = []
        for p in self.placements:
            if p == "file" and len(self.fractions) > 1:
                out += [file_label(f) for f in self.fractions]
            else:
                out.append(p)
        if self.big_model_dir:
            out.append("file-big")
        return out


def file_label(fraction: float) -> str:
    """file-10% for a cache of 10% of the table."""
    return f"file-{100 * fraction:g}%"


def kind_of(label: str) -> str:
    """The placement kind a server label runs (file-10% and file-big are file)."""
    return "file" if label.startswith("file") else label


@dataclass
class Point:
    """One placement at one concurrency."""

    placement: str
    concurrency: int
    requests: int
    duration_s: float
    throughput_tok_s: float
    output_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p90_ms: float
    itl_p99_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    e2e_p99_ms: float
    interactivity_p50: float
    interactivity_p90: float
    engram_cache_hit_rate: float | None
    exposed_stall_s: float
    engram_bytes_read: dict[str, float] = field(default_factory=dict)
    throughput_rounds: list[float] = field(default_factory=list)  # tok/s of each round; the point keeps the median
    file_pages_per_s: float = 0.0  # pages the file tier read per second of the measured rounds
    cpu_ms_per_token: float = 0.0  # the server process's CPU time (all threads) per token served
    server_peak_rss_bytes: int = 0  # the server process's peak resident memory (VmHWM) at the end of this point


@dataclass
class SweepResult:
    """Every point, the fronts, the per-placement server facts and the acceptance checks."""

    config: SweepConfig
    source: str
    points: list[Point]
    fronts: dict[str, list[int]]  # placement -> concurrencies on its pareto front
    servers: dict[str, dict[str, Any]]
    checks: dict[str, Any]
    seconds: float
    disk_pages_per_s: dict[str, float] = field(default_factory=dict)  # the disk's limit before/after the sweep
    plot: str | None = None


# ------------------------------------------------------------------------------------------------ the trace

def _stdlib_texts() -> Iterator[str]:
    """The Python standard library's source files (tests and site-packages left out), in sorted order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if not {"test", "tests", "site-packages"} & set(path.relative_to(root).parts):
            yield path.read_text(encoding="utf-8", errors="replace")


def trace_tokens(tokenizer: Any, need: int, source: str = "auto", corpus: str | None = None
                 ) -> tuple[np.ndarray, str]:
    """At least `need` tokens of held-out text (documents joined by <|endoftext|>), and where they came from."""
    from tiergram.corpus import EOT, corpus_dir, load_split

    folder = Path(corpus) if corpus else corpus_dir()
    use_corpus = source == "corpus" or (source == "auto" and (folder / "test.jsonl").is_file())
    if source not in ("auto", "corpus", "stdlib"):
        raise ValueError(f"unknown trace source {source!r} (valid: auto, corpus, stdlib)")
    texts = (doc.text for doc in load_split(folder, "test")) if use_corpus else _stdlib_texts()
    what = f"corpus test split ({folder})" if use_corpus else "Python stdlib source"
    eot = tokenizer.token_to_id(EOT)
    parts: list[np.ndarray] = []
    have = 0
    for text in texts:
        ids = tokenizer.encode(text).ids + ([eot] if eot is not None else [])
        parts.append(np.asarray(ids, dtype=np.int64))
        have += len(ids)
        if have >= need:
            break
    if not have:
        raise ValueError(f"no text in the {what}")
    return np.concatenate(parts), what


@dataclass
class TraceRequest:
    """A prompt and the output the server is made to produce."""

    prompt: list[int]
    output: list[int]


class Trace:
    """Requests cut from a token stream: lengths uniform in [0.8 L, L], consecutive windows of the text."""

    def __init__(self, tokens: np.ndarray, input_len: int, output_len: int, seed: int) -> None:
        self.tokens, self.input_len, self.output_len = tokens, input_len, output_len
        self.rng = np.random.default_rng(seed)
        self.cursor = 0

    def take(self, n: int) -> list[TraceRequest]:
        """The next n requests."""
        out = []
        for _ in range(n):
            li = int(self.rng.integers(max(1, int(0.8 * self.input_len)), self.input_len + 1))
            lo = int(self.rng.integers(max(1, int(0.8 * self.output_len)), self.output_len + 1))
            if self.cursor + li + lo > len(self.tokens):
                self.cursor = 0
            w = self.tokens[self.cursor:self.cursor + li + lo].tolist()
            self.cursor += li + lo
            out.append(TraceRequest(w[:li], w[li:]))
        return out


# --------------------------------------------------------------------------------------------- the server

class ServerProcess:
    """`tiergram serve` in a subprocess on a free loopback port; stopped with SIGTERM (drained)."""

    def __init__(self, cfg: SweepConfig, placement: str, cache_bytes: int, max_waiting: int,
                 model_dir: str | None = None) -> None:
        cmd = [sys.executable, "-m", "tiergram", "serve", model_dir or cfg.model_dir, "--placement", placement,
               "--host", "127.0.0.1", "--port", "0", "--log-level", "warning",
               "--max-num-seqs", str(cfg.max_num_seqs), "--max-num-batched-tokens", str(cfg.max_num_batched_tokens),
               "--block-size", str(cfg.block_size), "--max-waiting", str(max_waiting),
               "--cache-policy", cfg.cache_policy, "--cache-bytes", str(cache_bytes)]
        if not cfg.read_ahead:
            cmd.append("--no-read-ahead")
        if cfg.torch_threads:
            cmd += ["--torch-threads", str(cfg.torch_threads)]
        if cfg.device_memory is not None:
            cmd += ["--device-memory", str(cfg.device_memory)]
        if cfg.host_memory is not None:
            cmd += ["--host-memory", str(cfg.host_memory)]
        if placement == "mooncake":
            cmd += ["--mooncake-master", cfg.mooncake_master or ""]
        self.cmd, self.timeout = cmd, cfg.startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def __enter__(self) -> ServerProcess:
        self.log = tempfile.TemporaryFile(mode="w+")  # stderr: a file, so a chatty server never blocks on a pipe
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            line = self.proc.stdout.readline()  # "tiergram serve: NAME on http://127.0.0.1:PORT" once bound
            if " on http://" not in line:
                self.proc.wait(10)
                self.log.seek(0)
                raise RuntimeError(f"the server did not start ({' '.join(self.cmd)}):\n{line}{self.log.read()}")
            self.url = line.strip().rsplit(" on ", 1)[1]
            _wait_healthy(self.url, self.timeout, self.proc)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def peak_rss(pid: int) -> int:
    """A live process's peak resident memory (VmHWM), bytes; 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except OSError:
        return 0


def _wait_healthy(url: str, timeout: float, proc: subprocess.Popen) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"the server at {url} did not become healthy in {timeout:.0f} s (exit status {proc.poll()})")


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics samples."""
    import httpx

    from tiergram.server.metrics import parse

    return parse(httpx.get(f"{url}/metrics", timeout=30).text)


# ---------------------------------------------------------------------------------------------- the client

@dataclass
class Timing:
    """What one streamed request looked like from the client."""

    ttft_s: float
    gaps_s: list[float]  # one per output token after the first
    e2e_s: float
    prompt_tokens: int
    output_tokens: int


async def one_request(client: Any, url: str, model: str, req: TraceRequest) -> Timing:
    """Send one streaming completion (the output forced from the trace) and time its tokens."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": len(req.output), "forced_tokens": req.output,
            "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first, last, gaps, got = None, 0.0, [], 0
    usage: dict[str, int] = {}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                raise RuntimeError(f"server error mid-stream: {obj['error']}")
            usage = obj.get("usage") or usage
            n = sum(len(c.get("token_ids") or []) for c in obj.get("choices", []))
            if not n:
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                gaps += [0.0] * (n - 1)  # several tokens in the first chunk: no gap to measure between them
            else:
                gaps += [(now - last) / n] * n
            last, got = now, got + n
    end = time.perf_counter()
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    return Timing(first - t0, gaps, end - t0, usage.get("prompt_tokens", len(req.prompt)),
                  usage.get("completion_tokens", got))


async def closed_loop(url: str, model: str, requests: list[TraceRequest], concurrency: int) -> tuple[list[Timing],
                                                                                                     float]:
    """c users each sending their next request as soon as the previous one ends; (timings, wall seconds)."""
    import httpx

    pending = list(reversed(requests))
    timings: list[Timing] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(600.0)) as client:
        async def user() -> None:
            while pending:
                timings.append(await one_request(client, url, model, pending.pop()))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return timings, time.perf_counter() - t0


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


@dataclass
class Round:
    """One placement's share of one round: its requests' timings, the wall time, /metrics around it."""

    timings: list[Timing]
    wall_s: float
    before: dict[str, float]
    after: dict[str, float]

    @property
    def tokens(self) -> int:
        return sum(t.output_tokens + t.prompt_tokens for t in self.timings)


def summarize(placement: str, concurrency: int, rounds: list[Round], page_size: int = 4096) -> Point:
    """A point from its rounds: throughput is the median round's; latencies pool every request; counters sum."""
    timings = [t for r in rounds for t in r.timings]
    wall_s = sum(r.wall_s for r in rounds)
    ttft = [t.ttft_s * 1e3 for t in timings]
    itl = [g * 1e3 for t in timings for g in t.gaps_s]
    e2e = [t.e2e_s * 1e3 for t in timings]
    per_round = [r.tokens / r.wall_s for r in rounds]
    out_share = sum(t.output_tokens for t in timings) / max(1, sum(r.tokens for r in rounds))

    def total(key: str) -> float:
        return sum(_delta(r.after, r.before, key) for r in rounds)

    lookups = total("tiergram_engram_cache_probes_total")
    hit = total("tiergram_engram_cache_hits_total") / lookups if lookups > 0 else None  # None: no cache
    keys = {k for r in rounds for k in r.after if k.startswith("tiergram_engram_bytes_read_total{")}
    tiers = {k.split('tier="')[1].rstrip('"}'): total(k) for k in sorted(keys)}
    itl50, itl90 = _pct(itl, 50), _pct(itl, 90)
    throughput = float(np.median(per_round))
    return Point(placement=placement, concurrency=concurrency, requests=len(timings), duration_s=wall_s,
                 throughput_tok_s=throughput, output_tok_s=throughput * out_share,
                 ttft_p50_ms=_pct(ttft, 50), ttft_p90_ms=_pct(ttft, 90), ttft_p99_ms=_pct(ttft, 99),
                 itl_p50_ms=itl50, itl_p90_ms=itl90, itl_p99_ms=_pct(itl, 99),
                 e2e_p50_ms=_pct(e2e, 50), e2e_p90_ms=_pct(e2e, 90), e2e_p99_ms=_pct(e2e, 99),
                 interactivity_p50=1000 / itl50 if itl50 > 0 else float("nan"),
                 interactivity_p90=1000 / itl90 if itl90 > 0 else float("nan"),
                 engram_cache_hit_rate=hit, exposed_stall_s=total("tiergram_engram_exposed_stall_seconds_total"),
                 engram_bytes_read=tiers, throughput_rounds=[round(x, 1) for x in per_round],
                 file_pages_per_s=tiers.get("file", 0.0) / page_size / wall_s if wall_s > 0 else 0.0,
                 cpu_ms_per_token=1e3 * total("process_cpu_seconds_total") / max(1, sum(r.tokens for r in rounds)))


# ----------------------------------------------------------------------------------------------- the sweep

def levels(limit: int, max_concurrency: int) -> list[int]:
    """1, 2, 4, ... up to min(limit, max_concurrency), ending at that cap."""
    cap = max(1, min(limit, max_concurrency))
    out = [1]
    while out[-1] * 2 <= cap:
        out.append(out[-1] * 2)
    return out if out[-1] == cap else [*out, cap]


def layer_tables(model_dir: str, codec: str = "fp8_e4m3") -> list[Path]:
    """Each Engram layer's table file (exported first, as the engine would, when missing)."""
    from tiergram.engine.tables import export_dir_for
    from tiergram.model.checkpoint import read_config
    from tiergram.model.export import table_path

    engram = read_config(model_dir)["model"].get("engram")
    if not engram:
        raise ValueError(f"{model_dir} has no Engram layers: there is no table to place")
    src = export_dir_for(Path(model_dir), sorted(engram["layers"]), {codec})
    return [table_path(src, layer, codec) for layer in sorted(engram["layers"])]


def layer_table_bytes(model_dir: str, codec: str = "fp8_e4m3") -> list[int]:
    """Bytes of each Engram layer's table file."""
    return [path.stat().st_size for path in layer_tables(model_dir, codec)]


def disk_limit(path: Path, seconds: float = 1.0) -> float:
    """Random 4 KiB-page reads per second the disk gives the native reader at queue depth 128 (O_DIRECT)."""
    from tiergram.bench.file_lookup import LimitReader
    from tiergram.format import TableFile

    reader = LimitReader(TableFile.open(path), 128)
    try:
        return reader.segment(seconds).figures()["pages_per_s"]
    finally:
        reader.close()


def pareto(points: list[Point]) -> list[Point]:
    """The points no other point beats on both throughput and interactivity (sorted by concurrency)."""
    def beaten(p: Point) -> bool:
        return any(q.throughput_tok_s >= p.throughput_tok_s and q.interactivity_p90 >= p.interactivity_p90
                   and (q.throughput_tok_s > p.throughput_tok_s or q.interactivity_p90 > p.interactivity_p90)
                   for q in points)
    return sorted((p for p in points if not beaten(p)), key=lambda p: p.concurrency)


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def run(cfg: SweepConfig, progress: bool = True) -> SweepResult:
    """Sweep every placement; the result holds the points, fronts and checks (plot/markdown written if asked).

    Every placement's server runs from the start; at each concurrency the placements take turns, round by round
    (the order rotating), on the same requests, so that a drift of the machine's speed hits them all alike.
    """
    import httpx

    from tiergram.model.checkpoint import load_tokenizer_of

    t_start = time.perf_counter()
    tables = layer_tables(cfg.model_dir)  # (exports when needed)
    labels = cfg.labels()
    # the cache is per layer (one Placement serves every layer): a fraction of the smallest layer's table
    smallest = min(path.stat().st_size for path in tables)
    caches = {label: 0 for label in labels}
    for fraction in cfg.fractions:
        caches[file_label(fraction) if len(cfg.fractions) > 1 else "file"] = int(fraction * smallest)
    if "mooncake" in caches:  # the same host cache as the file placement
        caches["mooncake"] = int(cfg.fractions[0] * smallest)
    if cfg.big_model_dir:
        first_file = next((caches[lb] for lb in labels if lb != "file-big" and kind_of(lb) == "file"),
                          int(cfg.fractions[0] * smallest))
        caches["file-big"] = cfg.big_cache_bytes if cfg.big_cache_bytes is not None else first_file
    tokenizer = load_tokenizer_of(cfg.model_dir)
    if tokenizer is None:
        raise ValueError(f"{cfg.model_dir} has no tokenizer.json to tokenize the trace with")
    max_levels = levels(cfg.max_num_seqs, cfg.max_concurrency)
    per_user = cfg.requests_per_user * cfg.rounds + cfg.warmup_per_user
    need = sum(per_user * c for c in max_levels) * (cfg.input_len + cfg.output_len)
    tokens, source = trace_tokens(tokenizer, need, cfg.source, cfg.corpus)
    _log(progress, f"trace: {len(tokens)} tokens of the {source}")
    disk: dict[str, float] = {}
    disk_table = layer_tables(cfg.big_model_dir)[0] if cfg.big_model_dir else tables[0]
    if any(kind_of(lb) == "file" for lb in labels):
        disk["before"] = disk_limit(disk_table)
        _log(progress, f"disk limit (native reader, QD128, O_DIRECT): {disk['before']:.0f} pages/s")
    points: list[Point] = []
    servers: dict[str, dict[str, Any]] = {}
    live: dict[str, tuple[str, str, list[int]]] = {}  # label -> (url, model name, its concurrency levels)
    procs: dict[str, int] = {}  # label -> server pid
    with ExitStack() as stack:
        if "mooncake" in labels and not cfg.mooncake_master:
            from dataclasses import replace

            from tiergram.bench.remote import LocalCluster

            logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tiergram-serve-mooncake-")))
            segment = 2 * sum(path.stat().st_size for path in tables) + (64 << 20)  # pages + per-object room
            cluster = stack.enter_context(LocalCluster(logs, segment_bytes=segment))
            _log(progress, f"[mooncake] local cluster: master {cluster.master_addr}, one holder of {segment} bytes")
            cfg = replace(cfg, mooncake_master=cluster.master_addr)
        for placement in labels:
            cb = caches[placement]
            _log(progress, f"[{placement}] starting the server" + (f" (host cache {cb} bytes)" if cb else ""))
            waiting = max(256, 2 * cfg.max_concurrency)
            server = stack.enter_context(ServerProcess(
                cfg, kind_of(placement), cb, max_waiting=waiting,
                model_dir=cfg.big_model_dir if placement == "file-big" else None))
            procs[placement] = server.proc.pid
            health = httpx.get(f"{server.url}/health", timeout=30).json()
            blocks_per_seq = -(-(cfg.input_len + cfg.output_len) // cfg.block_size)
            limit = min(cfg.max_num_seqs, int(health["kv_blocks_total"]) // blocks_per_seq)
            servers[placement] = {"kv_blocks_total": health["kv_blocks_total"], "concurrency_limit": limit,
                                  "cache_bytes": cb, "model": health["model"],
                                  "model_dir": cfg.big_model_dir if placement == "file-big" else cfg.model_dir,
                                  "table_bytes": sum(layer_table_bytes(cfg.big_model_dir if placement == "file-big"
                                                                       else cfg.model_dir)),
                                  "peak_rss_bytes_at_start": peak_rss(server.proc.pid)}
            if limit < 1:
                _log(progress, f"[{placement}] the K/V budget holds no {cfg.input_len + cfg.output_len}-token "
                               "sequence; skipped")
                continue
            live[placement] = (server.url, health["model"], levels(limit, cfg.max_concurrency))
        trace = Trace(tokens, cfg.input_len, cfg.output_len, cfg.seed)
        for c in sorted({c for _, _, lv in live.values() for c in lv}):
            members = [pl for pl, (_, _, lv) in live.items() if c in lv]
            warm = trace.take(cfg.warmup_per_user * c)
            rounds: dict[str, list[Round]] = {pl: [] for pl in members}
            for pl in members:
                asyncio.run(closed_loop(live[pl][0], live[pl][1], warm, c))
            for r in range(cfg.rounds):
                requests = trace.take(cfg.requests_per_user * c)  # every placement serves the same ones
                for pl in members[r % len(members):] + members[:r % len(members)]:
                    url, model, _ = live[pl]
                    before = scrape(url)
                    timings, wall = asyncio.run(closed_loop(url, model, requests, c))
                    rounds[pl].append(Round(timings, wall, before, scrape(url)))
            for pl in members:
                p = summarize(pl, c, rounds[pl])
                p.server_peak_rss_bytes = peak_rss(procs[pl])
                points.append(p)
                hit = "" if p.engram_cache_hit_rate is None else f", hit {100 * p.engram_cache_hit_rate:.1f}%"
                reads = f", {p.file_pages_per_s:.0f} pages/s" if kind_of(pl) == "file" else ""
                reads += f", CPU {p.cpu_ms_per_token:.2f} ms/token, peak RSS {p.server_peak_rss_bytes / 2**30:.2f} GiB"
                _log(progress, f"[{pl}] c={c:<3} {p.throughput_tok_s:8.1f} tok/s  TTFT p90 "
                               f"{p.ttft_p90_ms:7.1f} ms  ITL p90 {p.itl_p90_ms:6.1f} ms  "
                               f"{p.interactivity_p90:6.1f} tok/s/user  stall {p.exposed_stall_s:.3f} s{hit}{reads}")
        for pl, pid in procs.items():
            servers[pl]["peak_rss_bytes"] = peak_rss(pid)
    if disk:
        disk["after"] = disk_limit(disk_table)
        _log(progress, f"disk limit after the sweep: {disk['after']:.0f} pages/s")
    points.sort(key=lambda p: (labels.index(p.placement), p.concurrency))
    fronts = {pl: [p.concurrency for p in pareto([q for q in points if q.placement == pl])] for pl in labels}
    res = SweepResult(cfg, source, points, fronts, servers, {}, 0.0, disk_pages_per_s=disk)
    res.checks = checks(res)
    res.seconds = round(time.perf_counter() - t_start, 1)
    res.plot = str(plot(res, Path(cfg.plot) if cfg.plot else cache_dir("bench") / "serve-sweep.png"))
    if cfg.markdown:
        Path(cfg.markdown).write_text(to_markdown(res))
    return res


# ------------------------------------------------------------------------------------------------- checks

def _by_c(res: SweepResult, placement: str) -> dict[int, Point]:
    return {p.concurrency: p for p in res.points if p.placement == placement}


def _ratios(res: SweepResult, num: str, den: str, field: str = "throughput_tok_s") -> dict[int, float]:
    """A point field of one placement over another's, at each concurrency both ran (and den's is non-zero)."""
    a, b = _by_c(res, num), _by_c(res, den)
    return {c: getattr(a[c], field) / getattr(b[c], field) for c in sorted(set(a) & set(b)) if getattr(b[c], field)}


def checks(res: SweepResult) -> dict[str, Any]:
    """The acceptance checks, as measured ratios (no check is run without both of its placements)."""
    out: dict[str, Any] = {}
    limits = {p: s["concurrency_limit"] for p, s in res.servers.items()}
    if "device" in limits and "host" in limits:
        r = _ratios(res, "host", "device")
        out["host_vs_device"] = {"ratios": r, "target": HOST_TARGET,
                                 "passed": bool(r) and min(r.values()) >= HOST_TARGET,
                                 "memory_binds": limits["device"] < limits["host"]}
        offloaded = [p.throughput_tok_s for p in res.points if p.placement == "host"]
        resident = [p.throughput_tok_s for p in res.points if p.placement == "device"]
        if offloaded and resident:
            out["budget"] = {"binds": limits["device"] < limits["host"], "device_limit": limits["device"],
                             "host_limit": limits["host"], "host_max_tok_s": max(offloaded),
                             "device_max_tok_s": max(resident), "ratio": max(offloaded) / max(resident)}
    for label in (lb for lb in limits if kind_of(lb) == "file" and "host" in limits):
        r = _ratios(res, label, "host")
        target = FILE_TARGET if label != "file-big" else BIG_TARGET
        out[_check_key(label)] = {
            "ratios": r, "target": target, "passed": bool(r) and min(r.values()) >= target,
            "cache_fraction": _fraction(res, label),
            "cache_bytes": res.servers[label]["cache_bytes"],
            "table_bytes": res.servers[label].get("table_bytes"),
            "file_pages_per_s": {c: p.file_pages_per_s for c, p in _by_c(res, label).items()},
            "cpu_per_token_vs_host": _ratios(res, label, "host", "cpu_ms_per_token"),
            "disk_pages_per_s": res.disk_pages_per_s}
    return out


BIG_TARGET = 0.80  # file on a table larger than RAM against host on the smaller tables


def _check_key(label: str) -> str:
    """file_vs_host for the file placement (its historical key), file-10%_vs_host etc. for the others."""
    return f"{label}_vs_host"


def _fraction(res: SweepResult, label: str) -> float:
    """The cache of a file server as a fraction of its tables (file-big: its cache bytes over its tables)."""
    if label == "file":
        return res.config.cache_fraction
    if label != "file-big":
        return float(label.removeprefix("file-").removesuffix("%")) / 100
    s = res.servers[label]
    layers = len(layer_table_bytes(s["model_dir"]))
    return s["cache_bytes"] * layers / s["table_bytes"] if s.get("table_bytes") else float("nan")


def checks_text(res: SweepResult) -> str:
    """The acceptance checks in words, with the measured ratios."""
    ck, lines = res.checks, ["acceptance checks (ratios of throughput measured in this run):"]

    def rs(r: dict[int, float]) -> str:
        return ", ".join(f"c={c} {v:.3f}" for c, v in r.items()) or "no common concurrency"

    if "host_vs_device" in ck:
        h = ck["host_vs_device"]
        note = " (the device budget binds: compared where both ran)" if h["memory_binds"] else ""
        lines.append(f"  host >= {h['target']:.0%} of resident (device) at every concurrency{note}: "
                     f"{'PASS' if h['passed'] else 'FAIL'} [{rs(h['ratios'])}]")
    if "budget" in ck:
        b = ck["budget"]
        if b["binds"]:
            lines.append(f"  binding device budget: resident reaches c={b['device_limit']}, host c={b['host_limit']}; "
                         f"front max throughput host {b['host_max_tok_s']:.1f} vs resident {b['device_max_tok_s']:.1f}"
                         f" tok/s = {b['ratio']:.3f}x ({100 * (b['ratio'] - 1):+.1f}%)")
        else:
            lines.append(f"  device budget does not bind (both reach c={b['device_limit']}); max throughput host/"
                         f"resident = {b['ratio']:.3f}; pass --device-memory to make it bind")
    for key, f in ck.items():
        if not key.endswith("_vs_host") or key == "host_vs_device":
            continue
        label = key.removesuffix("_vs_host")
        size = f" on {f['table_bytes'] / 2**30:.1f} GiB tables" if f.get("table_bytes") else ""
        lines.append(f"  {label}{size} (host cache {f['cache_fraction']:.1%} of the tables, {f['cache_bytes']} B per "
                     f"layer) >= {f['target']:.0%} of host at every concurrency: {'PASS' if f['passed'] else 'FAIL'} "
                     f"[{rs(f['ratios'])}]")
        reads = ", ".join(f"c={c} {v:.0f}" for c, v in f["file_pages_per_s"].items())
        disk = " and ".join(f"{v:.0f} {k}" for k, v in f["disk_pages_per_s"].items())
        lines.append(f"    file tier reads, pages/s: {reads}; the disk's limit (QD128), pages/s: {disk} the sweep")
        lines.append(f"    server CPU per token, {label} / host: {rs(f['cpu_per_token_vs_host'])}")
    peaks = ", ".join(f"{pl} {s_['peak_rss_bytes'] / 2**30:.2f} GiB" for pl, s_ in res.servers.items()
                      if s_.get("peak_rss_bytes"))
    if peaks:
        lines.append(f"  servers' peak RSS: {peaks}")
    if len(lines) == 1:
        lines.append("  none (they need device+host or host+file placements)")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- output

def plot(res: SweepResult, path: Path) -> Path:
    """Throughput against interactivity: every point faint, each placement's front as a line, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4), dpi=110)
    for placement in res.config.labels():
        pts = sorted((p for p in res.points if p.placement == placement), key=lambda p: p.concurrency)
        if not pts:
            continue
        front = [p for p in pts if p.concurrency in res.fronts.get(placement, [])]
        line, = ax.plot([p.interactivity_p90 for p in front], [p.throughput_tok_s for p in front], marker="o",
                        label=f"{placement} (front)")
        ax.scatter([p.interactivity_p90 for p in pts], [p.throughput_tok_s for p in pts], color=line.get_color(),
                   alpha=0.35, s=18)
        for p in front:
            ax.annotate(str(p.concurrency), (p.interactivity_p90, p.throughput_tok_s), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))
    ax.set_xlabel("interactivity (tokens/s per user, at ITL p90)")
    ax.set_ylabel("throughput (tokens/s, prompt + output)")
    ax.set_title(f"{Path(res.config.model_dir).name}: input {res.config.input_len}, output {res.config.output_len}"
                 " (labels: concurrency)", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return save_figure(fig, path)


def to_markdown(res: SweepResult) -> str:
    """A markdown table of every point (front points marked)."""
    head = ("| placement | concurrency | throughput tok/s | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | "
            "E2E p90 ms | tok/s/user p90 | cache hit | file pages/s | stall s | CPU ms/token | peak RSS GiB | front |")
    lines = [head, "|---" * (head.count("|") - 1) + "|"]
    for p in res.points:
        hit = "-" if p.engram_cache_hit_rate is None else f"{100 * p.engram_cache_hit_rate:.1f}%"
        front = "yes" if p.concurrency in res.fronts.get(p.placement, []) else ""
        lines.append(f"| {p.placement} | {p.concurrency} | {p.throughput_tok_s:.1f} | {p.ttft_p50_ms:.1f} / "
                     f"{p.ttft_p90_ms:.1f} / {p.ttft_p99_ms:.1f} | {p.itl_p50_ms:.1f} / {p.itl_p90_ms:.1f} / "
                     f"{p.itl_p99_ms:.1f} | {p.e2e_p90_ms:.0f} | {p.interactivity_p90:.1f} | {hit} | "
                     f"{p.file_pages_per_s:.0f} | {p.exposed_stall_s:.3f} | {p.cpu_ms_per_token:.2f} | "
                     f"{p.server_peak_rss_bytes / 2**30:.2f} | {front} |")
    return "\n".join(lines) + "\n"


def to_json(res: SweepResult) -> str:
    """One JSON object: points, fronts, checks, servers, config."""
    obj = {"points": [asdict(p) for p in res.points], "fronts": res.fronts, "checks": res.checks,
           "disk_pages_per_s": res.disk_pages_per_s,
           "servers": res.servers, "source": res.source, "seconds": res.seconds, "plot": res.plot,
           "config": asdict(res.config)}
    return json.dumps(obj, indent=2, default=str)


def to_text(res: SweepResult) -> str:
    """The table, the checks and where the plot is."""
    return "\n".join([f"trace: {res.source}", to_markdown(res).rstrip(), checks_text(res), f"plot: {res.plot}"])
