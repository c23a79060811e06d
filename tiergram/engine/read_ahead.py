"""The engine's reads ahead of the step, as one component (docs/engine.md, "Read-ahead of prompt rows")."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from tiergram.engine.degrade import Degrader
from tiergram.engine.metrics import EngineMetrics
from tiergram.engine.model_runner import ModelRunner
from tiergram.engine.sequence import Sequence

# a prompt whose rows are still being read after this long joins the batch anyway (its step reads what is missing)
PROMPT_ROWS_MAX_WAIT_S = 2.0
AHEAD_KEPT = 64  # arriving prompts' read-aheads not yet claimed by their add_request, newest kept


class ReadAhead:
    """Reads Engram rows into the caches before the step that needs them: prompt chunks, a joining prompt's first
    chunk, the next decode rows (docs/engine.md, "Read-ahead of prompt rows" and after)."""

    def __init__(self, runner: ModelRunner, degrader: Degrader, chunk_tokens: int, stats: EngineMetrics) -> None:
        self.runner, self.degrader, self.stats = runner, degrader, stats
        self.chunk_tokens = chunk_tokens  # a prompt's first chunk: the tokens one step takes at most
        self.enabled = runner.can_warm
        self._lock = threading.Lock()
        self._arrived: dict[tuple[int, ...], list[Any]] = {}  # arriving prompts' tickets by first-chunk tokens

    def active(self) -> bool:
        """Reading ahead now: on, and the degrade policy at level 0 (under stall pressure no speculative reads)."""
        return self.enabled and self.degrader.level == 0

    def arriving(self, prompt: list[int]) -> None:
        """A valid prompt about to be added while a step runs: start reading its first chunk (claimed by `hold`)."""
        chunk = prompt[:self.chunk_tokens]
        tickets = self.runner.warm([(chunk, 0, len(chunk))])
        with self._lock:
            self._arrived[tuple(chunk)] = tickets
            while len(self._arrived) > AHEAD_KEPT:
                del self._arrived[next(iter(self._arrived))]

    def hold(self, seq: Sequence) -> None:
        """A prompt joining while others run: its first chunk's rows are read before it joins (`ready`)."""
        chunk = seq.token_ids[:min(seq.prompt_len, self.chunk_tokens)]
        with self._lock:
            tickets = self._arrived.pop(tuple(chunk), None)
        if tickets is None:
            tickets = self.runner.warm([(chunk, 0, len(chunk))])
        seq.rows_pending, seq.rows_since, seq.warmed_to = tickets, time.perf_counter(), len(chunk)

    def ready(self, seq: Sequence) -> bool:
        """(Under the engine's lock) whether a waiting sequence's rows are in, or it has waited long enough."""
        if not seq.rows_pending:
            return True
        waited = time.perf_counter() - seq.rows_since
        done = all(t.done() for t in seq.rows_pending)
        if done or waited > PROMPT_ROWS_MAX_WAIT_S:
            seq.rows_pending = []
            self.stats.prompt_rows_waits += 1
            self.stats.prompt_rows_wait_s += waited
            self.stats.prompt_rows_timeouts += not done
        return not seq.rows_pending

    def decodes(self, seqs: list[Sequence], sampled: list[Any], max_model_len: int) -> None:
        """Read the next decode rows of the sequences this step's tokens do not end by length."""
        go = [(s, t) for s, t in zip(seqs, sampled, strict=True) if not isinstance(t, Exception)
              and s.num_tokens + 1 - s.prompt_len < s.max_tokens and s.num_tokens + 1 < max_model_len]
        if go:
            self.runner.warm_next([s for s, _ in go], [int(t) for _, t in go])


def await_rows(tickets: list[Any], since: float) -> None:
    """Wait for read-ahead tickets until PROMPT_ROWS_MAX_WAIT_S after `since`; their errors only end the wait."""
    for ticket in tickets:
        left = since + PROMPT_ROWS_MAX_WAIT_S - time.perf_counter()
        if left <= 0:
            return
        with contextlib.suppress(Exception):  # timeout, cancelled or failed read-ahead: the step reads the rows
            ticket.wait(left)
