"""The sparse-allocation sweep (docs/findings.md section 6): at one budget of sparse parameters (the share-0 model's
routed experts), Engram share s puts about s of it into the tables and the rest into whole experts; the MoE-only
controls ("tokens": same experts and tokens, "compute": tokens x the measured step-time ratio) and Engram-off
scores separate what the tables add from having fewer experts."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiergram.analysis.stats import Estimate, ratio_estimate
from tiergram.model.config import EngramSettings, ModelConfig, MoESettings

CONTROL_KINDS = ("tokens", "compute")


@dataclass
class AllocationConfig:
    """A sweep's settings: the shares, the seeds, the token budget, the controls and the fixed geometry."""

    out: str  # folder of the sweep: one run directory per model, sweep.json, step_ratios.json
    shares: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8)  # Engram share of the sparse parameters
    seeds: tuple[int, ...] = (0,)
    tokens: int = 262144  # training tokens per model
    controls: tuple[str, ...] = ()  # MoE-only controls per share > 0: "tokens" (same tokens), "compute" (same compute)
    train: bool = True  # False: report the finished runs only, train nothing
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
        self.controls = tuple(self.controls)
        if not self.shares or any(not 0 <= s < 1 for s in self.shares) or len(set(self.shares)) != len(self.shares):
            raise ValueError(f"shares must be distinct values in [0, 1), got {self.shares}")
        if not self.seeds or self.tokens < 1 or self.experts_at_zero < self.top_k or self.n_layers < 2:
            raise ValueError("need a seed, a positive token budget, experts_at_zero >= top_k and >= 2 layers")
        if any(c not in CONTROL_KINDS for c in self.controls):
            raise ValueError(f"controls must be among {', '.join(CONTROL_KINDS)}, got {', '.join(self.controls)}")

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

    def public(self) -> dict[str, Any]:
        """The settings as a result file records them: folders by name only, not this machine's paths."""
        return asdict(self) | {"out": Path(self.out).name, "corpus": self.corpus and Path(self.corpus).name}


@dataclass
class Point:
    """One trained model: a sweep point (kind "sweep") or a MoE-only control of a share ("tokens", "compute")."""

    share: float  # nominal Engram share (of the sweep point, or of the share whose experts a control has)
    seed: int
    run: str  # run directory (relative to the sweep folder)
    n_experts: int
    rows_per_head: int  # 0: no Engram
    expert_params: int
    table_params: int
    actual_share: float  # table_params / (expert_params + table_params)
    kind: str = "sweep"
    tokens: int = 0  # training tokens (a "compute" control's are the sweep's times the step-time ratio)
    steps: int = 0
    elapsed_s: float = 0.0
    step_s: float = 0.0  # median training step time from the run's log
    loss: Estimate | None = None  # validation nats/token, document-bootstrap 95% interval
    loss_off: Estimate | None = None  # the same with Engram off at every position (Engram models only)


@dataclass
class StepRatio:
    """Training step time of share s's Engram model over its MoE-only control, measured by interleaved steps."""

    share: float
    ratio: float  # median over rounds of (Engram model's step time / control's)
    engram_step_s: list[float]  # per round, mean seconds per step
    control_step_s: list[float]


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


def run_name(kind: str, share: float, n_experts: int, seed: int) -> str:
    """share80-s0 (sweep), moe03-s0 (MoE-only, same tokens), moe03-compute-s0 (MoE-only, same compute)."""
    if kind == "sweep":
        return f"share{round(share * 100):02d}-s{seed}"
    return f"moe{n_experts:02d}{'-compute' if kind == 'compute' else ''}-s{seed}"


def plan(cfg: AllocationConfig, vocab_size: int, pad_id: int) -> list[tuple[Point, ModelConfig]]:
    """Every (point, model config) of the sweep and its controls, seeds outermost (a cut-short sweep: whole seeds)."""
    out = []
    for seed in cfg.seeds:
        for share in cfg.shares:
            mconfig, n_experts, rows = geometry(cfg, share, vocab_size, pad_id)
            experts = mconfig.moe.expert_params(cfg.d_model)
            tables = table_params(mconfig)
            kinds = ["sweep"] + (list(cfg.controls) if share > 0 and n_experts < cfg.experts_at_zero else [])
            for kind in kinds:
                sweep = kind == "sweep"
                out.append((Point(share=share, seed=seed, run=run_name(kind, share, n_experts, seed),
                                  n_experts=n_experts, rows_per_head=rows if sweep else 0, expert_params=experts,
                                  table_params=tables if sweep else 0, actual_share=tables / (experts + tables),
                                  kind=kind, tokens=cfg.tokens if kind != "compute" else 0),
                            mconfig if sweep else mconfig.without_engram()))
    return out


