"""The inference half of the pre-retrieval skip predictor, for the engine's degrade policy (fitting it:
tiergram.analysis.predictor)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tiergram.engram.sketch import CountMinSketch
from tiergram.hashing.compression import to_numpy

FEATURE_SETS = {"full": ("static", "sketch", "position"), "sketch": ("sketch", "position"),
                "static": ("static", "position")}


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
        ids = to_numpy(row_ids)
        lead = ids.shape[:-1]
        pos = np.broadcast_to(to_numpy(positions), lead).reshape(-1)
        x = self.feature_matrix(layer, ids.reshape(-1, ids.shape[-1]), pos)
        g = 1.0 / (1.0 + np.exp(-(x @ self.layers[layer].coef)))
        return np.minimum(g, np.nextafter(1.0, 0.0)).reshape(lead)

    def predict_skip(self, layer: int, row_ids: Any, positions: Any, threshold: float | None = None) -> Any:
        """Bool mask like row_ids [B, T, H] (torch or numpy): True = skip (whole positions); positions [B, T] or [T]."""
        thr = self.threshold if threshold is None else threshold
        skip = self.predict_gate(layer, row_ids, positions) < thr
        mask = np.broadcast_to(skip[..., None], to_numpy(row_ids).shape).copy()
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
