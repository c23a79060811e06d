"""Next tokens from last-token logits: forced (replay), greedy, or temperature + top-k + top-p."""

from __future__ import annotations

import torch

from tiergram.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    """logits float [B, V] -> one token per sequence, by its SamplingParams."""
    greedy = logits.argmax(-1).tolist()
    out = []
    for b, seq in enumerate(seqs):
        p = seq.params
        if p.forced_tokens is not None:
            out.append(p.forced_tokens[seq.num_tokens - seq.prompt_len])
        elif p.temperature == 0:
            out.append(int(greedy[b]))
        else:
            out.append(sample_one(logits[b], p.temperature, p.top_k, p.top_p, seq.generator))
    return out


def sample_one(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
               generator: torch.Generator | None) -> int:
    """logits [V] -> a token drawn from softmax(logits / temperature) restricted to the top_k, then the top_p mass."""
    logits = logits.float().cpu() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)
    if top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p >= top_p  # the mass before a token already reaches top_p
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
