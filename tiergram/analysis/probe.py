"""Gate probe (docs/findings.md section 1): each position's gate is attributed to every n-gram (order 2..max) ending
there, in compressed ids, so an n-gram's mean gate is the mean over its occurrences."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tiergram.analysis.capacity import basic_interval
from tiergram.analysis.stats import BOOTSTRAP, Estimate, interval, md_table, ratio_estimate
from tiergram.analysis.trace import Trace
from tiergram.corpus import CATEGORIES

PAD_TEXT = "<pad>"


@dataclass
class NgramGate:
    """One n-gram's gate statistics in one layer."""

    order: int
    text: str  # the original tokens of its first occurrence (compression merges case/whitespace variants)
    compressed: list[int]
    count: int
    mean_gate: float
    category_share: dict[str, float]
    examples: list[str]  # decoded text around occurrences, the n-gram in ⟦ ⟧


@dataclass
class LayerProbe:
    """Gate summary and the highest/lowest mean-gate n-grams of one layer."""

    layer: int
    mean_gate: float
    quantiles: dict[str, float]  # p01, p10, p50, p90, p99
    mean_gate_by_category: dict[str, float]
    attributed: dict[int, int]  # order -> attributed occurrences (= positions)
    distinct: dict[int, int]  # order -> distinct n-grams
    top: dict[int, list[NgramGate]] = field(default_factory=dict)  # order -> highest mean gate first
    bottom: dict[int, list[NgramGate]] = field(default_factory=dict)  # order -> lowest mean gate first


@dataclass
class GateEvidence:
    """Whether a layer's gate depends on the n-gram (against a gate shuffle) and on the category."""

    layer: int
    order: int
    ngrams: int
    positions: int  # positions of those n-grams
    between_share: Estimate  # with its basic bootstrap interval over resampled documents
    shuffle_null: list[float]  # [mean, 95th percentile] over the permutations
    mean_gate: Estimate
    category_gate: dict[str, Estimate]
    code_minus_prose: Estimate


@dataclass
class ProbeReport:
    """The whole probe: per layer, over a corpus split; evidence for the trained model and a null."""

    model: str
    split: str
    positions: int
    min_count: int
    layers: list[LayerProbe]
    evidence: dict[str, list[GateEvidence]] = field(default_factory=dict)  # "trained" / "random-init" -> rows


@dataclass
class NgramTable:
    """The distinct n-grams of one order in a trace: keys [U, n], inverse [N], counts [U]."""

    keys: np.ndarray
    inverse: np.ndarray
    counts: np.ndarray


def ngram_table(tr: Trace, order: int) -> NgramTable:
    """Group the trace's positions by the n-gram of this order that ends at them."""
    keys, inverse, counts = np.unique(tr.context[:, -order:], axis=0, return_inverse=True, return_counts=True)
    return NgramTable(keys, inverse.reshape(-1), counts)


def _render(tokenizer: Any, ids: Any) -> str:
    """Decode ids keeping special tokens visible."""
    return tokenizer.decode([int(i) for i in ids], skip_special_tokens=False) if len(ids) else ""


def example(tokenizer: Any, tr: Trace, i: int, order: int, before: int = 10, after: int = 3) -> str:
    """The text around position i: `…before⟦n-gram⟧after…`."""
    inputs = tr.windows[int(tr.window[i])].inputs
    p = int(tr.pos[i])
    start = p - order + 1
    pads = PAD_TEXT * max(0, -start)
    gram = pads + _render(tokenizer, inputs[max(0, start):p + 1])
    return (_render(tokenizer, inputs[max(0, start - before):max(0, start)]) + "⟦" + gram + "⟧"
            + _render(tokenizer, inputs[p + 1:p + 1 + after]))


def _ngram_gate(tokenizer: Any, tr: Trace, table: NgramTable, u: int, order: int, mean: float,
                n_examples: int) -> NgramGate:
    where = np.flatnonzero(table.inverse == u)
    text = example(tokenizer, tr, int(where[0]), order, 0, 0)[1:-1]  # the first occurrence's tokens, no ⟦ ⟧
    cats = np.bincount(tr.category[where], minlength=len(CATEGORIES)) / len(where)
    return NgramGate(order=order, text=text, compressed=[int(v) for v in table.keys[u]], count=int(len(where)),
                     mean_gate=float(mean), category_share={c: float(s) for c, s in zip(CATEGORIES, cats, strict=True)},
                     examples=[example(tokenizer, tr, int(i), order) for i in where[:n_examples]])


