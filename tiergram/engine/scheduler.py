"""Continuous batching: each step fills a token budget with decodes first, then prefill chunks, preempting
the most recently arrived unscheduled sequence (freeing its KV blocks, to be recomputed) when blocks run out."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tiergram.engine.block_manager import BlockManager
from tiergram.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    """One step's work: sequences and how many of their pending tokens to compute, in batch order."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new: list[int] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)


class Scheduler:
    """FCFS waiting queue + running list over a BlockManager, under a per-step token budget."""

    def __init__(self, blocks: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in arrival order
        self.num_preemptions = 0
        self.last: list[tuple[str, int, bool]] = []  # the last step: (request_id, tokens, was a prefill chunk)

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def schedule(self, ready: Callable[[Sequence], bool] | None = None) -> ScheduledBatch:
        """Pick this step's sequences and token counts, allocating their blocks; `ready(seq)` False holds the queue."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        queue = [s for s in self.running if s.num_pending == 1] + [s for s in self.running if s.num_pending > 1]
        i = 0
        while i < len(queue) and budget > 0:
            seq = queue[i]
            n = min(seq.num_pending, budget)
            while not self.blocks.ensure(seq, seq.num_computed + n):
                victim = max(queue[i:], key=lambda s: s.arrival)  # youngest not yet scheduled, maybe seq itself
                queue.remove(victim)
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, n)
                budget -= n
                i += 1
        while self.waiting and budget > 0 and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if ready is not None and not ready(seq):
                break
            n = self.blocks.admit(seq, budget)  # reuses its cached prefix, if any
            if not n:
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        self.running.sort(key=lambda s: s.arrival)
        self.last = [(s.request_id, n, s.num_pending > 1 or n > 1)
                     for s, n in zip(batch.seqs, batch.num_new, strict=True)]
        return batch

    def prefill_ahead(self, inflight: dict[str, int]) -> list[tuple[list[int], int, int]]:
        """Prompt windows [(token ids, start, end)] the step after `inflight` will likely prefill (each once)."""
        starts = [(seq, seq.num_computed + inflight.get(seq.request_id, 0)) for seq in self.running]
        budget = self.max_num_batched_tokens - sum(1 for seq, start in starts if start >= seq.prompt_len)
        out = []
        for seq, start in [*starts, *((seq, seq.num_computed) for seq in self.waiting)]:
            if budget <= 0:
                break
            if start >= seq.prompt_len:
                continue
            end = min(seq.prompt_len, start + budget)
            budget -= end - start
            if max(start, seq.warmed_to) < end:
                out.append((seq.token_ids, max(start, seq.warmed_to), end))
                seq.warmed_to = end
        return out

    def _preempt(self, seq: Sequence) -> None:
        """Free its blocks and state; it goes to the front of the waiting queue (earliest arrival first)."""
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.reset()
        seq.status = Status.WAITING
        i = next((k for k, s in enumerate(self.waiting) if s.arrival >= seq.arrival), len(self.waiting))
        self.waiting.insert(i, seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark seq finished, drop it from whichever queue holds it, free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            self.waiting.remove(seq)
        self.blocks.free(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason
