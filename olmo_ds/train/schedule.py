"""Learning-rate schedules: linear warmup, then cosine, linear, warmup-stable-decay or constant.

The schedule is a pure function of the optimizer step, so resuming needs only the step number, and
the trainer writes the value into the optimizer's param groups itself instead of handing DeepSpeed a
stateful scheduler object.
"""

from __future__ import annotations

import math

from olmo_ds.train.config import ScheduleConfig


def lr_at(step: int, *, peak_lr: float, max_steps: int, cfg: ScheduleConfig) -> float:
    """The learning rate for optimizer step `step` (0-based) of a run of `max_steps` steps."""
    final = peak_lr * cfg.final_lr_fraction
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return peak_lr * (step + 1) / cfg.warmup_steps
    if cfg.kind == "constant":
        return peak_lr
    if cfg.kind == "wsd":
        decay_start = max_steps - cfg.decay_steps
        if step < decay_start:
            return peak_lr
        progress = (step - decay_start + 1) / cfg.decay_steps
    else:
        span = max(max_steps - cfg.warmup_steps, 1)
        progress = (step - cfg.warmup_steps + 1) / span
    progress = min(max(progress, 0.0), 1.0)
    if cfg.kind == "cosine":
        return final + (peak_lr - final) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak_lr + (final - peak_lr) * progress  # linear, and wsd's linear decay
