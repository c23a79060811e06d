"""LLMEngine: requests in, tokens out, one scheduler step at a time (continuous batching over a paged KV cache)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
import uuid
from typing import Any

import torch
from safetensors.torch import load_file

from tiergram.engine.block_manager import BlockManager
from tiergram.engine.budget import Budget, activation_bytes, budget_bytes, kv_block_bytes, plan_budget
from tiergram.engine.config import EngineConfig, Placement, SamplingParams
from tiergram.engine.degrade import Degrader
from tiergram.engine.kv_host import HostKV
from tiergram.engine.metrics import EngineMetrics
from tiergram.engine.model_runner import ModelRunner
from tiergram.engine.read_ahead import ReadAhead, await_rows
from tiergram.engine.sampler import sample
from tiergram.engine.scheduler import Scheduler
from tiergram.engine.sequence import RequestOutput, Sequence
from tiergram.engine.tables import device_bytes, export_dir_for, open_table, preload_hot_rows, table_stats
from tiergram.engine.validate import RequestError, check_max_tokens, check_prompt
from tiergram.engram import RowSourceTable
from tiergram.model.checkpoint import WEIGHTS, check_table
from tiergram.model.config import ModelConfig
from tiergram.model.model import EngramLM
from tiergram.model.model_dir import ModelDir
from tiergram.tiers.device import resolve_device

EOS_TOKEN = "<|endoftext|>"


class QueueFullError(RuntimeError):
    """The waiting queue holds max_waiting requests already (an HTTP server answers 429)."""


class LLMEngine:
    """Serves one Engram model: add_request / abort_request from any thread, step() from one loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        total = budget_bytes(self.device, config.device_memory_bytes)  # before anything lands on the device
        model_dir = ModelDir.open(config.model_dir)  # config.json read once, passed down
        mconfig = model_dir.model_config
        if config.max_model_len is not None and config.max_model_len > mconfig.max_seq:
            raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's max_seq {mconfig.max_seq}")
        self.max_model_len = config.max_model_len or mconfig.max_seq
        self.vocab_size = mconfig.vocab_size
        self.model_name = model_dir.path.resolve().name
        layers = model_dir.engram_layers
        self.placements: dict[int, Placement] = config.placements_for(layers) if layers else {}
        self.sources: dict[int, Any] = {}
        try:
            self.model = self._load(model_dir, mconfig, layers)
            self.budget: Budget = self._plan(total, mconfig)
            self.degrader = Degrader(config.degrade)  # loads the skip predictor, if the policy names one
            self.hot_rows_preloaded: dict[int, int] = {}
            preload_s = 0.0
            if config.hot_rows is not None:
                if self.model.hasher is None:
                    raise ValueError(f"hot_rows {config.hot_rows}: {model_dir.path} has no Engram layers to preload")
                t0 = time.perf_counter()
                self.hot_rows_preloaded = preload_hot_rows(self.sources, config.hot_rows, self.model.hasher)
                preload_s = time.perf_counter() - t0
        except BaseException:
            self.close()
            raise
        self.eos_token_id = config.eos_token_id
        if self.eos_token_id is None and self.tokenizer is not None:
            self.eos_token_id = self.tokenizer.token_to_id(EOS_TOKEN)
        self.runner = ModelRunner(self.model, self.sources, self.budget.kv_blocks, config.block_size, self.device,
                                  self.degrader, read_ahead={layer for layer, p in self.placements.items()
                                                             if p.read_ahead})
        self.kv_host: HostKV | None = None  # the host K/V tier: its share of host memory, in blocks
        if config.kv_host_bytes:
            slot = HostKV.slot_bytes_for(self.runner.paged_caches, config.block_size)
            if config.kv_host_bytes < slot:
                raise ValueError(f"the host K/V tier cannot hold one K/V block ({slot} bytes): {config.host_split()}")
            self.kv_host = HostKV(config.kv_host_bytes // slot, self.runner.paged_caches, config.block_size)
        self.runner.kv_host = self.kv_host
        self.blocks = BlockManager(self.budget.kv_blocks, config.block_size, config.prefix_caching, self.kv_host)
        self.scheduler = Scheduler(self.blocks, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens)
        self._seqs: dict[str, Sequence] = {}  # unfinished requests
        self._aborted: list[RequestOutput] = []  # reported by the next step()
        # aborted while the step computing them ran: their blocks are freed when that step ends, never under it
        self._deferred_aborts: list[Sequence] = []
        self._lock = threading.Lock()
        self._arrivals = itertools.count()
        self._stats = EngineMetrics(stall_by_layer_s=dict.fromkeys(self.placements, 0.0),  # the running counters
                                    hot_rows_preloaded=sum(self.hot_rows_preloaded.values()),
                                    hot_rows_preload_s=preload_s)
        self._inflight: dict[str, int] = {}  # the step being run: {request_id: tokens}
        self.ahead = ReadAhead(self.runner, self.degrader, config.max_num_batched_tokens, self._stats)

    def _load(self, model_dir: ModelDir, mconfig: ModelConfig, layers: list[int]) -> EngramLM:
        """Open each layer's table per its placement (exporting first if needed); the model on the device."""
        src = export_dir_for(model_dir, layers, {p.codec for p in self.placements.values()}) if layers else model_dir
        self.model_dir = src  # the directory served: its config, tables, tokenizer and hashing, read once
        self.tokenizer = src.tokenizer
        hasher = src.hasher
        for layer, p in self.placements.items():
            path = src.table_path(layer, p.codec)
            try:
                self.sources[layer] = open_table(path, p, self.device)
            except ValueError as e:
                if not self.config.kv_host_bytes:
                    raise
                raise ValueError(f"{e} ({self.config.host_split()})") from e
            check_table(self.sources[layer].manifest, hasher, layer, mconfig.engram.dim, path)
        model = EngramLM(mconfig, hasher, {layer: RowSourceTable(s) for layer, s in self.sources.items()})
        model.load_state_dict(load_file(str(src.path / WEIGHTS)), strict=True)
        return model.to(self.device).eval()

    def _plan(self, total: int, mconfig: ModelConfig) -> Budget:
        """Split the device budget between weights, device-placed tables, activations and KV blocks."""
        c = self.config
        dtype = next(self.model.parameters()).dtype
        weights = sum(t.numel() * t.element_size() for t in itertools.chain(self.model.parameters(),
                                                                            self.model.buffers()))
        return plan_budget(
            total, weights_bytes=weights,
            device_table_bytes=sum(device_bytes(self.sources[i], p, self.device) for i, p in self.placements.items()),
            activation_bytes=activation_bytes(mconfig, max_num_batched_tokens=c.max_num_batched_tokens,
                                              max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len,
                                              dtype=dtype),
            block_bytes=kv_block_bytes(mconfig, c.block_size, dtype), block_size=c.block_size,
            max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len, num_kv_blocks=c.num_kv_blocks)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; ValueError for bad input, QueueFullError when max_waiting requests already wait."""
        prompt = self._check_prompt(prompt_token_ids, params)
        room = self.max_model_len - len(prompt)
        generator = None
        if params.temperature > 0 and params.forced_tokens is None:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            if not -(2**63) <= seed < 2**64:  # what torch.Generator.manual_seed takes
                raise RequestError(f"seed must lie in [-2^63, 2^64), got {seed}", "seed")
            generator = torch.Generator().manual_seed(seed)
        with self._lock:
            if request_id in self._seqs:
                raise ValueError(f"request id {request_id!r} is already in use")
            if self.queue_full():
                raise QueueFullError(f"{len(self.scheduler.waiting)} requests are waiting (max_waiting "
                                     f"{self.config.max_waiting}); retry later")
            seq = Sequence(request_id, prompt, len(prompt), params, next(self._arrivals),
                           min(params.max_tokens, room), generator)
            self._seqs[request_id] = seq
            if self.ahead.active() and self._busy():
                self.ahead.hold(seq)  # others are decoding: it joins once its first chunk's rows are in
            self.scheduler.add(seq)
            self._stats.prompt_tokens += len(prompt)
            if self.ahead.active() and self._inflight:  # a step runs now: read this prompt's rows meanwhile
                self.runner.warm(self.scheduler.prefill_ahead(self._inflight))

    def queue_full(self) -> bool:
        """Whether add_request would raise QueueFullError now (a lock-free read: a cheap check before any work)."""
        return len(self.scheduler.waiting) >= self.config.max_waiting

    def read_ahead(self, prompt_token_ids: list[int]) -> None:
        """From any thread, before add_request: while a step runs, start reading the prompt's first chunk's rows."""
        if not (self.ahead.active() and self._busy()):
            return
        with contextlib.suppress(RequestError):  # bad input is add_request's to refuse
            self.ahead.arriving(check_prompt(prompt_token_ids, vocab_size=self.vocab_size,
                                             max_model_len=self.max_model_len))

    def _busy(self) -> bool:
        """A step runs now or sequences are running: a new prompt's rows can be read while they compute."""
        return bool(self._inflight or self.scheduler.running)

    def abort_request(self, request_id: str) -> None:
        """From any thread: stop a request (its blocks freed now, or when the step computing it ends)."""
        with self._lock:
            seq = self._seqs.pop(request_id, None)
            if seq is None:
                return  # unknown or already finished: nothing to do
            if request_id in self._inflight:
                self._deferred_aborts.append(seq)
                self._stats.deferred_aborts += 1
                return
            self.scheduler.finish(seq, "abort")
            self._aborted.append(seq.output([]))

    def has_unfinished(self) -> bool:
        """True while any request waits, runs, or has an abort still to report."""
        with self._lock:
            return bool(self._seqs or self._aborted or self._deferred_aborts)

    def record_fault(self, error: BaseException) -> None:
        """Count a failed step (LLMEngine.step counts its own; a driver calls this when step() itself raised)."""
        with self._lock:
            self._fault(error)

    def _fault(self, error: BaseException) -> None:
        st = self._stats
        st.faults += 1
        st.consecutive_faults += 1
        st.last_fault = describe(error)

    def fail_all(self, error: BaseException) -> list[RequestOutput]:
        """End every unfinished request with finish_reason "error" (a driver whose step() raised); their outputs."""
        with self._lock:
            outputs, self._aborted = self._aborted, []
            self._finish_deferred(outputs)
            for seq in list(self._seqs.values()):
                outputs.append(self._fail(seq, error))
            return outputs

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once over every scheduled chunk, sample, and report what changed."""
        t0 = time.perf_counter()
        with self._lock:
            outputs, self._aborted = self._aborted, []
            batch = self.scheduler.schedule(self.ahead.ready if self.ahead.enabled else None)
            copies = self.blocks.take_copies()
            self._inflight = {s.request_id: n for s, n in zip(batch.seqs, batch.num_new, strict=True)}
            ahead = self.scheduler.prefill_ahead(self._inflight) if self.ahead.active() and batch.seqs else []
            # nothing runs and the first waiting prompt's rows are still being read: wait for them (outside the lock)
            head = self.scheduler.waiting[0] if not batch.seqs and self.scheduler.waiting else None
            pending = (list(head.rows_pending), head.rows_since) if head is not None else ([], 0.0)
        if not batch.seqs:
            await_rows(*pending)
            return outputs
        try:
            result = self.runner.execute(batch.seqs, batch.num_new, ahead, copies)
            done = [s.num_computed + n == s.num_tokens for s, n in zip(batch.seqs, batch.num_new, strict=True)]
            to_sample = [s for s, d in zip(batch.seqs, done, strict=True) if d]
            sampled = sample(result.logits[torch.tensor(done, device=result.logits.device)], to_sample)
        except Exception as e:  # noqa: BLE001 - the step's requests fail with the cause; the engine goes on
            with self._lock:
                self._inflight = {}
                self._fault(e)
                self.blocks.forget([block for _, block in copies.to_device])  # may not hold what they are named
                for seq in batch.seqs:
                    if self._seqs.get(seq.request_id) is seq:
                        outputs.append(self._fail(seq, e))
                self._finish_deferred(outputs)
            return outputs
        if self.ahead.active():
            self.ahead.decodes(to_sample, sampled, self.max_model_len)
        tokens = {s.request_id: t for s, t in zip(to_sample, sampled, strict=True)}
        prefill = any(n > 1 or s.num_computed < s.prompt_len for s, n in zip(batch.seqs, batch.num_new, strict=True))
        with self._lock:
            self._inflight = {}
            st = self._stats
            for seq, n in zip(batch.seqs, batch.num_new, strict=True):
                if self._seqs.get(seq.request_id) is not seq:  # aborted while the step ran
                    continue
                seq.num_computed += n
                self.blocks.commit(seq)
                st.computed_tokens += n
                token = tokens.get(seq.request_id)
                if isinstance(token, Exception):
                    outputs.append(self._fail(seq, token))
                elif token is not None:
                    outputs.append(self._append(seq, token))
            self._finish_deferred(outputs)
            st.steps += 1
            st.consecutive_faults = 0
            st.last_step_stall_s = result.stall_s
            st.exposed_stall_s += result.stall_s
            if prefill:
                st.prefill_stall_s += result.stall_s
                st.prefill_steps += 1
            st.hash_time_s += result.hash_s
            for layer, s in result.stall_by_layer.items():
                st.stall_by_layer_s[layer] += s
            self.degrader.observe(result.stall_s, result.skipped_rows)  # the level the next step runs at
            st.step_time_s += time.perf_counter() - t0
        return outputs

    def _finish_deferred(self, outputs: list[RequestOutput]) -> None:
        """(Under the lock, no step running) free and report the requests aborted while the step ran."""
        for seq in self._deferred_aborts:
            self.scheduler.finish(seq, "abort")
            outputs.append(seq.output([]))
        self._deferred_aborts = []

    def _fail(self, seq: Sequence, error: BaseException) -> RequestOutput:
        """(Under the lock) end a request with finish_reason "error" and free its blocks."""
        self.scheduler.finish(seq, "error")
        self._seqs.pop(seq.request_id, None)
        self._stats.failed_requests += 1
        return seq.output([], describe(error))

    def _append(self, seq: Sequence, token: int) -> RequestOutput:
        """Add a sampled token, finish the request if it is done, and report it."""
        seq.token_ids.append(token)
        self._stats.generation_tokens += 1
        n_out = seq.num_tokens - seq.prompt_len
        p = seq.params
        reason = None
        if p.forced_tokens is None and not p.ignore_eos and token == self.eos_token_id:
            reason = "stop"
        elif p.forced_tokens is None and token in p.stop_token_ids:
            reason = "stop"
        elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            reason = "length"
        if reason is not None:
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
        return seq.output([token])

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Offline: run every prompt to completion (in one continuous batch) and return their output tokens."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(plist)} sampling params")
        tag = uuid.uuid4().hex[:8]
        ids = [f"generate-{tag}-{i}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        pending = list(zip(ids, prompts, plist, strict=True))
        for _, prompt, p in pending:  # bad input fails before anything runs
            self._check_prompt(prompt, p)
        left = set(ids)
        while left:
            while pending:
                try:
                    self.add_request(*pending[0])
                except QueueFullError:
                    break
                pending.pop(0)
            for out in self.step():
                if out.request_id in results:
                    results[out.request_id].extend(out.new_token_ids)
                    if out.finished:
                        left.discard(out.request_id)
        return [results[i] for i in ids]

    def _check_prompt(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as ints, checked (validate.check_prompt) with the params; RequestError (a ValueError)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate(self.vocab_size)
        prompt = check_prompt(prompt_token_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        if params.forced_tokens is not None:  # a replay cannot be cut short: it must fit (sampling is clipped)
            check_max_tokens(len(params.forced_tokens), "forced_tokens", prompt_len=len(prompt),
                             max_model_len=self.max_model_len)
        return prompt

    def metrics(self) -> EngineMetrics:
        """A snapshot of the counters."""
        with self._lock:
            total, used, p = self.blocks.num_blocks, self.blocks.num_used, self.blocks.stats
            host = {}
            if self.kv_host is not None:
                h = self.kv_host.stats
                host = dict(kv_host_blocks_total=self.kv_host.num_slots, kv_host_blocks_used=self.kv_host.num_used,
                            kv_host_bytes_to_host=h.bytes_to_host, kv_host_bytes_to_device=h.bytes_to_device,
                            kv_host_wait_s=h.wait_s)
            return dataclasses.replace(
                self._stats, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                kv_blocks_total=total, kv_blocks_used=used, kv_usage=used / total,
                num_preemptions=self.scheduler.num_preemptions, engram=table_stats(self.sources, self.placements),
                budget=self.budget.as_dict(), stall_by_layer_s=dict(self._stats.stall_by_layer_s),
                degrade_level=self.degrader.level, skipped_rows=self.degrader.skipped_rows,
                degrade_steps=dict(self.degrader.level_steps), prefix_queried_tokens=p.queried_tokens,
                prefix_device_hit_tokens=p.device_hit_tokens, prefix_host_hit_tokens=p.host_hit_tokens,
                prefix_hit_rate=(p.device_hit_tokens + p.host_hit_tokens) / max(1, p.queried_tokens),
                kv_cached_blocks=len(self.blocks.cached), kv_evicted_blocks=p.evicted_blocks, **host)

    def close(self) -> None:
        """Stop the tables' prefetch workers and release their tiers."""
        for source in getattr(self, "sources", {}).values():
            source.close()
        self.sources = {}
        if getattr(self, "kv_host", None) is not None:
            self.kv_host.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def describe(error: BaseException) -> str:
    """An error as a client may read it: its type and message (PageReadError: cannot read page 3 of ...)."""
    return f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
