"""The degrade policy: under I/O pressure skip Engram reads before letting steps stall (docs/engine.md)."""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from tiergram.engine.config import DegradePolicy

MAX_LEVEL = 2


class Degrader:
    """The degrade level, moved after each step by the stall average; which positions skip their reads."""

    def __init__(self, policy: DegradePolicy, predictor: Any | None = None) -> None:
        self.policy = policy
        self.predictor = predictor  # a SkipPredictor (predict_skip) or None: level 1 at most
        if predictor is None and policy.predictor_path is not None:
            from tiergram.engram.skip import SkipPredictor  # loaded only when a policy names one
            self.predictor = SkipPredictor.load(policy.predictor_path)
        self.level = 0
        self.stalls: deque[float] = deque(maxlen=policy.window_steps)
        self.dwell = 0  # steps run at the current level
        self.level_steps = dict.fromkeys(range(MAX_LEVEL + 1), 0)
        self.skipped_rows = 0

    def skip_positions(self, layer: int, row_ids: np.ndarray, positions: np.ndarray, decode: np.ndarray
                       ) -> np.ndarray | None:
        """bool [N] of positions skipping this layer's reads (None: none); row_ids [N, H], positions, decode [N]."""
        if self.level == 0:
            return None
        skip = decode.copy()
        layers = getattr(self.predictor, "layers", None)
        if self.level >= 2 and (~decode).any() and (layers is None or layer in layers):
            prefill = ~decode
            mask = np.asarray(self.predictor.predict_skip(layer, row_ids[prefill], positions[prefill]))
            skip[prefill] = mask.reshape(mask.shape[0], -1).all(axis=1)  # whole positions
        return skip if skip.any() else None

    def observe(self, stall_s: float, skipped_rows: int) -> None:
        """Count a step run at the current level, then move the level by the stall average."""
        self.level_steps[self.level] += 1
        self.skipped_rows += skipped_rows
        bound = self.policy.stall_bound_s
        if bound is None:
            return
        self.stalls.append(stall_s)
        self.dwell += 1
        avg = sum(self.stalls) / len(self.stalls)
        settled = self.dwell >= self.policy.window_steps  # the window holds only this level's steps
        top = MAX_LEVEL if self.predictor is not None else 1
        if avg >= bound and self.level < top and (self.level == 0 or settled):
            self.level, self.dwell = self.level + 1, 0
        elif avg < bound * self.policy.recover_factor and self.level > 0 and settled:
            self.level, self.dwell = self.level - 1, 0
