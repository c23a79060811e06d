"""The sparse-allocation sweep: at one fixed budget of sparse parameters, move capacity from MoE experts to Engram.

Every model of a sweep has the same dense part (embeddings, attention, block 0's dense FFN, the routers) and the
same per-token compute (top-k routed experts of a fixed width; an Engram lookup costs the same whatever the
table's size). What varies is how the sparse parameters, routed-expert weights + Engram table values, are split:
Engram share s puts about s * budget into the tables (rows per hash head sized to fit) and the rest into experts
(whole experts, at least top_k per MoE block). The budget is the expert parameters of the share-0 model. Each
model trains on the same token budget with the same seed(s), then all are scored on the same validation documents,
so the loss differences between shares are paired over documents.

The DeepSeek Engram paper and a replication at ~6e18 FLOPs found a U: loss falls as the share grows from 0, then
rises again when too few experts are left. `verdict` says a U appears only when the lowest loss is at an interior
share and both end points are worse than it with 95% paired intervals above zero. Those intervals cover the
evaluation sample (documents), not training noise: with one seed a difference between two shares can still be
seed luck, which only more seeds measure.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.analysis.stats import Estimate, paired_ratio_delta, ratio_estimate
from tiergram.model.config import EngramSettings, ModelConfig, MoESettings
from tiergram.plots import save_figure, subplots


@dataclass
class AllocationConfig:
    """A sweep's settings: the shares, the seeds, the token budget and the fixed geometry."""

    out: str  # folder of the sweep: one run directory per (share, seed), sweep.json
    shares: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8)  # Engram share of the sparse parameters
    seeds: tuple[int, ...] = (0,)
    tokens: int = 262144  # training tokens per model
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    dense_ffn: int = 344  # block 0's dense SwiGLU width
    max_seq: int = 128
    expert_ffn: int = 128  # width of each routed expert
    top_k: int = 2
    experts_at_zero: int = 16  # routed experts per MoE block at share 0: this fixes the sparse budget
    engram_dim: int = 32
    n_head_per_ngram: int = 2
    batch_size: int = 16
    lr: float = 3e-3
    warmup_steps: int = 20
    eval_tokens: int = 16384  # validation tokens per category
    corpus: str | None = None
    device: str = "auto"

    def __post_init__(self) -> None:
        self.shares, self.seeds = tuple(float(s) for s in self.shares), tuple(int(s) for s in self.seeds)
        if not self.shares or any(not 0 <= s < 1 for s in self.shares) or len(set(self.shares)) != len(self.shares):
            raise ValueError(f"shares must be distinct values in [0, 1), got {self.shares}")
        if not self.seeds or self.tokens < 1 or self.experts_at_zero < self.top_k or self.n_layers < 2:
            raise ValueError("need a seed, a positive token budget, experts_at_zero >= top_k and >= 2 layers")

    @property
    def moe_layers(self) -> list[int]:
        """Every block but the first routes (DeepSeek keeps its first blocks dense)."""
        return list(range(1, self.n_layers))

    @property
    def engram_layers(self) -> list[int]:
        """Block 1 and mid-depth, as the small preset (1 and 2 of 4)."""
        return sorted({1, self.n_layers // 2})

    @property
    def expert_size(self) -> int:
        """Parameters of one routed expert (SwiGLU: three d x ffn matrices)."""
        return 3 * self.d_model * self.expert_ffn

    @property
    def budget(self) -> int:
        """The sparse-parameter budget: the share-0 model's routed-expert parameters."""
        return len(self.moe_layers) * self.experts_at_zero * self.expert_size


@dataclass
class Point:
    """One trained model of the sweep."""

    share: float  # nominal Engram share
    seed: int
    run: str  # run directory (relative to the sweep folder)
    n_experts: int
    rows_per_head: int  # 0: no Engram
    expert_params: int
    table_params: int
    actual_share: float  # table_params / (expert_params + table_params)
    steps: int = 0
    elapsed_s: float = 0.0
    loss: Estimate | None = None  # validation nats/token, document-bootstrap 95% interval


@dataclass
class ShareResult:
    """A share over its seeds: loss of the seed-mean per-document sums, and its paired delta against the best share."""

    share: float
    actual_share: float
    n_experts: int
    loss: Estimate
    seed_losses: list[float]
    delta_vs_best: Estimate | None = None


@dataclass
class AllocationReport:
    """The sweep's points, the per-share summary and the verdict."""

    config: dict[str, Any]
    budget: int
    points: list[Point]
    shares: list[ShareResult] = field(default_factory=list)
    verdict: str = ""


def geometry(cfg: AllocationConfig, share: float, vocab_size: int, pad_id: int) -> tuple[ModelConfig, int, int]:
    """(model config, experts per MoE block, rows per hash head) of one share of the sweep."""
    n_moe = len(cfg.moe_layers)
    n_experts = max(cfg.top_k, round((1 - share) * cfg.budget / (n_moe * cfg.expert_size)))
    engram = None
    rows = 0
    if share > 0:
        heads = (3 - 1) * cfg.n_head_per_ngram  # orders 2..3
        rows = max(1, round(share * cfg.budget / (len(cfg.engram_layers) * heads * cfg.engram_dim)))
        engram = EngramSettings(layers=cfg.engram_layers, max_ngram_size=3, n_head_per_ngram=cfg.n_head_per_ngram,
                                engram_vocab_size=[rows, rows], dim=cfg.engram_dim, pad_id=pad_id)
    mconfig = ModelConfig(vocab_size=vocab_size, d_model=cfg.d_model, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                          n_kv_heads=cfg.n_kv_heads, ffn=cfg.dense_ffn, max_seq=cfg.max_seq, engram=engram,
                          moe=MoESettings(layers=cfg.moe_layers, n_experts=n_experts, top_k=cfg.top_k,
                                          expert_ffn=cfg.expert_ffn))
    return mconfig, n_experts, rows


def table_params(mconfig: ModelConfig) -> int:
    """Engram table values of a config (the hasher's prime head sizes x row dim, over the Engram layers)."""
    if mconfig.engram is None:
        return 0
    from tiergram.model.model import make_hasher

    hasher = make_hasher(mconfig)
    return sum(sum(hasher.head_sizes(layer)) * mconfig.engram.dim for layer in mconfig.engram.layers)


def plan(cfg: AllocationConfig, vocab_size: int, pad_id: int) -> list[tuple[Point, ModelConfig]]:
    """Every (point, model config) of the sweep, seeds outermost so a cut-short sweep has whole seeds."""
    out = []
    for seed in cfg.seeds:
        for share in cfg.shares:
            mconfig, n_experts, rows = geometry(cfg, share, vocab_size, pad_id)
            experts = mconfig.moe.expert_params(cfg.d_model)
            tables = table_params(mconfig)
            out.append((Point(share=share, seed=seed, run=f"share{round(share * 100):02d}-s{seed}",
                              n_experts=n_experts, rows_per_head=rows, expert_params=experts, table_params=tables,
                              actual_share=tables / (experts + tables)), mconfig))
    return out


def _finished(run: Path) -> dict[str, Any] | None:
    """The training summary of a finished run directory, else None."""
    config = run / "config.json"
    if not config.is_file():
        return None
    training = json.loads(config.read_text()).get("training") or {}
    return training if training.get("finished") else None


def run_sweep(cfg: AllocationConfig, *, progress: bool = True) -> AllocationReport:
    """Train every point (a finished run directory is reused), score all on the same validation documents."""
    import torch
    from tqdm import tqdm

    from tiergram.corpus import PAD, ensure_corpus, load_tokenizer
    from tiergram.model.checkpoint import load_pretrained, write_json
    from tiergram.model.evaluate import eval_documents, score_documents
    from tiergram.model.train import TrainConfig, train
    from tiergram.tiers.device import resolve_device

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = ensure_corpus(cfg.corpus, progress=progress)  # a missing corpus / tokenizer is built first, as train does
    tokenizer = load_tokenizer(corpus / "tokenizer.json")
    pad = tokenizer.token_to_id(PAD)
    if pad is None:
        raise ValueError(f"the tokenizer has no {PAD} token to left-pad n-grams with")
    points = plan(cfg, tokenizer.get_vocab_size(), pad)
    write_json(out / "allocation_config.json", asdict(cfg))
    docs = eval_documents(corpus, "validation", tokenizer, max_tokens_per_category=cfg.eval_tokens)
    if not docs:
        raise ValueError(f"the validation split of {corpus} has no documents")
    doc_sums: dict[tuple[float, int], np.ndarray] = {}
    counts = np.zeros(len(docs))
    device = resolve_device(cfg.device)
    bar = tqdm(points, desc="allocation sweep", unit="model", disable=not progress)
    for point, mconfig in bar:
        bar.set_postfix(share=f"{point.share:.0%}", seed=point.seed, experts=point.n_experts)
        run = out / point.run
        summary = _finished(run)
        if summary is None:
            tcfg = TrainConfig(out=str(run), config="allocation", seed=point.seed, tokens=cfg.tokens,
                               batch_size=cfg.batch_size, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                               checkpoint_every=10**9, eval_tokens=cfg.eval_tokens, corpus=str(corpus),
                               device=cfg.device)
            train(tcfg, resume=(run / "checkpoint.pt").is_file(), progress=progress, evaluate_at_end=False,
                  model_config=mconfig)
            summary = _finished(run)
        point.steps, point.elapsed_s = int(summary["steps"]), float(summary["elapsed_s"])
        model, _ = load_pretrained(run, device=device)
        if model.config != mconfig:
            raise ValueError(f"{run} holds a model of another geometry than this sweep's {point.run}")
        for d in docs:
            d.loss_sum, d.count = 0.0, 0
        with torch.no_grad():
            score_documents(model, docs, batch_size=cfg.batch_size, progress=False)
        sums = np.array([d.loss_sum for d in docs])
        counts = np.array([d.count for d in docs], dtype=np.float64)
        doc_sums[(point.share, point.seed)] = sums
        point.loss = ratio_estimate(sums, counts)
        write_json(out / "sweep.json", asdict(AllocationReport(asdict(cfg), cfg.budget, [p for p, _ in points])))
    bar.close()
    report = summarize(cfg, [p for p, _ in points], doc_sums, counts)
    write_json(out / "sweep.json", asdict(report))
    return report


def summarize(cfg: AllocationConfig, points: list[Point], doc_sums: dict[tuple[float, int], np.ndarray],
              counts: np.ndarray) -> AllocationReport:
    """Per-share losses (seed-mean per-document sums), paired deltas against the best share, and the verdict."""
    shares = []
    mean_sums = {}
    for share in cfg.shares:
        mine = [p for p in points if p.share == share and (share, p.seed) in doc_sums]
        if not mine:
            continue
        mean_sums[share] = np.mean([doc_sums[(share, p.seed)] for p in mine], axis=0)
        shares.append(ShareResult(share=share, actual_share=mine[0].actual_share, n_experts=mine[0].n_experts,
                                  loss=ratio_estimate(mean_sums[share], counts),
                                  seed_losses=[p.loss.value for p in mine]))
    report = AllocationReport(config=asdict(cfg), budget=cfg.budget, points=points, shares=shares)
    if shares:
        best = min(shares, key=lambda s: s.loss.value)
        for s in shares:
            s.delta_vs_best = paired_ratio_delta(mean_sums[best.share], mean_sums[s.share], counts)
        report.verdict = verdict(shares, len(cfg.seeds))
    return report


def verdict(shares: list[ShareResult], n_seeds: int) -> str:
    """Whether a U appears: an interior minimum with both end points worse by a 95% interval above zero."""
    if len(shares) < 3:
        return f"{len(shares)} shares cannot show a U (at least 3 are needed)"
    ordered = sorted(shares, key=lambda s: s.share)
    best = min(ordered, key=lambda s: s.loss.value)
    lo, hi = ordered[0], ordered[-1]
    noise = "" if n_seeds > 1 else " (intervals over validation documents only; one seed, so training noise " \
                                   "is not in them)"
    if best is lo or best is hi:
        side = "no Engram" if best is lo and best.share == 0 else f"Engram share {best.share:.0%}"
        return f"no U: the lowest loss is at an end of the sweep ({side}, {best.loss.value:.4f} nats){noise}"
    worse = [s for s in (lo, hi) if s.delta_vs_best.ci95[0] > 0]
    if len(worse) == 2:
        return (f"a U appears: the lowest loss is at Engram share {best.share:.0%} ({best.loss.value:.4f} nats), "
                f"and share {lo.share:.0%} (+{lo.delta_vs_best.value:.4f}) and share {hi.share:.0%} "
                f"(+{hi.delta_vs_best.value:.4f}) are both worse{noise}")
    return (f"no clear U: the lowest loss is at Engram share {best.share:.0%} ({best.loss.value:.4f} nats), but "
            f"{'neither end point is' if not worse else 'only one end point is'} worse by more than the 95% "
            f"interval{noise}")


def to_markdown(report: AllocationReport) -> str:
    """The sweep as markdown: one row per share, then the verdict."""
    c = report.config
    lines = [f"# Allocation sweep: {report.budget / 1e6:.2f}M sparse parameters, {c['tokens']:,} tokens per model",
             "", f"d_model {c['d_model']}, {c['n_layers']} blocks, MoE in blocks {list(range(1, c['n_layers']))} "
                 f"(top-{c['top_k']} of N experts of width {c['expert_ffn']}), seeds {list(c['seeds'])}; "
                 f"validation loss in nats/token over {c['eval_tokens']} tokens per category, 95% document-bootstrap "
                 "intervals; Δ paired against the best share.", "",
             "| Engram share (actual) | experts per block | rows per head | loss | Δ vs best | per seed |",
             "|---|---|---|---|---|---|"]
    rows = {p.share: p.rows_per_head for p in report.points}
    for s in report.shares:
        d = s.delta_vs_best
        lines.append(f"| {s.share:.0%} ({s.actual_share:.1%}) | {s.n_experts} | {rows[s.share]} | {s.loss.value:.4f} "
                     f"[{s.loss.ci95[0]:.4f}, {s.loss.ci95[1]:.4f}] | {d.value:+.4f} [{d.ci95[0]:+.4f}, "
                     f"{d.ci95[1]:+.4f}] | {', '.join(f'{v:.4f}' for v in s.seed_losses)} |")
    lines += ["", f"**{report.verdict}.**", ""]
    return "\n".join(lines)


def plot(report: AllocationReport, path: str | os.PathLike) -> None:
    """Two panels against the actual Engram share, to a PNG: validation loss (95% intervals over documents, one dot
    per seed), and its paired difference from the best share (the comparison the verdict uses)."""
    fig, (ax, bx) = subplots(1, 2, figsize=(11, 4.2))
    x = np.array([s.actual_share * 100 for s in report.shares])
    for axis, key in ((ax, "loss"), (bx, "delta_vs_best")):
        est = [getattr(s, key) for s in report.shares]
        y = np.array([e.value for e in est])
        err = np.array([[e.value - e.ci95[0] for e in est], [e.ci95[1] - e.value for e in est]])
        axis.errorbar(x, y, yerr=err, fmt="o-", capsize=4)
        axis.set_xlabel("Engram share of the sparse parameters (%)")
    for s in report.shares:
        ax.plot([s.actual_share * 100] * len(s.seed_losses), s.seed_losses, "k.", alpha=0.5)
    ax.set_ylabel("validation loss (nats/token), 95% CI over documents")
    bx.axhline(0, color="gray", lw=0.8)
    bx.set_ylabel("Δ loss vs the best share (paired over documents)")
    fig.suptitle(f"{report.budget / 1e6:.2f}M sparse parameters, {report.config['tokens']:,} tokens per model, "
                 f"seeds {list(report.config['seeds'])}", fontsize=9)
    save_figure(fig, Path(path))


def config_from_args(out: str, **overrides: Any) -> AllocationConfig:
    """An AllocationConfig with the given fields replaced (None values keep the defaults)."""
    base = AllocationConfig(out=out)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})
