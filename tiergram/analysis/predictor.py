"""Pre-retrieval usefulness predictor: decide, before a row is read, that its position's gate will be low.

An Engram gate multiplies everything a position reads, so a low gate means the position's rows hardly
matter. Reading the gate needs the rows, so the predictor uses only what is known before the read:

- static: a per-row scalar computed offline from the table, the row's key contribution along the layer's
  mean gate query, s_r = <W_k,h e_r, w1 * mean_query> (int8 per row, 1/264 of an fp8 row)
- sketch: a count-min sketch of each row's access count and mean observed gate, learned from gate traces
- position: log(1 + position) and whether the n-grams are still left-padded

A per-layer least-squares fit maps these to the gate's logit. SkipPredictor.predict_skip(layer, row_ids,
positions) marks whole positions (all H rows) whose predicted gate is below the threshold; a serving engine
then skips those reads and the Engram layer for those positions (zero rows and zero output).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiergram.analysis.capacity import head_offsets, head_orders
from tiergram.analysis.sketch import CountMinSketch
from tiergram.analysis.trace import Trace
from tiergram.model.model import EngramLM

FEATURE_SETS = {"full": ("static", "sketch", "position"), "sketch": ("sketch", "position"),
                "static": ("static", "position")}
EPS = 1e-4


@dataclass
class LayerModel:
    """One layer's predictor state: row statistics and the fitted weights."""

    offsets: np.ndarray  # int64 [H]: first flat row of each head
    orders: np.ndarray  # int64 [H]: n-gram order of each head
    prior: float  # mean gate of the layer in the traces
    coef: np.ndarray = field(default_factory=lambda: np.zeros(0))  # float64 [F]
    static: np.ndarray | None = None  # int8 [rows]
    static_scale: np.ndarray | None = None  # float32 [H]: static value = int8 * scale of its head
    sketch: CountMinSketch | None = None


def static_scores(model: EngramLM, layer: int, query_mean: np.ndarray, chunk: int = 65536
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [rows], per-head scale [H]) of every row's key contribution along the mean gate query."""
    engram = model.blocks[layer].engram
    offsets, sizes = head_offsets(model, layer)
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


@dataclass
class SkipPredictor:
    """Predicts low Engram gates before the rows are read. Fit with fit_predictor; save/load as .npz."""

    layers: dict[int, LayerModel]
    features: tuple[str, ...]
    max_ngram_size: int
    threshold: float = 0.0  # skip where the predicted gate < threshold (0: nothing, 1: everything)
    shrink: float = 2.0  # sketch mean gates are shrunk to the prior as if seen this many extra times

    def feature_matrix(self, layer: int, row_ids: np.ndarray, positions: np.ndarray,
                       own_gates: np.ndarray | None = None) -> np.ndarray:
        """Features [N, F] of positions from row ids [N, H] and positions [N] (own_gates: leave-one-out)."""
        lm = self.layers[layer]
        flat = np.asarray(row_ids, dtype=np.int64) + lm.offsets
        n = flat.shape[0]
        order_ids = sorted(set(lm.orders.tolist()))
        cols = [np.ones(n)]
        if "static" in self.features:
            s = lm.static[flat].astype(np.float64) * lm.static_scale
            cols += [s[:, lm.orders == o].sum(1) for o in order_ids]
        if "sketch" in self.features:
            own = None if own_gates is None else np.repeat(own_gates, flat.shape[1])
            count, total = lm.sketch.query(flat, own)
            count, total = count.reshape(flat.shape), total.reshape(flat.shape)
            mean = (total + self.shrink * lm.prior) / (count + self.shrink)
            cols += [mean[:, lm.orders == o].mean(1) for o in order_ids]
            cols.append(np.log1p(count).mean(1))
        if "position" in self.features:
            p = np.asarray(positions, dtype=np.float64).reshape(-1)
            cols += [np.log1p(p), (p < self.max_ngram_size - 1).astype(np.float64)]
        return np.stack(cols, axis=1)

    def predict_gate(self, layer: int, row_ids: Any, positions: Any) -> np.ndarray:
        """Predicted gate in [0, 1) of each position: row_ids [..., H], positions broadcastable to [...]."""
        ids = _numpy(row_ids)
        lead = ids.shape[:-1]
        pos = np.broadcast_to(_numpy(positions), lead).reshape(-1)
        x = self.feature_matrix(layer, ids.reshape(-1, ids.shape[-1]), pos)
        g = 1.0 / (1.0 + np.exp(-(x @ self.layers[layer].coef)))
        return np.minimum(g, np.nextafter(1.0, 0.0)).reshape(lead)

    def predict_skip(self, layer: int, row_ids: Any, positions: Any, threshold: float | None = None) -> Any:
        """Bool mask like row_ids [B, T, H]: True = do not read this row (its position's gate is predicted low).

        row_ids: the layer's row ids (torch or numpy) as the hasher gives them; positions: each position's
        index in its sequence, [B, T] or [T]. Whole positions are skipped: all H rows or none.
        """
        thr = self.threshold if threshold is None else threshold
        skip = self.predict_gate(layer, row_ids, positions) < thr
        mask = np.broadcast_to(skip[..., None], _numpy(row_ids).shape).copy()
        if isinstance(row_ids, torch.Tensor):
            return torch.from_numpy(mask).to(row_ids.device)
        return mask

    def nbytes(self) -> dict[int, dict[str, int]]:
        """Memory of the per-row statistics, per layer."""
        return {layer: {"static": int(lm.static.nbytes) if lm.static is not None else 0,
                        "sketch": lm.sketch.nbytes if lm.sketch is not None else 0}
                for layer, lm in self.layers.items()}

    def save(self, path: str | os.PathLike) -> None:
        """Write an .npz with everything predict_skip needs."""
        arrays: dict[str, np.ndarray] = {}
        meta = {"features": list(self.features), "max_ngram_size": self.max_ngram_size,
                "threshold": self.threshold, "shrink": self.shrink, "layers": {}}
        for layer, lm in self.layers.items():
            p = f"l{layer}_"
            arrays.update({p + "offsets": lm.offsets, p + "orders": lm.orders, p + "coef": lm.coef})
            meta["layers"][str(layer)] = {"prior": lm.prior}
            if lm.static is not None:
                arrays.update({p + "static": lm.static, p + "static_scale": lm.static_scale})
            if lm.sketch is not None:
                arrays.update({p + "counts": lm.sketch.counts, p + "sums": lm.sketch.sums,
                               p + "mults": lm.sketch.mults})
                meta["layers"][str(layer)]["sketch"] = [lm.sketch.width, lm.sketch.depth]
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        with open(path, "wb") as f:
            np.savez_compressed(f, **arrays)

    @classmethod
    def load(cls, path: str | os.PathLike) -> SkipPredictor:
        """Read a predictor written by save()."""
        with np.load(path) as npz:
            z = {k: npz[k] for k in npz.files}
        meta = json.loads(bytes(z["meta"]).decode())
        layers = {}
        for key, info in meta["layers"].items():
            p = f"l{key}_"
            sketch = None
            if "sketch" in info:
                w, d = info["sketch"]
                sketch = CountMinSketch(w, d, counts=z[p + "counts"], sums=z[p + "sums"], mults=z[p + "mults"])
            layers[int(key)] = LayerModel(z[p + "offsets"], z[p + "orders"], info["prior"], z[p + "coef"],
                                          z[p + "static"] if p + "static" in z else None,
                                          z[p + "static_scale"] if p + "static_scale" in z else None, sketch)
        return cls(layers, tuple(meta["features"]), meta["max_ngram_size"], meta["threshold"], meta["shrink"])


