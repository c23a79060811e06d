"""Training loop: AdamW (+ SparseAdam for the Engram tables), warm-up + cosine, checkpoints, exact resume
(docs/model.md)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from tiergram.corpus import PAD, ensure_corpus, load_tokenizer
from tiergram.model.checkpoint import CHECKPOINT, load_checkpoint, save_checkpoint, save_pretrained, write_json
from tiergram.model.config import ModelConfig, preset
from tiergram.model.data import WindowSampler, tokenize_split
from tiergram.model.model import EngramLM, make_hasher
from tiergram.model.moe import aux_loss as moe_aux_loss
from tiergram.tiers.device import resolve_device

LOG = "train_log.jsonl"
PROBE_STEPS = (2, 10)  # a time budget sizes the schedule from the mean time of these steps of the first run


@dataclass
class TrainConfig:
    """A training run's settings (saved in the checkpoint; a resumed run uses the saved ones)."""

    out: str
    config: str = "small"  # model preset: small | tiny | small-moe | tiny-moe
    engram: bool = True  # False: the same backbone without Engram layers
    seed: int = 0
    tokens: int | None = None  # token budget (training tokens, B*T per step) ...
    minutes: float | None = None  # ... or wall-clock budget
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine ends at lr * min_lr_ratio
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # on the dense parameters' gradient norm
    table_lr_mult: float = 5.0  # SparseAdam learning rate = lr * table_lr_mult
    checkpoint_every: int = 250
    eval_tokens: int | None = 131072  # per category in the end-of-training evaluation (None: all)
    corpus: str | None = None  # corpus folder (default: tiergram.corpus.corpus_dir())
    device: str = "auto"  # auto: cuda when available, else cpu

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.minutes is None):
            raise ValueError("give exactly one budget: tokens or minutes")
        if (self.tokens is not None and self.tokens < 1) or (self.minutes is not None and self.minutes <= 0):
            raise ValueError("the budget must be positive")
        if self.batch_size < 1 or self.lr <= 0 or self.warmup_steps < 0 or self.checkpoint_every < 1:
            raise ValueError("batch_size, lr and checkpoint_every must be positive, warmup_steps >= 0")

    @classmethod
    def load(cls, out: str | Path) -> TrainConfig:
        """The settings a run in `out` was started with (its train_config.json)."""
        path = Path(out) / "train_config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no training run in {out} (no train_config.json) to resume")
        return cls(**{**json.loads(path.read_text()), "out": str(out)})


def make_optimizers(model: EngramLM, cfg: TrainConfig) -> tuple[torch.optim.AdamW, torch.optim.SparseAdam | None]:
    """AdamW over the dense weights (decay on matrices only) and SparseAdam over the Engram tables."""
    tables = {id(p) for p in model.table_parameters()}
    dense = [p for p in model.parameters() if id(p) not in tables]
    decay = [p for p in dense if p.ndim >= 2]
    no_decay = [p for p in dense if p.ndim < 2]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    table_params = model.table_parameters()
    sparse = (torch.optim.SparseAdam(table_params, lr=cfg.lr * cfg.table_lr_mult, betas=(0.9, 0.95))
              if table_params else None)
    return adamw, sparse


