"""A request as the engine tracks it: its tokens, how many are in the KV cache, its blocks and lookbacks."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from tiergram.engine.config import SamplingParams


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished
    prompt_tokens: int
    output_tokens: int
    error: str | None = None  # finish_reason "error": what failed (the request's own sampling, or its step)
    cached_tokens: int = 0  # prompt tokens found in the prefix cache (OpenAI's prompt_tokens_details)


@dataclass
class Sequence:
    """One request. token_ids = prompt + outputs; the first num_computed of them have K/V in the cache."""

    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    arrival: int  # admission order: lower runs first and is preempted last
    max_tokens: int  # params.max_tokens clamped to the model length
    generator: torch.Generator | None = None  # sampling RNG (temperature > 0)
    status: Status = Status.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)  # KV block ids, position p in block p // block_size
    block_names: list[bytes] = field(default_factory=list)  # prefix-cache names of its computed full blocks
    num_cached_tokens: int | None = None  # prompt tokens its first admission found in the prefix cache
    finish_reason: str | None = None
    warmed_to: int = 0  # prompt tokens before this have had their Engram rows read ahead into the caches
    # read-aheads of its first prompt chunk still to finish (tickets): it waits while any is pending
    rows_pending: list[Any] = field(default_factory=list)
    rows_since: float = 0.0  # perf_counter() when rows_pending was set

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache: the rest of the prompt (prefill) or the last sampled token (decode)."""
        return self.num_tokens - self.num_computed

    def history(self, k: int) -> list[int]:
        """The hashing lookback: up to k token ids just before the next uncomputed one."""
        return self.token_ids[max(0, self.num_computed - k):self.num_computed]

    def reset(self) -> None:
        """Forget everything computed (preemption): the tokens are recomputed when the sequence resumes."""
        self.num_computed = 0
        self.block_table = []
        self.warmed_to = 0
        self.rows_pending = []

    def output(self, new: list[int], error: str | None = None) -> RequestOutput:
        """This step's RequestOutput with the new tokens (and the error that ended it, if one did)."""
        return RequestOutput(self.request_id, new, self.status is Status.FINISHED, self.finish_reason,
                             self.prompt_len, self.num_tokens - self.prompt_len, error, self.num_cached_tokens or 0)
