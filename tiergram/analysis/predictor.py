"""Fit the pre-retrieval skip predictor (tiergram.engram.skip.SkipPredictor; docs/findings.md section 4) on gate
traces: per-row static scores from the table, a count-min sketch of observed gates, and a least-squares fit."""

from __future__ import annotations

import numpy as np
import torch

from tiergram.analysis.capacity import head_orders
from tiergram.analysis.trace import Trace
from tiergram.engram.sketch import CountMinSketch
from tiergram.engram.skip import FEATURE_SETS, LayerModel, SkipPredictor
from tiergram.model.model import EngramLM

EPS = 1e-4


def static_scores(model: EngramLM, layer: int, query_mean: np.ndarray, chunk: int = 65536
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [rows], per-head scale [H]) of every row's key contribution along the mean gate query."""
    engram = model.blocks[layer].engram
    offsets, sizes = model.hasher.head_offsets(layer), model.hasher.head_sizes(layer)
    dim = engram.config.dim
    q = torch.as_tensor(query_mean, dtype=torch.float32)  # [hc, d]
    out = np.zeros(int(sum(sizes)), dtype=np.float32)
    with torch.no_grad():
        # one direction in row space per head: W_k,h^T (norm1 weight * mean query), averaged over branches
        direction = sum(engram.key_projs[b].weight.float().T @ (engram.norm1[b].weight.float() * q[b])
                        for b in range(q.shape[0])) / q.shape[0]  # [E]
        direction = direction.view(len(sizes), dim)
        for s in range(0, max(sizes), chunk):
            ids = torch.minimum(torch.arange(s, s + chunk)[:, None], torch.tensor(sizes)[None, :] - 1)
            rows = engram.table(ids[None].to(engram.value_proj.weight.device))[0].float().cpu()  # [chunk, H, D]
            score = (rows * direction[None]).sum(-1).numpy()  # [chunk, H]
            for h, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
                n = max(0, min(chunk, size - s))
                out[off + s:off + s + n] = score[:n, h]
    scale = np.array([max(float(np.abs(out[o:o + n]).max()), 1e-12) / 127 for o, n in zip(offsets, sizes,
                                                                                           strict=True)])
    q8 = np.concatenate([np.round(out[o:o + n] / sc) for o, n, sc in zip(offsets, sizes, scale, strict=True)])
    return q8.astype(np.int8), scale.astype(np.float32)


def target_gate(tr: Trace, layer: int) -> np.ndarray:
    """The gate a position's skip decision is about: the largest over its hyper-connection branches."""
    return tr.gates[layer].max(axis=1).astype(np.float64)


def fit_predictor(model: EngramLM, tr: Trace, *, sketch_width: int = 2**16, sketch_depth: int = 2,
                  ridge: float = 1e-3, shrink: float = 2.0) -> SkipPredictor:
    """Fit on a gate trace: sketch from its accesses, weights by least squares on leave-one-out features."""
    pred = SkipPredictor({}, FEATURE_SETS["full"], model.hasher.max_ngram_size, shrink=shrink)
    orders = np.array(head_orders(model), dtype=np.int64)
    for layer in tr.layers:
        offsets = model.hasher.head_offsets(layer)
        g = target_gate(tr, layer)
        lm = pred.layers[layer] = LayerModel(offsets=offsets, orders=orders, prior=float(g.mean()))
        lm.static, lm.static_scale = static_scores(model, layer, tr.query_mean[layer])
        lm.sketch = CountMinSketch(sketch_width, sketch_depth, seed=layer)
        lm.sketch.add(tr.row_ids[layer] + offsets, np.repeat(g, tr.row_ids[layer].shape[1]))
        x = pred.feature_matrix(layer, tr.row_ids[layer], tr.pos, own_gates=g)
        y = np.log(np.clip(g, EPS, 1 - EPS) / (1 - np.clip(g, EPS, 1 - EPS)))
        mu, sd = x[:, 1:].mean(0), x[:, 1:].std(0) + 1e-9  # standardise so the ridge treats features alike
        xs = np.concatenate([x[:, :1], (x[:, 1:] - mu) / sd], axis=1)
        reg = ridge * len(y) * np.eye(xs.shape[1])
        reg[0, 0] = 0.0
        w = np.linalg.solve(xs.T @ xs + reg, xs.T @ y)
        lm.coef = np.concatenate([[w[0] - (w[1:] * mu / sd).sum()], w[1:] / sd])
    return pred

