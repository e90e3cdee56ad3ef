"""Learning-rate schedules as pure functions of the optimizer step.

A schedule is a function ``(step, total_steps, base_lr, warmup_steps) -> lr`` registered
by name in :data:`SCHEDULES`. Being a pure function of the step, it needs no state of its
own beyond the step, which is what a checkpoint stores; a resumed run gets the same rates.

Examples
--------
>>> [round(lr_at("cosine", s, total_steps=4, base_lr=1.0, warmup_steps=0), 3) for s in range(4)]
[1.0, 0.854, 0.5, 0.146]
>>> [lr_at("step", s, total_steps=8, base_lr=1.0, warmup_steps=2) for s in (0, 1, 5, 7)]
[0.5, 1.0, 0.1, 0.010000000000000002]
"""

from __future__ import annotations

import math
from collections.abc import Callable

from rapydli.errors import ConfigError

Schedule = Callable[[int, int, float], float]


def constant(step: int, total_steps: int, base_lr: float) -> float:
    """The base rate throughout."""
    return base_lr


def cosine(step: int, total_steps: int, base_lr: float) -> float:
    """Half a cosine from ``base_lr`` at step 0 towards 0 at ``total_steps``."""
    progress = min(1.0, step / max(1, total_steps))
    return base_lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def multistep(step: int, total_steps: int, base_lr: float) -> float:
    """``base_lr``, times 0.1 from 50% of the steps, times 0.01 from 75%."""
    factor = 1.0
    for milestone in (0.5, 0.75):
        if step >= int(milestone * total_steps):
            factor *= 0.1
    return base_lr * factor


#: Schedules by the name ``TrainConfig.lr_schedule`` uses.
SCHEDULES: dict[str, Schedule] = {"constant": constant, "cosine": cosine, "step": multistep}


def lr_at(name: str, step: int, total_steps: int, base_lr: float, warmup_steps: int = 0) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then schedule ``name``.

    During warm-up the rate rises linearly to ``base_lr`` (step ``i`` gets
    ``base_lr * (i + 1) / warmup_steps``); the schedule then runs over the remaining
    ``total_steps - warmup_steps`` steps.
    """
    if name not in SCHEDULES:
        raise ConfigError(f"lr_schedule={name!r} is unknown; allowed: {', '.join(SCHEDULES)}")
    if step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    return SCHEDULES[name](step - warmup_steps, max(1, total_steps - warmup_steps), base_lr)