def probe_layer(tr: Trace, tokenizer: Any, layer: int, tables: dict[int, NgramTable], *, min_count: int = 5,
                top: int = 30, n_examples: int = 3) -> LayerProbe:
    """Gate summary and top/bottom n-grams of one layer (the model has one hyper-connection branch)."""
    g = tr.gates[layer][:, 0].astype(np.float64)
    qs = (0.01, 0.1, 0.5, 0.9, 0.99)
    by_cat = {c: float(g[tr.category == k].mean()) for k, c in enumerate(CATEGORIES) if (tr.category == k).any()}
    out = LayerProbe(layer=layer, mean_gate=float(g.mean()),
                     quantiles={f"p{int(q * 100):02d}": float(v) for q, v in zip(qs, np.quantile(g, qs), strict=True)},
                     mean_gate_by_category=by_cat, attributed={}, distinct={})
    for order, table in tables.items():
        sums = np.bincount(table.inverse, weights=g, minlength=len(table.counts))
        means = sums / table.counts
        out.attributed[order] = int(table.counts.sum())
        out.distinct[order] = len(table.counts)
        eligible = np.flatnonzero(table.counts >= min_count)
        ranked = eligible[np.argsort(-means[eligible], kind="stable")]
        out.top[order] = [_ngram_gate(tokenizer, tr, table, int(u), order, means[u], n_examples) for u in ranked[:top]]
        out.bottom[order] = [_ngram_gate(tokenizer, tr, table, int(u), order, means[u], n_examples)
                             for u in ranked[::-1][:top]]
    return out


def probe(tr: Trace, tokenizer: Any, *, model: str = "", split: str = "", min_count: int = 5, top: int = 30,
          n_examples: int = 3) -> ProbeReport:
    """Probe every Engram layer of a trace."""
    tables = {order: ngram_table(tr, order) for order in range(2, tr.context.shape[1] + 1)}
    layers = [probe_layer(tr, tokenizer, layer, tables, min_count=min_count, top=top, n_examples=n_examples)
              for layer in tr.layers]
    return ProbeReport(model=model, split=split, positions=tr.n, min_count=min_count, layers=layers)


def between_share(g: np.ndarray, groups: np.ndarray, weight: np.ndarray | None = None) -> float:
    """Eta squared of g [N] over groups [N], each position counted `weight` [N] times (None: once)."""
    w = np.ones(len(g)) if weight is None else np.asarray(weight, dtype=np.float64)
    n = np.bincount(groups, weights=w)
    mean = (w * g).sum() / w.sum()
    means = np.bincount(groups, weights=w * g) / np.maximum(n, 1e-12)
    total = (w * (g - mean) ** 2).sum()
    return float((n * (means - mean) ** 2).sum() / total) if total > 0 else float("nan")


def _category_estimates(g: np.ndarray, doc: np.ndarray, category: np.ndarray, seed: int = 0
                        ) -> tuple[dict[str, Estimate], Estimate]:
    """Per-category mean gate over documents, and code minus prose (documents resampled within each category)."""
    out, boots = {}, {}
    for k, c in enumerate(CATEGORIES):
        sel = category == k
        if not sel.any():
            continue
        docs, inv = np.unique(doc[sel], return_inverse=True)
        sums, counts = np.bincount(inv, weights=g[sel]), np.bincount(inv).astype(np.float64)
        out[c] = ratio_estimate(sums, counts, seed)
        idx = np.random.default_rng(seed + k + 1).integers(0, len(docs), size=(BOOTSTRAP, len(docs)))
        boots[c] = sums[idx].sum(1) / counts[idx].sum(1)
    if "code" in out and "prose" in out:
        d = boots["code"] - boots["prose"]
        gap = Estimate(out["code"].value - out["prose"].value, [float(v) for v in np.percentile(d, [2.5, 97.5])],
                       out["code"].n + out["prose"].n)
    else:
        gap = Estimate(float("nan"), [float("nan"), float("nan")], 0)
    return out, gap


