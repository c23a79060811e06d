"""Per-row statistics of a model's training run, for skip baselines that need nothing from the evaluation text: row
ids are a pure function of the tokens, so replaying the run's seeded WindowSampler for its step count recounts
exactly the rows it read."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tiergram.analysis.trace import EngramHooks
from tiergram.model.data import WindowSampler, tokenize_split
from tiergram.model.model import EngramLM


@dataclass
class TrainingRows:
    """Access counts and gate sums per flat table row (head offsets as the hasher's), per Engram layer."""

    source: str  # which training batches were replayed
    tokens_counted: int  # training tokens hashed for the counts
    tokens_gated: int  # of those, tokens run through the model for the gates
    counts: dict[int, np.ndarray]  # layer -> int64 [rows]: reads of each row in the counted tokens
    gate_sum: dict[int, np.ndarray]  # layer -> float64 [rows]: sum of the reading positions' gates
    gate_n: dict[int, np.ndarray]  # layer -> int64 [rows]: reads in the gated tokens

    def rare_score(self, layer: int, offsets: np.ndarray, row_ids: np.ndarray) -> np.ndarray:
        """Mean log(1 + training reads) of each position's rows [N] from row ids [N, H]; low = rarely seen."""
        return np.log1p(self.counts[layer][row_ids + offsets]).mean(1)

    def gate_score(self, layer: int, offsets: np.ndarray, row_ids: np.ndarray, shrink: float = 2.0) -> np.ndarray:
        """Mean training gate of each position's rows [N] from row ids [N, H], shrunk `shrink` reads to the mean."""
        n, s = self.gate_n[layer], self.gate_sum[layer]
        prior = s.sum() / max(n.sum(), 1)
        flat = row_ids + offsets
        return ((s[flat] + shrink * prior) / (n[flat] + shrink)).mean(1)


def training_windows(model_dir: str | os.PathLike, corpus: str | os.PathLike, max_seq: int
                     ) -> tuple[WindowSampler, int, str]:
    """(sampler, steps, source) replaying the batches of the `tiergram train` run in model_dir."""
    cfg_path, log_path = Path(model_dir) / "train_config.json", Path(model_dir) / "train_log.jsonl"
    if not cfg_path.is_file() or not log_path.is_file():
        raise ValueError(f"{model_dir} has no train_config.json and train_log.jsonl of a training run to replay "
                         "(the train-rare and train-gate methods need them)")
    cfg = json.loads(cfg_path.read_text())
    steps = max((int(json.loads(line)["step"]) for line in log_path.read_text().splitlines() if line.strip()),
                default=0)
    tokens = tokenize_split(corpus, "train", Path(corpus) / "tokenizer.json", progress=False)
    sampler = WindowSampler(tokens, int(cfg["batch_size"]), max_seq, int(cfg["seed"]))
    return sampler, steps, (f"replay of the training run's {steps} batches of {cfg['batch_size']} x {max_seq} tokens "
                            f"(seed {cfg['seed']})")


@torch.no_grad()
def training_rows(model: EngramLM, model_dir: str | os.PathLike, corpus: str | os.PathLike, *,
                  gate_tokens: int = 131072, progress: bool = False) -> TrainingRows:
    """Count every row read of the training windows; run the model over the first gate_tokens for mean gates."""
    from tqdm import tqdm

    model.eval()
    device = next(model.parameters()).device
    sampler, steps, source = training_windows(model_dir, corpus, model.config.max_seq)
    size = {layer: int(sum(model.hasher.head_sizes(layer))) for layer in model.engram_layers}
    offsets = {layer: np.asarray(model.hasher.head_offsets(layer), dtype=np.int64) for layer in model.engram_layers}
    counts = {layer: np.zeros(n, dtype=np.int64) for layer, n in size.items()}
    gate_sum = {layer: np.zeros(n) for layer, n in size.items()}
    gate_n = {layer: np.zeros(n, dtype=np.int64) for layer, n in size.items()}
    hooks = EngramHooks(record=True)
    counted = gated = 0
    for _ in tqdm(range(steps), desc="training rows", unit="batch", disable=not progress):
        x, _ = sampler.next()
        x = torch.from_numpy(x)
        rows = {layer: r.cpu().numpy() + offsets[layer] for layer, r in model.engram_row_ids(x).items()}
        for layer, r in rows.items():
            counts[layer] += np.bincount(r.ravel(), minlength=size[layer])
        counted += x.numel()
        if gated < gate_tokens:
            with hooks.installed(model):
                model(x.to(device))
            for layer, r in rows.items():
                # the position's gate as the skip decision sees it: the largest over hyper-connection branches
                g = hooks.gates[layer].float().amax(-1).cpu().numpy()  # [B, T]
                gate_sum[layer] += np.bincount(r.ravel(), np.repeat(g.ravel(), r.shape[-1]), minlength=size[layer])
                gate_n[layer] += np.bincount(r.ravel(), minlength=size[layer])
            gated += x.numel()
    return TrainingRows(source=source, tokens_counted=counted, tokens_gated=gated, counts=counts,
                        gate_sum=gate_sum, gate_n=gate_n)
