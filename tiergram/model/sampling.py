"""The one sampling function (model.generate and the serving engine): greedy, or temperature, top-k and top-p."""

from __future__ import annotations

import torch

# below this temperature the distribution is the argmax to float precision (dividing by 1e-40 overflowed to NaN)
MIN_TEMPERATURE = 1e-5


class NonFiniteLogitsError(ValueError):
    """The logits of a sequence hold NaN or inf, so no token can be chosen from them."""


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """Next token from logits [V]: greedy below MIN_TEMPERATURE, else float64 softmax over top_k then top_p."""
    if logits.ndim != 1 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty vector [V], got shape {tuple(logits.shape)}")
    logits = logits.detach().cpu().double()
    if not bool(torch.isfinite(logits).all()):
        raise NonFiniteLogitsError("the model produced non-finite logits (NaN or inf); no token can be sampled")
    if not temperature >= MIN_TEMPERATURE:  # also NaN
        return int(logits.argmax())
    logits = logits / float(temperature)  # finite float32 values / >= 1e-5 stay far inside float64's range
    if top_k is not None and 0 < top_k < logits.numel():
        kth = torch.topk(logits, int(top_k)).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, -1)  # subtracts the max: the top token has probability > 0
    if top_p < 1:
        sorted_p, order = torch.sort(probs, descending=True)
        drop = torch.cumsum(sorted_p, 0) - sorted_p >= top_p  # the mass before a token already reaches top_p
        drop[0] = False
        sorted_p[drop] = 0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
    return int(torch.multinomial(probs, 1, generator=generator))
