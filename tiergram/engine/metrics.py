"""Engine counters: queues, KV usage, preemptions, Engram reads, stall, step time and the degrade level."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any


def _metric(kind: str, name: str, help_: str, default: Any = 0) -> Any:
    """A field that /metrics exports as a `kind` (gauge, counter) `name`; `help_` is its one description."""
    return field(default=default, metadata={"prometheus": (kind, name, help_)})


gauge, counter = partial(_metric, "gauge"), partial(_metric, "counter")


@dataclass
class EngineMetrics:
    """A snapshot of the engine (LLMEngine.metrics()); totals since start unless a field says otherwise."""

    num_running: int = gauge("tiergram_num_requests_running", "Sequences in the running batch.")
    num_waiting: int = gauge("tiergram_num_requests_waiting", "Sequences waiting to be scheduled.")
    kv_blocks_total: int = gauge("tiergram_kv_blocks_total", "K/V cache blocks the budget allows.")
    kv_blocks_used: int = gauge("tiergram_kv_blocks_used", "K/V cache blocks in use.")
    kv_usage: float = gauge("tiergram_kv_cache_usage_ratio", "Fraction of K/V cache blocks in use.", 0.0)
    num_preemptions: int = counter("tiergram_num_preemptions", "Sequences preempted for K/V space.")
    steps: int = counter("tiergram_engine_steps", "Engine steps run.")
    # cache_hit_rate (file caches; None without), bytes_read {tier: n}, pages_read, per_layer
    engram: dict[str, Any] = field(default_factory=dict)
    exposed_stall_s: float = counter("tiergram_engram_exposed_stall_seconds",
                                     "Time the forward waited on Engram rows (not hidden by prefetch).", 0.0)
    prefill_stall_s: float = counter("tiergram_engram_prefill_stall_seconds",
                                     "The part of the exposed stall in steps that computed prompt tokens.", 0.0)
    prefill_steps: int = counter("tiergram_engine_prefill_steps",
                                 "Engine steps that computed prompt tokens (prefill chunks).")
    prompt_rows_waits: int = counter("tiergram_engine_prompt_rows_waits", "Prompts that waited for their read-ahead "
                                     "rows before joining the batch (prompt_rows_first).")
    prompt_rows_wait_s: float = counter("tiergram_engine_prompt_rows_wait_seconds", "The time those prompts waited, "
                                        "from arrival to their rows in or the wait given up.", 0.0)
    prompt_rows_timeouts: int = counter("tiergram_engine_prompt_rows_timeouts", "Prompts that joined with rows "
                                        "still being read, after waiting the longest a prompt waits.")
    last_step_stall_s: float = gauge("tiergram_engram_last_step_stall_seconds",
                                     "Prefetch stall exposed in the last step.", 0.0)
    step_time_s: float = counter("tiergram_engine_step_seconds", "Wall time inside steps that ran the model.", 0.0)
    # total_bytes, weights_bytes, device_table_bytes, activation_bytes, kv_bytes, kv_blocks...
    budget: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    generation_tokens: int = 0  # tokens emitted
    computed_tokens: int = counter("tiergram_engine_computed_tokens",
                                   "Tokens run through the model (recomputation included).")
    hash_time_s: float = 0.0  # hashing row ids and starting prefetches at step entry
    stall_by_layer_s: dict[int, float] = field(default_factory=dict)  # per Engram layer
    degrade_level: int = gauge("tiergram_degrade_level", "Degrade level: 0 normal, 1 decode Engram reads skipped, 2 "
                               "also predicted-useless prefill reads.")
    skipped_rows: int = counter("tiergram_engram_skipped_rows", "Engram rows the degrade policy did not fetch.")
    degrade_steps: dict[int, int] = field(default_factory=dict)  # steps run at each degrade level
    faults: int = counter("tiergram_engine_faults",
                          "Engine steps that failed (their requests failed with the cause; the engine went on).")
    consecutive_faults: int = gauge("tiergram_engine_consecutive_faults",
                                    "Engine steps failed in a row (0 after a step that succeeded).")
    last_fault: str | None = None  # the cause of the last failed step
    failed_requests: int = counter("tiergram_engine_failed_requests",
                                   "Requests ended by an error (a failed step, or their own sampling).")
    deferred_aborts: int = 0  # aborts of a sequence the step in flight computed: its blocks freed when it ended
    prefix_queried_tokens: int = counter("tiergram_prefix_cache_queried_tokens", "Prompt tokens admitted that could "
                                         "have been found in the prefix cache (all but each prompt's last).")
    prefix_device_hit_tokens: int = counter("tiergram_prefix_cache_device_hit_tokens",
                                            "Of those, found in device K/V blocks.")
    prefix_host_hit_tokens: int = counter("tiergram_prefix_cache_host_hit_tokens",
                                          "Of those, found in the host K/V tier and copied back.")
    prefix_hit_rate: float = gauge("tiergram_prefix_cache_hit_rate", "(device + host hit tokens) / queried tokens.",
                                   0.0)
    kv_cached_blocks: int = gauge("tiergram_kv_cached_blocks", "Device K/V blocks named in the prefix cache.")
    kv_evicted_blocks: int = counter("tiergram_kv_evicted_blocks", "Cached device blocks reused for other tokens.")
    kv_host_blocks_total: int = gauge("tiergram_kv_host_blocks_total", "Blocks the host K/V tier holds at most.")
    kv_host_blocks_used: int = gauge("tiergram_kv_host_blocks_used", "Blocks in the host K/V tier.")
    kv_host_bytes_to_host: int = counter("tiergram_kv_host_bytes_to_host", "Bytes copied from device blocks to the "
                                         "host K/V tier (evictions kept).")
    kv_host_bytes_to_device: int = counter("tiergram_kv_host_bytes_to_device",
                                           "Bytes copied back from the host K/V tier on prefix hits.")
    kv_host_wait_s: float = counter("tiergram_kv_host_wait_seconds", "Time steps waited for K/V copies before "
                                    "their forward (not hidden behind hashing and the Engram prefetch).", 0.0)
    hot_rows_preloaded: int = gauge("tiergram_engram_hot_rows_preloaded",
                                    "Rows read into the Engram caches at start from a hot-rows file.")
    hot_rows_preload_s: float = gauge("tiergram_engram_hot_rows_preload_seconds",
                                      "Time the hot-rows preload took at start.", 0.0)
