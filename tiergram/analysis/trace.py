"""Run a model over a corpus split's evaluation windows (tiergram.model.evaluate) and record, per position, each
Engram layer's gates and row ids; n-grams at a window's start are left-padded, as the model hashes them."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiergram.corpus import CATEGORIES
from tiergram.model.evaluate import EvalDoc, Window, eval_batches, eval_documents, make_windows
from tiergram.model.model import EngramLM


def load_windows(model: EngramLM, corpus: str | os.PathLike, split: str, tokenizer: Any,
                 max_tokens_per_category: int | None, seed: int = 0) -> tuple[list[EvalDoc], list[Window]]:
    """(documents, windows) of a split, capped per category as in evaluate()."""
    docs = eval_documents(corpus, split, tokenizer, max_tokens_per_category=max_tokens_per_category, seed=seed)
    if not docs:
        raise ValueError(f"the {split} split of {corpus} has no documents")
    return docs, make_windows(docs, model.config.max_seq)


@dataclass
class EngramHooks:
    """Record every Engram layer's gates; zero its value and output where `keep` is False (engram_enabled=False)."""

    record: bool = True
    record_query: bool = False  # also keep each layer's gate query (the normalised hidden state)
    keep: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> bool [B, T]; absent: all on
    gates: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, T, hc] of the last forward
    queries: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [B, T, hc, d] of the last forward

    @contextmanager
    def installed(self, model: EngramLM) -> Iterator[EngramHooks]:
        """Hooks in place for the duration of the block (full-sequence forwards only, no K/V cache)."""
        handles = []
        for layer in model.engram_layers:
            engram = model.blocks[layer].engram
            engram.gated_value = self._gated_value(layer, engram.gated_value)  # shadows the method until removed
            if engram.short_conv is not None:
                handles.append(engram.short_conv.register_forward_hook(self._conv_hook(layer)))
        try:
            yield self
        finally:
            for layer in model.engram_layers:
                del model.blocks[layer].engram.gated_value
            for h in handles:
                h.remove()

    def _gated_value(self, layer: int, gated_value: Callable[..., tuple[torch.Tensor, torch.Tensor]]):
        def wrapped(hidden: torch.Tensor, row_ids: torch.Tensor | None = None, rows: torch.Tensor | None = None):
            value, gates = gated_value(hidden, row_ids, rows)
            if self.record:
                self.gates[layer] = gates.detach()
            if self.record_query:
                engram = gated_value.__self__
                self.queries[layer] = torch.stack([engram.norm2[i](hidden[:, :, i, :].to(engram.value_proj.weight))
                                                   for i in range(hidden.shape[2])], dim=2).detach()
            keep = self.keep.get(layer)
            return (value, gates) if keep is None else (value * keep[:, :, None, None].to(value), gates)
        return wrapped

    def _conv_hook(self, layer: int):
        def hook(module, args, output):
            keep = self.keep.get(layer)
            return None if keep is None else output * keep[:, :, None, None].to(output)
        return hook


# ------------------------------------------------------------------------------------------------ traces

@dataclass
class Trace:
    """Per-position records of a run, flat over all N positions of all windows."""

    windows: list[Window]
    layers: list[int]
    window: np.ndarray  # int32 [N]: the position's window
    pos: np.ndarray  # int32 [N]: position in the window
    category: np.ndarray  # int8 [N]: index into CATEGORIES
    context: np.ndarray  # int64 [N, max_n]: compressed ids ending at the position, oldest first (pad-padded)
    gates: dict[int, np.ndarray]  # layer -> float32 [N, hc]
    row_ids: dict[int, np.ndarray]  # layer -> int64 [N, H]
    query_mean: dict[int, np.ndarray]  # layer -> float32 [hc, d]: mean gate query over the positions

    @property
    def n(self) -> int:
        """Number of positions."""
        return len(self.pos)

    def documents(self) -> np.ndarray:
        """int [N]: each position's document, numbered 0..D-1 in document order."""
        return np.unique(np.array([w.doc for w in self.windows])[self.window], return_inverse=True)[1].reshape(-1)

    def window_starts(self) -> dict[int, int]:
        """{window: index of its first position in the flat arrays}."""
        first = np.flatnonzero(self.pos == 0)
        return {int(self.window[i]): int(i) for i in first}


def compressed_context(model: EngramLM, x: np.ndarray) -> np.ndarray:
    """Compressed ids [B, T, max_n] of the n-gram ending at each position (oldest first), pad-padded."""
    h = model.hasher
    k = h.max_ngram_size
    c = h.compress(x)
    full = np.concatenate([np.full((c.shape[0], k - 1), h.compressed_pad_id, dtype=np.int64), c], axis=1)
    return np.stack([full[:, j:j + c.shape[1]] for j in range(k)], axis=-1)


@torch.no_grad()
def trace(model: EngramLM, windows: list[Window], *, batch_size: int = 8, progress: bool = False) -> Trace:
    """Run the model over windows (Engram on) and record gates, row ids and n-gram contexts."""
    hooks = EngramHooks(record=True, record_query=True)
    qsum = {layer: 0.0 for layer in model.engram_layers}
    parts: dict[str, list] = {k: [] for k in ("window", "pos", "context")}
    gates: dict[int, list] = {layer: [] for layer in model.engram_layers}
    rows: dict[int, list] = {layer: [] for layer in model.engram_layers}
    with hooks.installed(model):
        for idx, x, y in eval_batches(model, windows, batch_size, "trace", progress):
            model(x)
            valid = (y != -100).cpu()  # a window's inputs, then padding
            row_ids = model.engram_row_ids(x)
            parts["window"].append(np.repeat(np.array(idx, dtype=np.int32), valid.sum(1).numpy()))
            parts["pos"].append(valid.nonzero()[:, 1].numpy().astype(np.int32))
            parts["context"].append(compressed_context(model, x.cpu().numpy())[valid.numpy()])
            for layer in model.engram_layers:
                gates[layer].append(hooks.gates[layer].cpu()[valid].float().numpy())
                rows[layer].append(row_ids[layer].cpu()[valid].numpy())
                qsum[layer] = qsum[layer] + hooks.queries[layer].cpu()[valid].double().sum(0).numpy()
    window = np.concatenate(parts["window"])
    cat_index = {c: i for i, c in enumerate(CATEGORIES)}
    category = np.array([cat_index[windows[i].category] for i in window], dtype=np.int8)
    return Trace(windows=windows, layers=list(model.engram_layers), window=window,
                 pos=np.concatenate(parts["pos"]), category=category, context=np.concatenate(parts["context"]),
                 gates={k: np.concatenate(v) for k, v in gates.items()},
                 row_ids={k: np.concatenate(v) for k, v in rows.items()},
                 query_mean={k: (v / len(window)).astype(np.float32) for k, v in qsum.items()})