def _numpy(x: Any) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def target_gate(tr: Trace, layer: int) -> np.ndarray:
    """The gate a position's skip decision is about: the largest over its hyper-connection branches."""
    return tr.gates[layer].max(axis=1).astype(np.float64)


def fit_predictor(model: EngramLM, tr: Trace, features: str = "full", *, sketch_width: int = 2**16,
                  sketch_depth: int = 2, ridge: float = 1e-3, shrink: float = 2.0) -> SkipPredictor:
    """Fit on a gate trace: sketch from its accesses, weights by least squares on leave-one-out features."""
    if features not in FEATURE_SETS:
        raise ValueError(f"unknown feature set {features!r} (valid: {', '.join(FEATURE_SETS)})")
    feats = FEATURE_SETS[features]
    orders = np.array(head_orders(model), dtype=np.int64)
    layers = {}
    for layer in tr.layers:
        offsets, _ = head_offsets(model, layer)
        g = target_gate(tr, layer)
        lm = LayerModel(offsets=offsets, orders=orders, prior=float(g.mean()))
        if "static" in feats:
            lm.static, lm.static_scale = static_scores(model, layer, tr.query_mean[layer])
        if "sketch" in feats:
            lm.sketch = CountMinSketch(sketch_width, sketch_depth, seed=layer)
            lm.sketch.add(tr.row_ids[layer] + offsets, np.repeat(g, tr.row_ids[layer].shape[1]))
        layers[layer] = lm
    pred = SkipPredictor(layers, feats, model.hasher.max_ngram_size, shrink=shrink)
    for layer, lm in layers.items():
        g = target_gate(tr, layer)
        x = pred.feature_matrix(layer, tr.row_ids[layer], tr.pos, own_gates=g)
        y = np.log(np.clip(g, EPS, 1 - EPS) / (1 - np.clip(g, EPS, 1 - EPS)))
        mu, sd = x[:, 1:].mean(0), x[:, 1:].std(0) + 1e-9  # standardise so the ridge treats features alike
        xs = np.concatenate([x[:, :1], (x[:, 1:] - mu) / sd], axis=1)
        reg = ridge * len(y) * np.eye(xs.shape[1])
        reg[0, 0] = 0.0
        w = np.linalg.solve(xs.T @ xs + reg, xs.T @ y)
        lm.coef = np.concatenate([[w[0] - (w[1:] * mu / sd).sum()], w[1:] / sd])
    return pred


def loo_gates(pred: SkipPredictor, tr: Trace, layer: int) -> np.ndarray:
    """Predicted gates of the positions the predictor was fitted on, each without its own observation."""
    x = pred.feature_matrix(layer, tr.row_ids[layer], tr.pos, own_gates=target_gate(tr, layer))
    return 1.0 / (1.0 + np.exp(-(x @ pred.layers[layer].coef)))
