"""The learning-rate schedule: a pure function of the step being taken.

For the step s = 1 … S being taken (S = `--steps`), with N warm-up steps:

    s <= N           lr · s / N                                     (linear warm-up)
    then, with t = (s - N) / (S - N):
      none           lr
      linear         lr - (lr - min_lr) · t
      cosine         min_lr + (lr - min_lr) · (1 + cos(pi t)) / 2
      wsd            lr until the last F·S steps, then linear to min_lr over them

Nothing here has state: a run resumed at step k computes the same curve from k + 1 on, since
the step is in the checkpoint.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("none", "linear", "cosine", "wsd")


@dataclass(frozen=True)
class Schedule:
    """`launch.py`'s schedule options: peak `lr`, `warmup` steps, `decay` (one of DECAYS) to
    `min_lr` by step `steps`, and for wsd the `decay_fraction` of the steps that decay."""

    lr: float
    steps: int
    warmup: int = 0
    decay: str = "none"
    min_lr: float = 0.0
    decay_fraction: float = 0.2

    def at(self, step: int) -> float:
        """The learning rate of step `step` (1-based: the first step taken is 1)."""
        if step <= self.warmup:
            return self.lr * step / self.warmup
        span = self.lr - self.min_lr
        if self.decay == "wsd":
            decaying = self.decay_fraction * self.steps
            start = self.steps - decaying
            if step <= start or decaying <= 0:
                return self.lr
            return self.lr - span * (step - start) / decaying
        t = (step - self.warmup) / (self.steps - self.warmup)
        if self.decay == "cosine":
            return self.min_lr + span * (1 + math.cos(math.pi * t)) / 2
        if self.decay == "linear":
            return self.lr - span * t
        return self.lr
