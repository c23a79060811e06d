"""How fast this machine runs right now: a CPU speed probe taken around a measurement."""

from __future__ import annotations

import time

import numpy as np


def cpu_speed_ms(seconds: float = 1.0) -> float:
    """Milliseconds of one fixed engine-step-shaped CPU workload (48 small torch matmuls + GELUs), the median of
    repeats over `seconds`: taken around a measurement, it says whether a shared VM's speed moved meanwhile."""
    import torch

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(512, 512, generator=gen) / 23 for _ in range(4)]
    x0 = torch.randn(16, 512, generator=gen)

    def once() -> torch.Tensor:
        x = x0
        for _ in range(12):
            for w in weights:
                x = torch.nn.functional.gelu(x @ w)
        return x

    once()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))
