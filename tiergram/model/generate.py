"""Text generation with the K/V cache: prefill the prompt once, then decode one token per forward."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from tiergram.model.model import EngramLM
from tiergram.model.sampling import sample_token


@dataclass
class Generation:
    """Generated ids and timings."""

    ids: list[int]  # the generated tokens only
    prefill_s: float
    decode_s: float

    @property
    def decode_tok_s(self) -> float:
        """Decode tokens per second (after the first token)."""
        return (len(self.ids) - 1) / self.decode_s if len(self.ids) > 1 and self.decode_s > 0 else 0.0


@torch.no_grad()
def generate(model: EngramLM, prompt_ids: list[int], max_tokens: int = 64, *, temperature: float = 0.0,
             top_k: int | None = None, seed: int = 0, stop_ids: Iterable[int] = (),
             engram_enabled: bool | Iterable[int] = True,
             on_token: Callable[[int], None] | None = None) -> Generation:
    """Continue prompt_ids by up to max_tokens tokens (fewer at a stop id or at max_seq)."""
    if not prompt_ids:
        raise ValueError("the prompt is empty; give at least one token")
    if len(prompt_ids) >= model.config.max_seq:
        raise ValueError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {model.config.max_seq}")
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    stop = set(stop_ids)
    max_tokens = min(max_tokens, model.config.max_seq - len(prompt_ids))
    t0 = time.perf_counter()
    logits, past = model(torch.tensor([prompt_ids], device=device), use_cache=True, engram_enabled=engram_enabled)
    prefill_s = time.perf_counter() - t0
    out: list[int] = []
    t1 = time.perf_counter()
    for i in range(max_tokens):
        token = sample_token(logits[0, -1], temperature, top_k, 1.0, generator)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if token in stop or i == max_tokens - 1:
            break
        logits, past = model(torch.tensor([[token]], device=device), past, engram_enabled=engram_enabled)
    return Generation(out, prefill_s, time.perf_counter() - t1)
