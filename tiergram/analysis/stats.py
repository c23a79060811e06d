"""Bootstrap intervals for the study tools (per-document loss means, paired differences, rates) and the markdown
the study reports print them in."""

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


def mean_estimate(values: np.ndarray, seed: int = 0) -> Estimate:
    """Mean of per-unit values (e.g. exact-match 0/1 per task) with its bootstrap interval."""
    values = np.asarray(values, dtype=np.float64)
    return ratio_estimate(values, np.ones_like(values), seed)


def interval(e: Estimate | dict[str, Any], spec: str = "+.4f") -> str:
    """'value [low, high]' of an Estimate (or its JSON form), every number in one format spec."""
    value, (low, high) = (e["value"], e["ci95"]) if isinstance(e, dict) else (e.value, e.ci95)
    return f"{value:{spec}} [{low:{spec}}, {high:{spec}}]"


def md_table(head: list[str], rows: Iterable[Iterable[Any]]) -> str:
    """A markdown table (no trailing newline): the header, its rule, one line per row of cells."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])