def _finished(run: Path) -> dict[str, Any] | None:
    """The training summary of a finished run directory, else None."""
    config = run / "config.json"
    if not config.is_file():
        return None
    training = json.loads(config.read_text()).get("training") or {}
    return training if training.get("finished") else None


def median_step_s(run: Path) -> float:
    """Median seconds per training step in a run's log (robust to the odd step slowed by other work)."""
    from tiergram.model.train import LOG

    rows = [json.loads(line) for line in (run / LOG).read_text().splitlines() if line.strip()]
    times = np.diff([0.0] + [r["elapsed_s"] for r in rows])
    return float(np.median(times)) if len(times) else 0.0


def measure_step_ratio(share: float, engram: ModelConfig, control: ModelConfig, cfg: AllocationConfig,
                       corpus: Path, *, rounds: int = 5, steps: int = 4) -> StepRatio:
    """Alternate `rounds` x `steps` training steps of both models on the same batches (load falls on both alike)."""
    import torch
    import torch.nn.functional as F

    from tiergram.corpus import load_tokenizer
    from tiergram.model.data import WindowSampler, tokenize_split
    from tiergram.model.model import EngramLM, make_hasher
    from tiergram.model.moe import aux_loss
    from tiergram.model.train import TrainConfig, make_optimizers
    from tiergram.tiers.device import resolve_device

    device = resolve_device(cfg.device)
    tok_path = corpus / "tokenizer.json"
    tcfg = TrainConfig(out="", config="allocation", lr=cfg.lr, batch_size=cfg.batch_size, tokens=cfg.tokens)
    tokenizer = load_tokenizer(tok_path)
    sampler = WindowSampler(tokenize_split(corpus, "train", tok_path, progress=False), cfg.batch_size, cfg.max_seq)
    batches = [tuple(torch.from_numpy(a).to(device) for a in sampler.next()) for _ in range(steps)]
    models = []
    for mconfig in (engram, control):
        torch.manual_seed(0)
        hasher = make_hasher(mconfig, tokenizer=tokenizer) if mconfig.engram is not None else None
        model = EngramLM(mconfig, hasher).to(device).train()
        models.append((model, *make_optimizers(model, tcfg)))

    def step(model, adamw, sparse, x, y) -> None:  # the training step of tiergram.model.train, without logging
        logits, _ = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        balance = aux_loss(model)
        adamw.zero_grad(set_to_none=True)
        if sparse is not None:
            sparse.zero_grad(set_to_none=True)
        (loss if balance is None else loss + balance).backward()
        torch.nn.utils.clip_grad_norm_([p for g in adamw.param_groups for p in g["params"] if p.grad is not None],
                                       tcfg.grad_clip)
        adamw.step()
        if sparse is not None:
            sparse.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for m in models:  # warm-up: first-call allocations and optimizer state
        step(*m, *batches[0])
    times: list[list[float]] = [[], []]
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate who goes first
        for i in order:
            t0 = time.perf_counter()
            for x, y in batches:
                step(*models[i], x, y)
            times[i].append((time.perf_counter() - t0) / steps)
    ratios = [a / b for a, b in zip(*times, strict=True)]
    return StepRatio(share=share, ratio=float(np.median(ratios)), engram_step_s=times[0], control_step_s=times[1])


def _step_ratio(cfg: AllocationConfig, share: float, vocab_size: int, pad: int, corpus: Path,
                measure: bool) -> StepRatio | None:
    """The sweep folder's step-time ratio for a share (measured once and kept, so a control's tokens never move)."""
    path = Path(cfg.out) / "step_ratios.json"
    known = json.loads(path.read_text()) if path.is_file() else {}
    key = f"{share:g}"
    if key not in known and measure:
        engram, _, _ = geometry(cfg, share, vocab_size, pad)
        known[key] = asdict(measure_step_ratio(share, engram, engram.without_engram(), cfg, corpus))
        path.write_text(json.dumps(known, indent=1) + "\n")
    return StepRatio(**known[key]) if key in known else None


