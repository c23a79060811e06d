"""Layer similarity (docs/findings.md section 7): linear CKA (Kornblith et al. 2019) between every residual-stream
state of two models on the same tokens (layer k = after k blocks), the Engram paper's alignment summary, and the
spread between two halves of the positions as the sampling-noise scale."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiergram.analysis.stats import md_table
from tiergram.model.evaluate import Window, eval_batches
from tiergram.model.model import EngramLM
from tiergram.plots import save_figure, subplots

TOP = 3  # B layers averaged in the soft alignment index


def linear_cka(x: np.ndarray | torch.Tensor, y: np.ndarray | torch.Tensor) -> float:
    """Linear CKA ||Y^T X||_F^2 / (||X^T X||_F ||Y^T Y||_F) of x [n, p], y [n, q], centred over the n positions."""
    x = torch.as_tensor(x, dtype=torch.float64)
    y = torch.as_tensor(y, dtype=torch.float64)
    if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"CKA needs [n, p] and [n, q] over the same positions, got {tuple(x.shape)}, {tuple(y.shape)}")
    return cka_from_cross(*cross_products([x], [y]))[0, 0]


def cross_products(xs: list[torch.Tensor], ys: list[torch.Tensor]
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Centred states xs[i] [n, p], ys[j] [n, q] -> (||Y_j^T X_i||^2 [I, J], ||X_i^T X_i|| [I], ||Y_j^T Y_j|| [J])."""
    xs = [x - x.mean(0, keepdim=True) for x in xs]
    ys = [y - y.mean(0, keepdim=True) for y in ys]
    cross = np.array([[float((y.T @ x).square().sum()) for y in ys] for x in xs])
    nx = np.array([float(torch.linalg.matrix_norm(x.T @ x)) for x in xs])
    ny = np.array([float(torch.linalg.matrix_norm(y.T @ y)) for y in ys])
    return cross, nx, ny


def cka_from_cross(cross: np.ndarray, nx: np.ndarray, ny: np.ndarray) -> np.ndarray:
    """CKA matrix [I, J] from cross_products' output (0 where a state is constant)."""
    denom = nx[:, None] * ny[None, :]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, cross / np.where(denom > 0, denom, 1.0), 0.0)


@torch.no_grad()
def collect_states(model: EngramLM, windows: list[Window], *, batch_size: int = 8,
                   progress: bool = False) -> tuple[list[torch.Tensor], np.ndarray]:
    """(state k, after k blocks (0: embeddings), float64 [n, d] at the windows' valid positions; window [n] of each)."""
    modules = [model.tok_emb, *model.blocks]
    parts: list[list[torch.Tensor]] = [[] for _ in modules]
    owner: list[np.ndarray] = []
    valid = None

    def keep(k: int):
        def hook(module, args, output):
            parts[k].append((output[0] if isinstance(output, tuple) else output)[valid].double().cpu())
        return hook

    handles = [m.register_forward_hook(keep(k)) for k, m in enumerate(modules)]
    try:
        for idx, x, y in eval_batches(model, windows, batch_size, "layer states", progress):
            valid = y != -100
            model(x)
            owner.append(np.repeat(np.array(idx), valid.sum(1).cpu().numpy()))
    finally:
        for h in handles:
            h.remove()
    return [torch.cat(p) for p in parts], np.concatenate(owner)


@dataclass
class LayerComparison:
    """CKA between every layer of A (rows) and of B (columns), with the alignment summary."""

    model_a: str
    model_b: str
    split: str
    positions: int
    cka: list[list[float]]  # [La + 1][Lb + 1]; layer k = residual stream after k blocks
    half_spread: float  # max |CKA(half 1) - CKA(half 2)| over all pairs: the sampling noise scale
    best_match: list[int]  # per A layer: the B layer of highest CKA
    soft_index: list[float]  # per A layer: CKA-weighted mean index of B's top-3 matches


def alignment(cka: np.ndarray, top: int = TOP) -> tuple[list[int], list[float]]:
    """(argmax B layer per A layer, soft alignment index per A layer: CKA-weighted mean of the top-`top` B layers)."""
    best = [int(i) for i in cka.argmax(1)]
    soft = []
    for row in cka:
        idx = np.argsort(-row)[:min(top, len(row))]
        w = row[idx]
        soft.append(float((w * idx).sum() / w.sum()) if w.sum() > 0 else float("nan"))
    return best, soft


