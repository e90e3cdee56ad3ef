"""Measuring a model for the layout planner: on every engine of a cluster, or in this process.

:func:`measure_profile` runs :func:`profile_task` on the engines that would train
(all at once, so the measurement sees the contention of ranks sharing a node, as training
does) and averages their :class:`~rapydli.experiments.planning.profile.Profile`; :func:`local_profile`
measures in this process, for a prediction that starts no cluster.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rapydli.experiments.planning.profile import Profile, profile_model
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rapydli.cluster import Cluster


def tensor_plan(config: TrainConfig) -> dict[str, str] | None:
    """The config's tensor plan when it names one (a dict; the config keeps it as JSON text), else ``None`` (the model's built-in plan)."""
    from rapydli.parallel.config import tensor_plan as stored_plan

    return stored_plan(config.tensor_plan)


#: Steps of single-rank training timed for the loop's overhead (after the Trainer's warm-up steps).
CALIBRATION_STEPS = 6


def train_step_time(
    model_fn: Callable[[], Any], train: Any, config: TrainConfig, device: torch.device, comm: Any, loss_fn: Any = None
) -> Callable[[int], float]:
    """``time(batch)``: median seconds of a step of the real Trainer on ``comm`` (one rank) at that batch."""

    def time(batch: int) -> float:
        import math

        import torch

        from rapydli.trainer.loop import Trainer
        from rapydli.trainer.task import WARMUP_STEPS, timing_summary

        steps = CALIBRATION_STEPS + WARMUP_STEPS
        cfg = config.replace(
            batch_size=batch, grad_accum=1, max_steps=steps, epochs=math.ceil(steps * batch / len(train)) + 1, eval_every=0,
            checkpoint_dir=None, checkpoint_every=0, resume=False, pipeline_stages=1, microbatches=1, zero=0, workers=1, autotune=False,
        )  # fmt: skip
        torch.manual_seed(cfg.seed)
        trainer = Trainer(model_fn().to(device), None, train, None, cfg, comm=comm, loss_fn=loss_fn)
        try:
            history = trainer.fit()
        finally:
            trainer.close()
        return float(timing_summary(history)["step_time_s"])

    return time


def _profile(
    model_fn: Callable[[], Any], data_fn: Callable[[], Any], config: TrainConfig, sizes: Sequence[int], tensor_parallel: Sequence[int],
    data_sizes: Sequence[int], device: torch.device, comm: Any = None, loss_fn: Any = None,
) -> Profile:  # fmt: skip
    import torch
    from torch.utils.data import default_collate

    from rapydli.trainer.optim import optimizer_over

    train, _ = data_fn()
    count = max(sizes)
    inputs, targets = default_collate([train[i % len(train)] for i in range(count)])[:2]
    sample = (inputs.to(device), targets.to(device))

    def build() -> Any:
        torch.manual_seed(config.seed)
        return model_fn().to(device)

    step = train_step_time(model_fn, train, config, device, comm, loss_fn) if comm is not None else None
    return profile_model(
        build, sample, sizes, tensor_parallel, tensor_plan(config), lambda ps: optimizer_over(ps, config), train, data_sizes, step,
        loss_fn=loss_fn,
    )  # fmt: skip


def profile_task(model_fn: Callable[[], Any], data_fn: Callable[[], Any], config: dict[str, Any], sizes: Sequence[int],
                 tensor_parallel: Sequence[int], data_sizes: Sequence[int], loss_fn: Any = None) -> Profile:  # fmt: skip
    """Engine half of :func:`measure_profile`: this rank's measurement, on its device (the loop's overhead on one rank alone)."""
    from mpi4py import MPI

    from rapydli.cluster.engine import context

    return _profile(
        model_fn, data_fn, TrainConfig.from_dict(config), sizes, tensor_parallel, data_sizes, context().device, MPI.COMM_SELF, loss_fn
    )


def measure_profile(
    cluster: Cluster, targets: Sequence[int], model_fn: Callable[[], Any], data_fn: Callable[[], Any], config: TrainConfig,
    sizes: Sequence[int], tensor_parallel: Sequence[int], data_sizes: Sequence[int], loss_fn: Any = None,
) -> Profile:  # fmt: skip
    """Every target engine measures at once; their times are averaged (the loss is ``loss_fn``'s, as the run's)."""
    ranks = list(targets)
    profiles = cluster.run(
        profile_task, model_fn, data_fn, config.to_dict(), list(sizes), list(tensor_parallel), list(data_sizes), loss_fn, targets=ranks
    )
    return Profile.combine(profiles, source=f"{len(ranks)} engines")


def local_profile(
    model_fn: Callable[[], Any], data_fn: Callable[[], Any], config: TrainConfig, sizes: Sequence[int], tensor_parallel: Sequence[int],
    data_sizes: Sequence[int], loss_fn: Any = None,
) -> Profile:  # fmt: skip
    """Measure in this process (on the CPU, with this process's threads; the loop's overhead is not measured: no MPI here)."""
    import torch

    profile = _profile(model_fn, data_fn, config, sizes, tensor_parallel, data_sizes, torch.device("cpu"), loss_fn=loss_fn)
    profile.source = "this process"
    return profile
