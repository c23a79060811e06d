"""The prefix cache as the planner sees it: how many of a conversation's prompt tokens come back from cached K/V
(no I/O; the model is docs/planner.md's "Prefix reuse")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Conversations:
    """Sessions of `turns` question + answer turns over `docs` shared documents (i opened with weight 1/(i+1))."""

    doc_len: int
    question_len: int
    answer_len: int
    turns: int = 4
    docs: int = 8
    think_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.doc_len, self.question_len, self.answer_len, self.turns, self.docs) < 1:
            raise ValueError(f"conversations need positive lengths, turns and docs, got {self}")
        if self.think_s < 0:
            raise ValueError(f"think_s must be >= 0, got {self.think_s}")

    @property
    def weights(self) -> np.ndarray:
        """Each document's chance to open a session, float64 [docs]."""
        w = 1.0 / np.arange(1, self.docs + 1)
        return w / w.sum()

    def prompt_len(self, turn: int) -> int:
        """Prompt tokens of turn 1..turns: the document, every question so far and the answers before."""
        return self.doc_len + turn * self.question_len + (turn - 1) * self.answer_len

    def queried(self) -> int:
        """Prompt tokens of one session that could hit (all but each prompt's last: it is always computed)."""
        return sum(self.prompt_len(k) - 1 for k in range(1, self.turns + 1))

    def doc_hit_tokens(self, block: int) -> int:
        """Tokens turn 1 reuses when its document is cached: its full blocks (the prompt's last token excepted)."""
        return min(self.doc_len // block, (self.prompt_len(1) - 1) // block) * block

    def history_hit_tokens(self, turn: int, block: int) -> int:
        """Tokens turn > 1 reuses when its session's blocks are cached: the full blocks the turn before computed."""
        computed = self.prompt_len(turn - 1) + self.answer_len - 1
        return min(computed // block, (self.prompt_len(turn) - 1) // block) * block

    def blocks_held(self, turn: int, block: int) -> int:
        """Blocks a running request of this turn holds at its end."""
        return math.ceil((self.prompt_len(turn) + self.answer_len) / block)


@dataclass
class Reuse:
    """Predicted prefix reuse of a conversations workload at one concurrency."""

    hit_rate: float  # hit tokens / queried tokens (the engine's tiergram_prefix_cache_hit_rate)
    host_hit_rate: float  # of it, the share of queried tokens copied back from the host tier
    cached_len: float  # mean prompt tokens per request served from the cache
    host_len: float  # of them, the tokens copied back from the host tier
    doc_hit: float  # chance a session's document is cached at its start
    history_hit: float  # chance a session's history is cached at its next turn
    evictable_blocks: float  # E: device blocks no running request holds, plus the host tier's slots


def reuse(conv: Conversations, block: int, device_blocks: int, host_blocks: int, concurrency: int,
          running: float, cycle_s: float, sessions_before: float = math.inf) -> Reuse:
    """The prefix cache's reuse with `running` of `concurrency` users running, after `sessions_before` sessions."""
    if block < 1 or device_blocks < 0 or host_blocks < 0:
        raise ValueError(f"block {block}, device_blocks {device_blocks}, host_blocks {host_blocks}: need block >= 1 "
                         "and no negative pool")
    p = conv.weights
    doc_tokens = conv.doc_hit_tokens(block)
    # running requests hold their own blocks; the live sessions' distinct documents are held once
    own = sum(conv.blocks_held(k, block) for k in range(1, conv.turns + 1)) / conv.turns - doc_tokens / block
    held = running * own + float(np.sum(1.0 - (1.0 - p) ** concurrency)) * doc_tokens / block
    free_dev = max(0.0, device_blocks - held)
    turns = range(2, conv.turns + 1)
    hist_tokens = sum(conv.history_hit_tokens(k, block) for k in turns)
    out = {}
    for pool in (free_dev, free_dev + host_blocks):  # device alone, then with the host tier behind it
        doc = hist = 1.0
        for _ in range(20):  # allocations depend on the misses, the misses on the allocations: a fixed point
            computed = sum(conv.prompt_len(k) + conv.answer_len for k in range(1, conv.turns + 1))
            computed -= doc * doc_tokens + hist * hist_tokens
            per_session = computed / block
            # the others' requests (c - 1 of them, one per cycle each) allocate during one think time
            during_think = (concurrency - 1) * conv.think_s / cycle_s * per_session / conv.turns if cycle_s else 0.0
            hist = 1.0 if during_think <= 0 else 1.0 - math.exp(-pool / during_think)
            # a document stays for pool / per_session sessions, or while another user's live session holds it
            window = max(pool / per_session if per_session > 0 else math.inf, (concurrency - 1) * hist)
            window = min(window, sessions_before)
            doc = float(np.sum(p * (1.0 - (1.0 - p) ** window))) if window > 0 else 0.0
        # a turn's history includes its document's blocks, which its own earlier turns kept as recent as the rest
        out[pool] = (doc, hist, doc * doc_tokens + hist * hist_tokens)
    doc, hist, hits = out[free_dev + host_blocks]
    host_hits = max(0.0, hits - out[free_dev][2])
    q = conv.queried()
    return Reuse(hits / q, host_hits / q, hits / conv.turns, host_hits / conv.turns, doc, hist, free_dev + host_blocks)