def gate_evidence(tr: Trace, *, min_count: int = 5, permutations: int = 200, seed: int = 0) -> list[GateEvidence]:
    """Per layer and order: between-n-gram share of gate variance vs its shuffle null; mean gate per category."""
    rng = np.random.default_rng(seed)
    doc = tr.documents()
    n_docs = int(doc.max()) + 1
    draws = [np.bincount(rng.integers(0, n_docs, n_docs), minlength=n_docs) for _ in range(BOOTSTRAP // 5)]
    out = []
    for layer in tr.layers:
        g = tr.gates[layer].max(axis=1).astype(np.float64)
        mean = ratio_estimate(np.bincount(doc, weights=g), np.bincount(doc).astype(np.float64), seed)
        by_cat, gap = _category_estimates(g, doc, tr.category, seed)
        for order in range(2, tr.context.shape[1] + 1):
            table = ngram_table(tr, order)
            keep = table.counts[table.inverse] >= min_count
            _, groups = np.unique(table.inverse[keep], return_inverse=True)
            gk = g[keep]
            null = [between_share(rng.permutation(gk), groups) for _ in range(permutations)]
            boot = [between_share(gk, groups, d[doc[keep]]) for d in draws]
            value = between_share(gk, groups)
            share = Estimate(value, basic_interval(value, boot), n_docs)
            out.append(GateEvidence(layer=layer, order=order, ngrams=int(groups.max() + 1) if len(groups) else 0,
                                    positions=int(keep.sum()), between_share=share,
                                    shuffle_null=[float(np.mean(null)), float(np.percentile(null, 95))],
                                    mean_gate=mean, category_gate=by_cat, code_minus_prose=gap))
    return out


def evidence_markdown(evidence: dict[str, list[GateEvidence]]) -> str:
    """One row per model, layer and order: mean gate, code minus prose, between-n-gram share vs its null."""
    return md_table(["model", "layer", "order", "mean gate [95% CI]", "code − prose [95% CI]", "n-grams",
                     "between-n-gram share of gate variance [95% CI]", "shuffle null (mean; 95th pct)"],
                    ([name, e.layer, e.order, interval(e.mean_gate, ".3f"), interval(e.code_minus_prose), e.ngrams,
                      interval(e.between_share, ".3f"), f"{e.shuffle_null[0]:.3f}; {e.shuffle_null[1]:.3f}"]
                     for name, rows in evidence.items() for e in rows)) + "\n"


def _cell(text: str, limit: int = 90) -> str:
    """Text safe inside a markdown table cell: visible whitespace, escaped pipes, shortened."""
    text = text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎").replace("\t", "⇥")
    text = text if len(text) <= limit else text[:limit - 1] + "…"
    return "`" + text.replace("`", "ˋ") + "`"


def to_markdown(report: ProbeReport) -> str:
    """The probe as a markdown report."""
    lines = [f"# Gate probe: {report.model}", "",
             f"Split `{report.split}`, {report.positions} positions; n-grams need at least {report.min_count} "
             "occurrences; text is the first occurrence's tokens (the hashing merges case and whitespace variants); "
             "⏎ is a newline.", ""]
    if report.evidence:
        lines += ["Gate (largest over branches) against chance: 95% document-bootstrap intervals; the shuffle null "
                  "permutes gates across the positions of the ranked n-grams.", "",
                  evidence_markdown(report.evidence).rstrip(), ""]
    for lp in report.layers:
        lines += [f"## Layer {lp.layer}", "",
                  f"Mean gate {lp.mean_gate:.4f}; quantiles " +
                  ", ".join(f"{k} {v:.4f}" for k, v in lp.quantiles.items()) + "; by category " +
                  ", ".join(f"{k} {v:.4f}" for k, v in lp.mean_gate_by_category.items()) + ".", ""]
        for order in lp.top:
            lines.append(f"Order {order}: {lp.distinct[order]} distinct n-grams over {lp.attributed[order]} positions.")
            lines.append("")
            for title, rows in (("highest", lp.top[order]), ("lowest", lp.bottom[order])):
                lines += [f"### Layer {lp.layer}, order {order}: {title} mean gate", "",
                          md_table(["#", "n-gram", "count", "mean gate", "code", "prose", "boilerplate", "example"],
                                   ([r, _cell(ng.text, 40), ng.count, f"{ng.mean_gate:.4f}",
                                     *(f"{ng.category_share.get(c, 0):.2f}" for c in CATEGORIES),
                                     _cell(ng.examples[0]) if ng.examples else ""] for r, ng in enumerate(rows, 1))),
                          ""]
    return "\n".join(lines)
