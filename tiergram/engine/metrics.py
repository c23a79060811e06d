"""Engine counters: queues, KV usage, preemptions, Engram reads, stall, step time and the degrade level."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class EngineMetrics:
    """A snapshot of the engine (LLMEngine.metrics())."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_usage: float = 0.0  # used / total
    num_preemptions: int = 0
    steps: int = 0  # steps that ran the model
    # cache_hit_rate (file caches; None without), bytes_read {tier: n}, pages_read, per_layer
    engram: dict[str, Any] = field(default_factory=dict)
    exposed_stall_s: float = 0.0  # total time the forward waited on Engram rows (ticket.wait())
    # the part of exposed_stall_s in steps that computed prompt tokens (prefill chunks), and how many such steps
    prefill_stall_s: float = 0.0
    prefill_steps: int = 0
    # prompt_rows_first: prompts that waited for their read-ahead rows before joining the batch, the seconds they
    # waited (from arrival to the rows in or the wait given up), and how many joined with rows still being read
    # (waited PROMPT_ROWS_MAX_WAIT_S: their step reads what is missing, a prefill stall)
    prompt_rows_waits: int = 0
    prompt_rows_wait_s: float = 0.0
    prompt_rows_timeouts: int = 0
    last_step_stall_s: float = 0.0
    step_time_s: float = 0.0  # total wall time inside step() that ran the model
    last_step_time_s: float = 0.0
    # total_bytes, weights_bytes, device_table_bytes, activation_bytes, kv_bytes, kv_blocks...
    budget: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0  # tokens emitted
    computed_tokens: int = 0  # tokens run through the model (recomputation after preemption included)
    num_finished: int = 0
    hash_time_s: float = 0.0  # total: hashing row ids and starting prefetches at step entry
    stall_by_layer_s: dict[int, float] = field(default_factory=dict)  # total per Engram layer
    degrade_level: int = 0  # the degrade policy's level now: 0 normal, 1 decode reads skipped, 2 + predicted
    skipped_rows: int = 0  # Engram rows the degrade policy did not fetch (total)
    degrade_steps: dict[int, int] = field(default_factory=dict)  # steps run at each degrade level
    faults: int = 0  # steps that failed (their requests failed with the cause; the engine went on)
    consecutive_faults: int = 0  # failed steps since the last one that succeeded
    last_fault: str | None = None  # the cause of the last failed step
    failed_requests: int = 0  # requests that ended with finish_reason "error" (a failed step or their own sampling)
    deferred_aborts: int = 0  # aborts of a sequence the step in flight computed: its blocks freed when it ended
    hot_rows_preloaded: int = 0  # rows read into the Engram caches at start from a hot-rows file (all layers)
    hot_rows_preload_s: float = 0.0  # the time that took