def _scores(run: Path, model: Any, docs: list[Any], cfg: AllocationConfig) -> dict[str, np.ndarray]:
    """Per-document validation loss sums (Engram on, and off) and token counts, kept in the run's scores.npz."""
    from tiergram.model.evaluate import score_documents

    path = run / "scores.npz"
    if path.is_file():
        kept = dict(np.load(path))
        if int(kept["eval_tokens"]) == cfg.eval_tokens and len(kept["counts"]) == len(docs):
            return kept
    out = {"eval_tokens": np.array(cfg.eval_tokens)}
    for name, enabled in (("on", True), ("off", False)) if model.engram_layers else (("on", True),):
        for d in docs:
            d.loss_sum, d.count = 0.0, 0
        score_documents(model, docs, batch_size=cfg.batch_size, engram_enabled=enabled, progress=False)
        out[name] = np.array([d.loss_sum for d in docs])
    out["counts"] = np.array([d.count for d in docs], dtype=np.float64)
    np.savez(path, **out)
    return out


@dataclass
class SweepRun:
    """What run_sweep hands the report: the points, their per-document sums, and the step-time ratios."""

    cfg: AllocationConfig
    points: list[Point]
    sums: dict[str, dict[str, np.ndarray]]  # run -> {"on", "off"?} per-document loss sums
    counts: np.ndarray  # tokens per document
    step_ratios: list[StepRatio] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # runs not finished (train=False)


def run_sweep(cfg: AllocationConfig, *, progress: bool = True) -> SweepRun:
    """Train every point (reusing finished runs) and score all on the same validation documents."""
    from tqdm import tqdm

    from tiergram.corpus import PAD, ensure_corpus, load_tokenizer
    from tiergram.model.checkpoint import load_pretrained
    from tiergram.model.evaluate import eval_documents
    from tiergram.model.train import TrainConfig, train
    from tiergram.tiers.device import resolve_device

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    corpus = ensure_corpus(cfg.corpus, progress=progress)  # a missing corpus / tokenizer is built first, as train does
    tokenizer = load_tokenizer(corpus / "tokenizer.json")
    pad = tokenizer.token_to_id(PAD)
    vocab = tokenizer.get_vocab_size()
    planned = plan(cfg, vocab, pad)
    docs = eval_documents(corpus, "validation", tokenizer, max_tokens_per_category=cfg.eval_tokens)
    if not docs:
        raise ValueError(f"the validation split of {corpus} has no documents")
    result = SweepRun(cfg, [], {}, np.zeros(len(docs)))
    ratios: dict[float, StepRatio] = {}
    device = resolve_device(cfg.device)
    bar = tqdm(planned, desc="allocation sweep", unit="model", disable=not progress)
    for point, mconfig in bar:
        bar.set_postfix(run=point.run)
        run = out / point.run
        summary = _finished(run)
        if point.kind == "compute":
            ratio = _step_ratio(cfg, point.share, vocab, pad, corpus, measure=summary is None and cfg.train)
            if ratio is not None:
                ratios[point.share] = ratio
                point.tokens = int(np.ceil(cfg.tokens * ratio.ratio))
        if summary is None and cfg.train:
            tcfg = TrainConfig(out=str(run), config="allocation", seed=point.seed, tokens=point.tokens,
                               batch_size=cfg.batch_size, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                               checkpoint_every=10**9, eval_tokens=cfg.eval_tokens, corpus=str(corpus),
                               device=cfg.device)
            train(tcfg, resume=(run / "checkpoint.pt").is_file(), progress=progress, evaluate_at_end=False,
                  model_config=mconfig)
            summary = _finished(run)
        if summary is None:
            result.missing.append(point.run)
            continue
        point.steps, point.elapsed_s = int(summary["steps"]), float(summary["elapsed_s"])
        point.tokens, point.step_s = int(summary["tokens"]), median_step_s(run)
        model, _ = load_pretrained(run, device=device)
        if model.config != mconfig:
            raise ValueError(f"{run} holds a model of another geometry than this sweep's {point.run}")
        scores = _scores(run, model, docs, cfg)
        result.counts = scores["counts"]
        result.sums[point.run] = {k: scores[k] for k in ("on", "off") if k in scores}
        point.loss = ratio_estimate(scores["on"], scores["counts"])
        if "off" in scores:
            point.loss_off = ratio_estimate(scores["off"], scores["counts"])
        result.points.append(point)
    bar.close()
    result.step_ratios = [ratios[s] for s in sorted(ratios)]
    return result

