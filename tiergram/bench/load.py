"""`bench serve`'s load: held-out text cut into requests or conversations, replayed by streaming HTTP clients."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.bench.common import stdlib_files

# ------------------------------------------------------------------------------------------------ the trace

def trace_tokens(tokenizer: Any, need: int, source: str = "auto", corpus: str | None = None
                 ) -> tuple[np.ndarray, str]:
    """At least `need` tokens of held-out text, documents joined by <|endoftext|>, and their source."""
    from tiergram.corpus import EOT, corpus_dir, ensure_corpus, load_split

    if source not in ("auto", "corpus", "stdlib"):
        raise ValueError(f"unknown trace source {source!r} (valid: auto, corpus, stdlib)")
    folder = ensure_corpus(corpus, tokenizer=False) if source == "corpus" else Path(corpus) if corpus else corpus_dir()
    use_corpus = source == "corpus" or (source == "auto" and (folder / "test.jsonl").is_file())
    texts = ((doc.text for doc in load_split(folder, "test")) if use_corpus else  # stdlib: tests left out
             (path.read_text(encoding="utf-8", errors="replace")
              for path in stdlib_files(exclude=("test", "tests", "site-packages"))))
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


class Conversations:
    """Sessions of `turns` questions over `docs` shared documents; each prompt is all before it."""

    def __init__(self, tokens: np.ndarray, input_len: int, output_len: int, seed: int, turns: int = 4,
                 docs: int = 8) -> None:
        if turns < 1 or docs < 1:
            raise ValueError(f"conversations need turns >= 1 and docs >= 1, got {turns}, {docs}")
        self.trace = Trace(tokens, input_len, output_len, seed)
        self.turns, self.question_len = turns, max(1, input_len // 8)
        self.docs = [self.trace.tokens[i * input_len:(i + 1) * input_len].tolist() for i in range(docs)]
        self.trace.cursor = docs * input_len % max(1, len(tokens))
        weights = 1 / np.arange(1, docs + 1)
        self.weights = weights / weights.sum()

    @property
    def max_len(self) -> int:
        """Tokens of the last turn: prompt and output."""
        return len(self.docs[0]) + self.turns * (self.question_len + self.trace.output_len)

    def take(self, n: int) -> list[list[TraceRequest]]:
        """Sessions holding about n requests in all (each session's turns in order)."""
        out = []
        for _ in range(-(-n // self.turns)):
            history = list(self.docs[int(self.trace.rng.choice(len(self.docs), p=self.weights))])
            session = []
            for _ in range(self.turns):
                q, a = self.question_len, self.trace.output_len
                if self.trace.cursor + q + a > len(self.trace.tokens):
                    self.trace.cursor = 0
                w = self.trace.tokens[self.trace.cursor:self.trace.cursor + q + a].tolist()
                self.trace.cursor += q + a
                history += w[:q]
                session.append(TraceRequest(list(history), w[q:]))
                history += w[q:]
            out.append(session)
        return out


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


async def closed_loop(url: str, model: str, requests: list[TraceRequest] | list[list[TraceRequest]],
                      concurrency: int, think_s: float = 0.0, seed: int = 0) -> tuple[list[Timing], float]:
    """c users, each sending its next request (session turn) when the last ends: (timings, wall s)."""
    import httpx

    pending = [r if isinstance(r, list) else [r] for r in reversed(requests)]
    rng = np.random.default_rng(seed)
    timings: list[Timing] = []
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    transport = httpx.AsyncHTTPTransport(limits=limits, socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(600.0)) as client:
        async def user() -> None:
            while pending:
                for turn, req in enumerate(pending.pop()):
                    if turn and think_s > 0:
                        await asyncio.sleep(float(rng.exponential(think_s)))
                    timings.append(await one_request(client, url, model, req))

        t0 = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(concurrency)))
        return timings, time.perf_counter() - t0
