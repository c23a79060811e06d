"""Helpers several test modules share (imported as `from support import ...`; pytest puts tests/ on sys.path)."""

from __future__ import annotations

import torch

from tiergram.model import EngramLM


@torch.no_grad()
def spread(model: EngramLM, seed: int) -> EngramLM:
    """Re-draw the dense weights larger than the training init (and the convs and biases non-zero), in eval mode.

    Greedy tokens then vary and depend on the Engram rows, their top-2 logit gaps (and MoE expert choices) are far
    above float rounding, so a test comparing two paths' tokens can fail when one path reads a wrong row.
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if p.ndim == 2 and "table" not in name and p is not model.tok_emb.weight or "short_conv.conv" in name \
                or name.endswith(".bias"):
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        elif "table" in name:
            p.copy_(torch.randn(p.shape, generator=g))  # rows of unit scale, so fp8 rounding visibly matters
    model.tok_emb.weight.mul_(10)
    return model.eval()
