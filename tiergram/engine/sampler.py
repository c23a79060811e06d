"""Next tokens from last-token logits, one sequence at a time: forced (replay), greedy, or sample_token."""

from __future__ import annotations

import torch

from tiergram.engine.sequence import Sequence
from tiergram.model.sampling import MIN_TEMPERATURE, sample_token


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> list[int | Exception]:
    """logits float [B, V] -> per sequence its token, or the exception choosing it raised (it fails alone)."""
    finite = torch.isfinite(logits).all(-1).tolist()
    greedy = logits.argmax(-1).tolist()
    out: list[int | Exception] = []
    for b, seq in enumerate(seqs):
        p = seq.params
        try:
            if p.forced_tokens is not None:
                out.append(p.forced_tokens[seq.num_tokens - seq.prompt_len])
            elif not finite[b]:
                sample_token(logits[b])  # raises NonFiniteLogitsError, with its message
            elif p.temperature < MIN_TEMPERATURE:
                out.append(int(greedy[b]))
            else:
                out.append(sample_token(logits[b], p.temperature, p.top_k, p.top_p, seq.generator))
        except Exception as e:  # noqa: BLE001 - isolated: this request fails, the step goes on
            out.append(e)
    return out