def compare_layers(a: EngramLM, b: EngramLM, windows: list[Window], *, batch_size: int = 8, model_a: str = "A",
                   model_b: str = "B", split: str = "", progress: bool = False) -> LayerComparison:
    """Linear CKA between every residual-stream state of a and of b on the same windows (one tokenizer)."""
    if b.config.max_seq < max(len(w.inputs) for w in windows):
        raise ValueError(f"model B's context ({b.config.max_seq}) is shorter than the windows")
    xs, owner = collect_states(a, windows, batch_size=batch_size, progress=progress)
    ys, _ = collect_states(b, windows, batch_size=batch_size, progress=progress)
    cka = cka_from_cross(*cross_products(xs, ys))
    halves = []
    for h in (0, 1):
        m = torch.from_numpy(owner % 2 == h)
        halves.append(cka_from_cross(*cross_products([x[m] for x in xs], [y[m] for y in ys])))
    best, soft = alignment(cka)
    return LayerComparison(model_a=model_a, model_b=model_b, split=split, positions=len(owner),
                           cka=cka.tolist(), half_spread=float(np.abs(halves[0] - halves[1]).max()),
                           best_match=best, soft_index=soft)


def verdict(result: LayerComparison) -> str:
    """One sentence: do A's early blocks match deeper layers of B by more than the sampling spread?"""
    n = len(result.cka) - 1
    early = range(1, max(2, n // 2 + 1))
    cka = np.array(result.cka)
    mean = float(np.mean([result.soft_index[j] - j for j in early]))
    ahead = [j for j in early if result.best_match[j] > j
             and cka[j, result.best_match[j]] - cka[j, min(j, cka.shape[1] - 1)] > result.half_spread]
    text = (f"A's blocks 1..{early[-1]} sit on average {mean:+.2f} layers from B's by the soft alignment index; "
            f"{len(ahead)} of {len(early)} match a deeper layer of B better than their own depth by more than the "
            f"sampling spread ({result.half_spread:.3f})")
    if ahead:
        return text + " — A's early layers look like deeper layers of B"
    return text + " — no sign, beyond noise, that A's early layers look like deeper layers of B"


def to_markdown(result: LayerComparison) -> str:
    """The CKA matrix and the alignment as markdown."""
    table = md_table(["A \\ B", *map(str, range(len(result.cka[0]))), "best B", "soft index"],
                     ([i, *(f"{v:.3f}" for v in row), result.best_match[i], f"{result.soft_index[i]:.2f}"]
                      for i, row in enumerate(result.cka)))
    return "\n".join([f"# Layer similarity (linear CKA): A = {result.model_a}, B = {result.model_b}", "",
                      f"Split `{result.split}`, {result.positions} positions. Layer k = residual stream after k "
                      f"blocks (0 = embeddings). Sampling spread (max |half 1 - half 2|): {result.half_spread:.4f}.",
                      "", table, "", f"**{verdict(result)}.**", ""])


def plot(result: LayerComparison, path: str) -> None:
    """Heat map of the CKA matrix (A layers down, B layers across) with the soft alignment index, to a PNG."""
    cka = np.array(result.cka)
    fig, ax = subplots(figsize=(1.1 * cka.shape[1] + 2.5, 0.9 * cka.shape[0] + 1.8))
    im = ax.imshow(cka, vmin=0, vmax=1, cmap="magma", origin="upper")
    for i in range(cka.shape[0]):
        for j in range(cka.shape[1]):
            ax.text(j, i, f"{cka[i, j]:.2f}", ha="center", va="center", fontsize=8,
                    color="black" if cka[i, j] > 0.6 else "white")
    ax.plot(result.soft_index, range(cka.shape[0]), "c.-", label="soft alignment index")
    ax.set_xticks(range(cka.shape[1]))
    ax.set_yticks(range(cka.shape[0]))
    ax.set_xlabel(f"B: {result.model_b} (layer = blocks done)")
    ax.set_ylabel(f"A: {result.model_a}")
    ax.set_title(f"linear CKA, {result.positions} positions (half spread {result.half_spread:.3f})", fontsize=9)
    ax.legend(loc="lower left", fontsize=7)
    fig.colorbar(im, ax=ax, label="CKA")
    save_figure(fig, Path(path))