def lr_at(step: int, cfg: TrainConfig, total_steps: int | None) -> float:
    """Linear warm-up to lr over warmup_steps, then cosine decay to lr * min_lr_ratio at total_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if total_steps is None or total_steps <= cfg.warmup_steps:
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))


def train(cfg: TrainConfig, *, resume: bool = False, progress: bool = True, stop_after: int | None = None,
          evaluate_at_end: bool = True, model_config: ModelConfig | None = None) -> dict[str, Any]:
    """Train (or resume) into cfg.out, stopping this run after stop_after steps; {steps, tokens, loss, ...}."""
    out = Path(cfg.out)
    ckpt_path = out / CHECKPOINT
    state = None
    if resume:
        state = load_checkpoint(ckpt_path)
        if {**state["train_config"], "out": ""} != {**dataclasses.asdict(cfg), "out": ""}:
            raise ValueError(f"the settings differ from the ones {ckpt_path} was trained with; resume with "
                             "TrainConfig.load(out)")
    elif ckpt_path.exists():
        raise FileExistsError(f"{out} already holds a training checkpoint; pass --resume or another --out")
    out.mkdir(parents=True, exist_ok=True)
    device = resolve_device(cfg.device)
    corpus = ensure_corpus(cfg.corpus, progress=progress)  # builds a missing corpus / tokenizer first
    tok_path = corpus / "tokenizer.json"
    tokenizer = load_tokenizer(tok_path)
    mconfig = model_config or preset(cfg.config, tokenizer.get_vocab_size())
    if model_config is None and not cfg.engram:
        mconfig = mconfig.without_engram()
    elif model_config is None:
        if tokenizer.token_to_id(PAD) is None:
            raise ValueError(f"the tokenizer has no {PAD} token to left-pad n-grams with")
        mconfig.engram.pad_id = tokenizer.token_to_id(PAD)

    torch.manual_seed(cfg.seed)
    hasher = make_hasher(mconfig, tokenizer=tokenizer) if mconfig.engram is not None else None
    model = EngramLM(mconfig, hasher).to(device)
    adamw, sparse = make_optimizers(model, cfg)
    sampler = WindowSampler(tokenize_split(corpus, "train", tok_path, progress=progress), cfg.batch_size,
                            mconfig.max_seq, cfg.seed)
    tokens_per_step = cfg.batch_size * mconfig.max_seq
    step, elapsed = 0, 0.0
    total_steps = -(-cfg.tokens // tokens_per_step) if cfg.tokens is not None else None
    if total_steps is not None and total_steps < 2 * cfg.warmup_steps and progress:
        print(f"warning: {total_steps} steps is little more than the {cfg.warmup_steps} warm-up steps; "
              "lower --warmup-steps", file=sys.stderr)
    if state is not None:
        if state["model_config"] != mconfig.to_dict():
            raise ValueError("the checkpoint's model config differs from the one its settings give now "
                             "(did the tokenizer change?)")
        model.load_state_dict(state["model"])
        adamw.load_state_dict(state["adamw"])
        if sparse is not None:
            sparse.load_state_dict(state["sparse_adam"])
        sampler.set_state(state["sampler"])
        torch.set_rng_state(state["torch_rng"])
        step, elapsed, total_steps = state["step"], state["elapsed_s"], state["total_steps"]
    else:
        write_json(out / "train_config.json", dataclasses.asdict(cfg))
    # a resumed run redoes the steps after its checkpoint: their log records go
    logged = (out / LOG).read_text().splitlines() if (out / LOG).is_file() else []
    (out / LOG).write_text("".join(line + "\n" for line in logged if line.strip() and json.loads(line)["step"] <= step))

    def checkpoint() -> None:
        save_checkpoint(ckpt_path, {
            "train_config": dataclasses.asdict(cfg), "model_config": mconfig.to_dict(), "model": model.state_dict(),
            "adamw": adamw.state_dict(), "sparse_adam": sparse.state_dict() if sparse is not None else None,
            "sampler": sampler.state(), "torch_rng": torch.get_rng_state(), "step": step,
            "elapsed_s": elapsed, "total_steps": total_steps})

    def done() -> bool:
        if total_steps is not None and step >= total_steps:
            return True
        return cfg.minutes is not None and elapsed >= cfg.minutes * 60

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")
    counts = model.num_params()
    bar = tqdm(total=total_steps, initial=step, unit="step", disable=not progress,
               desc=f"train {'engram' if mconfig.engram else 'no-engram'} "
                    f"({counts['backbone'] / 1e6:.1f}M + {counts['tables'] / 1e6:.1f}M table)")
    model.train()
    run_steps, probe_t0 = 0, None
    recent: list[float] = []
    log = open(out / LOG, "a")
    try:
        while not done() and (stop_after is None or run_steps < stop_after):
            t0 = time.perf_counter()
            lr = lr_at(step, cfg, total_steps)
            for group in adamw.param_groups:
                group["lr"] = lr
            if sparse is not None:
                sparse.param_groups[0]["lr"] = lr * cfg.table_lr_mult
            x, y = (torch.from_numpy(a).to(device) for a in sampler.next())
            with autocast:
                logits, _ = model(x)
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            balance = moe_aux_loss(model)  # MoE load-balancing term (None for a dense model); not in the logged loss
            adamw.zero_grad(set_to_none=True)
            if sparse is not None:
                sparse.zero_grad(set_to_none=True)
            (loss if balance is None else loss + balance).backward()
            dense = [p for g in adamw.param_groups for p in g["params"] if p.grad is not None]
            grad_norm = float(torch.nn.utils.clip_grad_norm_(dense, cfg.grad_clip))
            adamw.step()
            if sparse is not None:
                sparse.step()
            step, run_steps = step + 1, run_steps + 1
            loss_value = loss.item()
            dt = time.perf_counter() - t0
            elapsed += dt
            recent = (recent + [loss_value])[-20:]
            log.write(json.dumps({"step": step, "tokens": step * tokens_per_step, "loss": loss_value, "lr": lr,
                                  "grad_norm": grad_norm, "elapsed_s": round(elapsed, 3),
                                  "tok_s": round(tokens_per_step / dt, 1)}) + "\n")
            log.flush()
            if total_steps is None and cfg.minutes is not None:  # size the schedule from the step time
                if run_steps == PROBE_STEPS[0]:
                    probe_t0 = elapsed
                elif run_steps == PROBE_STEPS[1]:
                    per_step = (elapsed - probe_t0) / (PROBE_STEPS[1] - PROBE_STEPS[0])
                    total_steps = step + int((cfg.minutes * 60 - elapsed) / per_step)
                    bar.total = total_steps
                    if total_steps < 2 * cfg.warmup_steps:
                        tqdm.write(f"warning: the budget allows ~{total_steps} steps, little more than the "
                                   f"{cfg.warmup_steps} warm-up steps; lower --warmup-steps")
            bar.update(1)
            bar.set_postfix(loss=f"{sum(recent) / len(recent):.3f}", tok_s=f"{tokens_per_step / dt:.0f}",
                            lr=f"{lr:.1e}")
            if step % cfg.checkpoint_every == 0:
                checkpoint()
    finally:
        log.close()
        bar.close()
    checkpoint()
    finished = done()
    summary: dict[str, Any] = {"steps": step, "tokens": step * tokens_per_step,
                               "loss": sum(recent) / len(recent) if recent else None,
                               "elapsed_s": round(elapsed, 1), "finished": finished, "eval": None}
    save_pretrained(model, out, tokenizer=tok_path,
                    extra={"training": {k: summary[k] for k in ("steps", "tokens", "elapsed_s", "finished")}
                           | {"seed": cfg.seed, "engram": cfg.engram, "preset": cfg.config}})
    if finished and evaluate_at_end:
        from tiergram.model.evaluate import evaluate, format_eval

        result = evaluate(model, corpus, "validation", tokenizer, max_tokens_per_category=cfg.eval_tokens,
                          progress=progress)
        result["training"] = {k: summary[k] for k in ("steps", "tokens", "elapsed_s")}
        write_json(out / "eval.json", result)
        if progress:
            print(format_eval(result))
        summary["eval"] = result
    return summary
