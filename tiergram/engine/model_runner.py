"""One forward step of many sequences over a paged KV cache, run by the EngramLM's own modules (docs/engine.md,
"The forward")."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch

from tiergram.engine.block_manager import Copies
from tiergram.engine.degrade import Degrader
from tiergram.engine.kv_host import HostKV
from tiergram.engine.layout import build_layout
from tiergram.engine.sequence import Sequence
from tiergram.engram import Engram
from tiergram.model.context import EngramInput, StepContext, step_context
from tiergram.model.model import EngramLM
from tiergram.store.contract import RowStore, RowTicket


@dataclass
class StepResult:
    """Logits at each sequence's last computed token and where the step's time went."""

    logits: torch.Tensor  # float32 [B, V]
    stall_s: float  # time blocked in ticket.wait() (rows not ready when their layer came)
    hash_s: float  # hashing + starting the prefetches + the K/V layout (built while the reads run)
    stall_by_layer: dict[int, float] = field(default_factory=dict)
    skipped_rows: int = 0  # rows the degrade policy did not fetch (positions skipped x H, over the layers)


class ModelRunner:
    """Owns the KV pool [n_layers, blocks * block_size, n_kv, hd] and runs steps with a model's modules."""

    def __init__(self, model: EngramLM, sources: dict[int, RowStore], num_blocks: int, block_size: int,
                 device: torch.device, degrader: Degrader | None = None, read_ahead: set[int] | None = None) -> None:
        self.model = model
        self.read_ahead = read_ahead  # the layers read ahead of their step (None: every layer with a cache)
        self.degrader = degrader
        self.sources = sources
        self.block_size = block_size
        self.device = device
        c = model.config
        dtype = next(model.parameters()).dtype
        shape = (c.n_layers, num_blocks * block_size, c.n_kv_heads, c.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        e = c.engram
        self.lookback = e.max_ngram_size - 1 if e is not None else 0
        self.pad_id = e.pad_id if e is not None else 0
        # the short conv's input (each position's gated value), paged with the K/V: {layer: [slots, 1, d_model]}
        conv_layers = [i for i, b in enumerate(model.blocks)
                       if b.engram is not None and b.engram.short_conv is not None]
        self.conv_window = (e.conv_kernel - 1) * e.max_ngram_size if conv_layers else 0
        self.conv_cache = torch.zeros(len(conv_layers), num_blocks * block_size, 1, c.d_model, dtype=dtype,
                                      device=device)
        self.e_cache = {layer: self.conv_cache[j] for j, layer in enumerate(conv_layers)}
        self.kv_host: HostKV | None = None  # the host K/V tier, if the engine has one (it copies these caches)

    @property
    def paged_caches(self) -> list[torch.Tensor]:
        """Every per-slot cache, each [layers, slots, ...]: what a K/V block holds (keys, values, conv inputs)."""
        return [self.k_cache, self.v_cache] + ([self.conv_cache] if self.e_cache else [])

    @property
    def can_warm(self) -> bool:
        """True if any Engram table has a cache that rows can be read into ahead of their step."""
        return self.model.hasher is not None and bool(self._warmable())

    def _warmable(self) -> dict[int, RowStore]:
        return {layer: src for layer, src in self.sources.items()
                if src.cache is not None and (self.read_ahead is None or layer in self.read_ahead)}

    def warm(self, windows: list[tuple[list[int], int, int]]) -> list[Any]:
        """Start reading prompt windows' rows [(token ids, start, end)] into the tables' caches; their tickets."""
        targets = self._warmable()
        if not windows or not targets or self.model.hasher is None:
            return []
        k, parts = self.lookback, {layer: [] for layer in targets}
        for tokens, start, end in windows:
            chunk = np.asarray([tokens[start:end]], dtype=np.int64)
            hist = self.histories([tokens[max(0, start - k):start]])
            for layer, ids in self.model.hasher.row_ids_with_history(chunk, hist).items():  # [1, T, H]
                if layer in parts:
                    parts[layer].append(ids[0])
        tickets = [targets[layer].warm(np.concatenate(ids)) for layer, ids in parts.items()]
        return [t for t in tickets if t is not None]

    def histories(self, lookbacks: list[list[int]]) -> np.ndarray:
        """int64 [B, k] hashing histories: each lookback (at most k token ids) left-padded with pad_id."""
        k = self.lookback
        return np.array([[self.pad_id] * (k - len(h)) + list(h) for h in lookbacks], dtype=np.int64).reshape(
            len(lookbacks), k)

    def warm_next(self, seqs: list[Sequence], tokens: list[int]) -> None:
        """Start reading the rows of each seqs[b]'s next decode position, tokens[b] just sampled (not appended)."""
        targets = self._warmable()
        if not seqs or not targets or self.model.hasher is None:
            return
        k = self.lookback
        hist = self.histories([s.token_ids[max(0, s.num_tokens - k):] for s in seqs])
        chunk = np.asarray(tokens, dtype=np.int64).reshape(len(seqs), 1)
        for layer, ids in sorted(self.model.hasher.row_ids_with_history(chunk, hist).items()):  # [B, 1, H]
            if layer in targets:
                targets[layer].warm(ids[:, 0], urgent=True)

    @torch.no_grad()
    def execute(self, seqs: list[Sequence], counts: list[int],
                ahead: list[tuple[list[int], int, int]] | None = None, copies: Copies | None = None) -> StepResult:
        """Compute counts[b] pending tokens of each seqs[b] (blocks allocated; the caller commits num_computed);
        `ahead`: the next step's prompt windows to warm, `copies`: host K/V tier copies to finish first."""
        t0 = time.perf_counter()
        moving = self.kv_host.start(copies.to_host, copies.to_device) if copies and self.kv_host else None
        try:
            return self._execute(seqs, counts, ahead, moving, t0)
        finally:
            if moving is not None and not moving.done():  # after an error: never leave a copy running
                moving.exception()

    def _execute(self, seqs: list[Sequence], counts: list[int], ahead: list[tuple[list[int], int, int]] | None,
                 moving: Any, t0: float) -> StepResult:
        model = self.model
        row_ids = self.row_ids(seqs, counts)
        keep = self.keep_masks(seqs, counts, row_ids)  # {layer: bool [N]} where the degrade policy skips reads
        # in layer order: the first Engram layer's rows are needed soonest
        tickets = {layer: self.sources[layer].prefetch(ids if layer not in keep else ids[keep[layer]])
                   for layer, ids in sorted(row_ids.items()) if layer not in keep or keep[layer].any()}
        layout = build_layout(seqs, counts, self.block_size, self.device, self.conv_window)
        self.warm(ahead or [])
        if moving is not None:
            self.kv_host.wait(moving)  # the forward reads the blocks copied in and overwrites those copied out
        t1 = time.perf_counter()
        stall: dict[int, float] = {}
        gpu_waits: dict[int, tuple[Any, Any]] = {}  # CUDA: events around each wait on the compute stream
        dtype = model.tok_emb.weight.dtype

        def engram_input(layer: int) -> EngramInput:
            w0 = time.perf_counter()
            rows = self._wait(tickets.pop(layer), layer, gpu_waits) if layer in tickets else None
            stall[layer] = time.perf_counter() - w0
            if layer not in keep:
                return EngramInput(rows.to(self.device))
            rows = self.scatter_rows(model.blocks[layer].engram, keep[layer], rows)
            return EngramInput(rows.to(self.device), torch.from_numpy(keep[layer]).to(self.device, dtype))

        ctx = StepContext(layout, self.k_cache, self.v_cache,
                          engram={layer: partial(engram_input, layer) for layer in row_ids},
                          e_cache=self.e_cache)
        try:
            with step_context(ctx):
                logits = model(layout.ids[None])[0][0]  # the model's own forward: [B, V] at the last tokens
        finally:
            for ticket in tickets.values():  # only after an error: abandon the fetches nobody will wait for
                ticket.cancel()
        for i, (before, after) in gpu_waits.items():  # the time the compute stream itself sat waiting on the rows
            after.synchronize()  # the step's logits are read right after this anyway
            stall[i] += before.elapsed_time(after) / 1e3
        skipped = sum(int((~k).sum()) * row_ids[layer].shape[1] for layer, k in keep.items())
        return StepResult(logits, sum(stall.values()), t1 - t0, stall, skipped)

    def _wait(self, ticket: RowTicket, layer: int, gpu_waits: dict[int, tuple[Any, Any]]) -> torch.Tensor:
        """The ticket's rows; on CUDA, events around the wait time the compute stream's stall."""
        if self.device.type != "cuda":
            return ticket.wait()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        rows = ticket.wait()
        after.record()
        gpu_waits[layer] = (before, after)
        return rows

    def keep_masks(self, seqs: list[Sequence], counts: list[int], row_ids: dict[int, np.ndarray]
                   ) -> dict[int, np.ndarray]:
        """{layer: bool [N], False = skip the position's reads} for the layers where the degrader skips any."""
        if self.degrader is None or self.degrader.level == 0 or not row_ids:
            return {}
        positions = np.concatenate([np.arange(s.num_computed, s.num_computed + c) for s, c in zip(seqs, counts,
                                                                                                   strict=True)])
        decode = positions >= np.repeat([s.prompt_len for s in seqs], counts)  # generated tokens' positions
        keep = {}
        for layer, ids in row_ids.items():
            skip = self.degrader.skip_positions(layer, ids, positions, decode)
            if skip is not None:
                keep[layer] = ~skip
        return keep

    @staticmethod
    def scatter_rows(engram: Engram, keep: np.ndarray, fetched: torch.Tensor | None) -> torch.Tensor:
        """Rows [N, H, D]: the fetched ones at the kept positions, zeros at the skipped ones."""
        c = engram.config
        dtype = fetched.dtype if fetched is not None else engram.value_proj.weight.dtype
        rows = torch.zeros(len(keep), c.n_heads, c.dim, dtype=dtype, device=getattr(fetched, "device", None))
        if fetched is not None:
            rows[torch.from_numpy(keep).to(rows.device)] = fetched
        return rows

    def row_ids(self, seqs: list[Sequence], counts: list[int]) -> dict[int, np.ndarray]:
        """{layer: int64 [N, H]} for the step's flat tokens, each chunk hashed after its sequence's lookback."""
        hasher = self.model.hasher
        if hasher is None:
            return {}
        k, n_total = self.lookback, sum(counts)
        offs = np.cumsum([0, *counts])
        out: dict[int, np.ndarray] = {}
        by_len: dict[int, list[int]] = {}
        for b, c in enumerate(counts):
            by_len.setdefault(c, []).append(b)
        for c, members in by_len.items():  # one hashing call per chunk length
            chunk = np.array([seqs[b].token_ids[seqs[b].num_computed:seqs[b].num_computed + c] for b in members],
                             dtype=np.int64)
            hist = self.histories([seqs[b].history(k) for b in members])
            for layer, ids in hasher.row_ids_with_history(chunk, hist).items():  # [G, c, H]
                dst = out.setdefault(layer, np.empty((n_total, ids.shape[-1]), dtype=np.int64))
                for g, b in enumerate(members):
                    dst[offs[b]:offs[b + 1]] = ids[g]
        return out
