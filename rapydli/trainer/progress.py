"""Where a run is: which epoch and batch each optimizer step reads, and how a run resumes.

A run that never changed its number of ranks reads epoch ``step // steps_per_epoch`` at
batch ``step % steps_per_epoch``. A run resumed from a checkpoint written by another
number of ranks first finishes the interrupted epoch (its remaining samples re-sharded
over the new ranks, see :func:`rapydli.data.sampler.rank_indices`), then reads whole
epochs again. :class:`EpochPlan` holds both cases; :func:`resized_config` decides what a
new world size does to the global batch and the learning rate.

Examples
--------
>>> plan = EpochPlan(steps_per_epoch=10, epochs=3)
>>> plan.locate(12), plan.total()
((1, 2, 10), 30)
>>> resumed = EpochPlan(steps_per_epoch=5, epochs=3, resumed_step=12, resumed_epoch=1, resumed_steps=4)
>>> resumed.locate(12), resumed.locate(16), resumed.total()
((1, 0, 4), (2, 0, 5), 21)
"""

from __future__ import annotations

from dataclasses import dataclass

from rapydli.errors import ConfigError
from rapydli.trainer.config import TrainConfig


@dataclass(frozen=True)
class EpochPlan:
    """The epochs of a run at this world size.

    Attributes
    ----------
    steps_per_epoch
        Optimizer steps of a whole epoch.
    epochs
        Epochs of the run.
    resumed_step, resumed_epoch, resumed_start, resumed_steps
        For a run resumed on another world size: the step it resumed at, the epoch it was
        in, the global position of that epoch's order it resumes from, and the steps left
        in that epoch (``None``: not such a run).
    """

    steps_per_epoch: int
    epochs: int
    resumed_step: int = 0
    resumed_epoch: int = 0
    resumed_start: int = 0
    resumed_steps: int | None = None

    def locate(self, step: int) -> tuple[int, int, int]:
        """``(epoch, steps done in it, steps that epoch has)`` for optimizer step ``step``."""
        if self.resumed_steps is None or step < self.resumed_step:
            epoch, done = divmod(step, self.steps_per_epoch)
            return epoch, done, self.steps_per_epoch
        if step < self.resumed_step + self.resumed_steps:
            return self.resumed_epoch, step - self.resumed_step, self.resumed_steps
        after = step - self.resumed_step - self.resumed_steps
        epoch, done = divmod(after, self.steps_per_epoch)
        return self.resumed_epoch + 1 + epoch, done, self.steps_per_epoch

    def total(self, max_steps: int | None = None) -> int:
        """Optimizer steps of the whole run (capped by ``max_steps``)."""
        if self.resumed_steps is None:
            total = self.steps_per_epoch * self.epochs
        else:
            total = (
                self.resumed_step + self.resumed_steps + self.steps_per_epoch * (self.epochs - self.resumed_epoch - 1)
            )
        return min(total, max_steps) if max_steps else total

    def position(self, step: int, global_batch: int) -> tuple[int, int]:
        """``(epoch, samples of its global order consumed)`` after ``step`` optimizer steps."""
        epoch, done, _ = self.locate(step)
        start = (
            self.resumed_start
            if self.resumed_steps is not None and epoch == self.resumed_epoch and step >= self.resumed_step
            else 0
        )
        return epoch, start + done * global_batch


def resized_config(
    config: TrainConfig, old_world: int, old_grad_accum: int, new_world: int
) -> tuple[TrainConfig, float]:
    """The config to continue a run of ``old_world`` ranks on ``new_world`` ranks, and the lr factor.

    ``config.on_resize == "keep"`` keeps the global batch (``batch_size x grad_accum x
    ranks``) by changing ``grad_accum``, so training continues as it would have; it needs
    ``old_grad_accum x old_world`` to divide by ``new_world``. ``"scale"`` keeps the
    per-rank batch and scales the learning rate with the global batch (the linear scaling
    rule). The same world size changes nothing.
    """
    if new_world == old_world:
        return config.replace(grad_accum=old_grad_accum), 1.0
    if config.on_resize == "scale":
        return config.replace(grad_accum=old_grad_accum), new_world / old_world
    accumulated = old_grad_accum * old_world
    if accumulated % new_world:
        raise ConfigError(
            f"the checkpoint was written by {old_world} ranks with grad_accum={old_grad_accum}; keeping its global batch "
            f"on {new_world} ranks needs grad_accum={accumulated}/{new_world}, not an integer: resume on a number of ranks "
            f"that divides {accumulated}, or set TrainConfig.on_resize='scale' (per-rank batch kept, learning rate scaled)"
        )
    return config.replace(grad_accum=accumulated // new_world), 1.0
