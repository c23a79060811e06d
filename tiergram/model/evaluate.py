"""Held-out evaluation: teacher-forced loss per token, per corpus category, with 95% intervals from a bootstrap
over documents (docs/model.md)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from tiergram.corpus import CATEGORIES, EOT, load_split
from tiergram.model.model import EngramLM

BOOTSTRAP = 1000


@dataclass
class EvalDoc:
    """One document's tokens (with the leading <|endoftext|>) and category."""

    category: str
    tokens: np.ndarray  # int64 [n + 1]
    loss_sum: float = 0.0
    count: int = 0


def eval_documents(corpus: str | os.PathLike, split: str, tokenizer: Any, *,
                   max_tokens_per_category: int | None = None, seed: int = 0) -> list[EvalDoc]:
    """The split's documents tokenized, shuffled with seed, capped at max_tokens_per_category each."""
    eot = tokenizer.token_to_id(EOT)
    docs = list(load_split(corpus, split))
    order = np.random.default_rng(seed).permutation(len(docs))
    encs = tokenizer.encode_batch([docs[i].text for i in order])
    taken = dict.fromkeys(CATEGORIES, 0)
    out = []
    for i, enc in zip(order, encs, strict=True):
        cat = docs[i].category
        room = None if max_tokens_per_category is None else max_tokens_per_category - taken.get(cat, 0)
        ids = enc.ids[:room]  # room >= 0: a category is never filled past its cap
        if not ids:
            continue
        out.append(EvalDoc(cat, np.asarray([eot, *ids], dtype=np.int64)))
        taken[cat] = taken.get(cat, 0) + len(ids)
    return out


def document_windows(docs: list[EvalDoc], seq_len: int) -> list[tuple[int, np.ndarray]]:
    """(document index, tokens [<= seq_len + 1]) windows; consecutive windows overlap by one token."""
    return [(d, doc.tokens[s:s + seq_len + 1]) for d, doc in enumerate(docs)
            for s in range(0, len(doc.tokens) - 1, seq_len)]


@dataclass
class Window:
    """One evaluation window: the model's inputs and their next-token targets."""

    doc: int  # index into the document list
    category: str
    inputs: np.ndarray  # int64 [T]
    targets: np.ndarray  # int64 [T]


def make_windows(docs: list[EvalDoc], seq_len: int) -> list[Window]:
    """The evaluation windows of documents, in document order."""
    return [Window(d, docs[d].category, w[:-1].copy(), w[1:].copy()) for d, w in document_windows(docs, seq_len)
            if len(w) > 1]


def batches(windows: list[Window], batch_size: int) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """(window indices, inputs [B, T] zero-padded, targets [B, T] with -100 padding), similar lengths together."""
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].inputs))
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        t = max(len(windows[i].inputs) for i in idx)
        x = torch.zeros(len(idx), t, dtype=torch.int64)
        y = torch.full((len(idx), t), -100, dtype=torch.int64)
        for j, i in enumerate(idx):
            n = len(windows[i].inputs)
            x[j, :n] = torch.from_numpy(windows[i].inputs)
            y[j, :n] = torch.from_numpy(windows[i].targets)
        yield idx, x, y


def eval_batches(model: EngramLM, windows: list[Window], batch_size: int, desc: str, progress: bool
                 ) -> Iterator[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """batches() moved to the model's device, with the model in eval mode and a progress bar named desc."""
    model.eval()
    device = next(model.parameters()).device
    for idx, x, y in tqdm(batches(windows, batch_size), total=-(-len(windows) // batch_size), desc=desc, unit="batch",
                          disable=not progress):
        yield idx, x.to(device), y.to(device)


@torch.no_grad()
def score_documents(model: EngramLM, docs: list[EvalDoc], *, batch_size: int = 16,
                    engram_enabled: bool | Iterable[int] = True, progress: bool = True) -> None:
    """Fill each document's loss_sum and count (summed next-token cross-entropy, in nats)."""
    windows = make_windows(docs, model.config.max_seq)
    for idx, x, y in eval_batches(model, windows, batch_size, "eval", progress):
        logits, _ = model(x, engram_enabled=engram_enabled)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none").view(y.shape)
        loss = loss.cpu().double()
        for j, i in enumerate(idx):
            doc, n = docs[windows[i].doc], len(windows[i].inputs)
            doc.loss_sum += float(loss[j, :n].sum())
            doc.count += n


def summarize(docs: list[EvalDoc], seed: int = 0) -> dict[str, Any]:
    """{loss (token-weighted mean), tokens, documents, ci95 (document bootstrap), stderr}."""
    sums = np.array([d.loss_sum for d in docs])
    counts = np.array([d.count for d in docs], dtype=np.float64)
    mean = float(sums.sum() / counts.sum())
    idx = np.random.default_rng(seed).integers(0, len(docs), size=(BOOTSTRAP, len(docs)))
    boot = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = np.percentile(boot, [2.5, 97.5])
    return {"loss": mean, "tokens": int(counts.sum()), "documents": len(docs), "ci95": [float(lo), float(hi)],
            "stderr": float(boot.std(ddof=1)) if len(docs) > 1 else 0.0}


def evaluate(model: EngramLM, corpus: str | os.PathLike, split: str, tokenizer: Any, *,
             max_tokens_per_category: int | None = 131072, batch_size: int = 16,
             engram_enabled: bool | Iterable[int] = True, progress: bool = True, seed: int = 0) -> dict[str, Any]:
    """{'split', 'engram_enabled', 'categories': {category: summarize()}, 'all': ...}."""
    docs = eval_documents(corpus, split, tokenizer, max_tokens_per_category=max_tokens_per_category, seed=seed)
    if not docs:
        raise ValueError(f"the {split} split of {corpus} has no documents to evaluate")
    score_documents(model, docs, batch_size=batch_size, engram_enabled=engram_enabled, progress=progress)
    cats = {c: summarize(mine, seed) for c in CATEGORIES if (mine := [d for d in docs if d.category == c])}
    on = model.active_engram_layers(engram_enabled)
    return {"split": split, "engram_enabled": bool(on), "engram_layers_on": on,
            "max_tokens_per_category": max_tokens_per_category, "categories": cats, "all": summarize(docs, seed)}


def format_eval(result: dict[str, Any]) -> str:
    """A small table of an evaluate() result."""
    lines = [f"split {result['split']}, Engram {'on' if result['engram_enabled'] else 'off'}",
             f"  {'category':18} {'loss':>7} {'95% CI':>17} {'tokens':>9} {'docs':>5}"]
    for name, r in [*result["categories"].items(), ("all", result["all"])]:
        lines.append(f"  {name:18} {r['loss']:7.4f} [{r['ci95'][0]:7.4f}, {r['ci95'][1]:7.4f}] "
                     f"{r['tokens']:9d} {r['documents']:5d}")
    return "\n".join(lines)
