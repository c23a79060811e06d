"""Bootstrap and over-seed intervals for the study tools, and the markdown the study reports print them in."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

BOOTSTRAP = 1000


@dataclass
class Estimate:
    """A mean with its 95% bootstrap interval."""

    value: float
    ci95: list[float]
    n: int  # resampled units (documents or tasks)


def ratio_estimate(sums: np.ndarray, counts: np.ndarray, seed: int = 0) -> Estimate:
    """sum(sums) / sum(counts), resampling units (documents: tokens of a document are correlated)."""
    sums, counts = np.asarray(sums, dtype=np.float64), np.asarray(counts, dtype=np.float64)
    if counts.sum() == 0:
        return Estimate(float("nan"), [float("nan"), float("nan")], len(sums))
    idx = np.random.default_rng(seed).integers(0, len(sums), size=(BOOTSTRAP, len(sums)))
    with np.errstate(invalid="ignore", divide="ignore"):
        boot = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = np.nanpercentile(boot, [2.5, 97.5])
    return Estimate(float(sums.sum() / counts.sum()), [float(lo), float(hi)], len(sums))


def paired_ratio_delta(sums_a: np.ndarray, sums_b: np.ndarray, counts: np.ndarray, seed: int = 0) -> Estimate:
    """(sum(b) - sum(a)) / sum(counts) over the same units, with the paired bootstrap interval."""
    return ratio_estimate(np.asarray(sums_b, dtype=np.float64) - np.asarray(sums_a, dtype=np.float64), counts, seed)


def seed_interval(values: list[float]) -> list[float] | None:
    """Two-sided 95% t interval of the mean of per-seed values (None below 2 values)."""
    from scipy import stats

    if len(values) < 2:
        return None
    v = np.asarray(values, dtype=np.float64)
    half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return [float(v.mean() - half), float(v.mean() + half)]


def seed_delta(sums_a: list[np.ndarray], sums_b: list[np.ndarray],
               counts: np.ndarray) -> tuple[Estimate, list[float], list[float] | None]:
    """loss(b) - loss(a) over models on the same units: of the model-mean sums, per model, t interval over models."""
    per = [float((b.sum() - a.sum()) / counts.sum()) for a, b in zip(sums_a, sums_b, strict=True)]
    return paired_ratio_delta(np.mean(sums_a, 0), np.mean(sums_b, 0), counts), per, seed_interval(per)


def seed_cells(delta: Estimate | dict[str, Any], per: list[float], ci: list[float] | None) -> str:
    """The cells 'Δ [unit interval] | per-seed Δ | [t interval over seeds]' of a comparison over seeds."""
    over = "–" if ci is None else f"[{ci[0]:+.4f}, {ci[1]:+.4f}]"
    return f"{interval(delta)} | " + ", ".join(f"{v:+.4f}" for v in per) + f" | {over}"


def yerr(est: list[Estimate]) -> np.ndarray:
    """[2, n] error-bar lengths (below, above) of estimates, as matplotlib's errorbar takes them."""
    return np.array([[e.value - e.ci95[0] for e in est], [e.ci95[1] - e.value for e in est]])


def interval(e: Estimate | dict[str, Any], spec: str = "+.4f") -> str:
    """'value [low, high]' of an Estimate (or its JSON form), every number in one format spec."""
    value, (low, high) = (e["value"], e["ci95"]) if isinstance(e, dict) else (e.value, e.ci95)
    return f"{value:{spec}} [{low:{spec}}, {high:{spec}}]"


def md_table(head: list[str], rows: Iterable[Iterable[Any]]) -> str:
    """A markdown table (no trailing newline): the header, its rule, one line per row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
