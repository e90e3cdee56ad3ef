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
from rapydli.parallel.layout import ONE_PROCESS
from rapydli.trainer.config import TrainConfig

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from rapydli.cluster import Cluster
    from rapydli.experiments.spec import OptimizerFn, RunSpec


def tensor_plan(config: TrainConfig) -> dict[str, str] | None:
    """The config's tensor plan when it names one (a dict; the config keeps it as JSON text), else ``None`` (the model's built-in plan)."""
    from rapydli.parallel.config import tensor_plan as stored_plan

    return stored_plan(config.tensor_plan)


#: Steps of single-rank training timed for the loop's overhead (after the Trainer's warm-up steps).
CALIBRATION_STEPS = 6


def train_step_time(
    spec: RunSpec, train: Any, config: TrainConfig, device: torch.device, comm: Any
) -> Callable[[int], float]:
    """``time(batch)``: median seconds of a step of the real Trainer on ``comm`` (one rank) at that batch,
    with the run's loss, optimizer and metrics (``spec``)."""

    def time(batch: int) -> float:
        import math

        import torch

        from rapydli.trainer.loop import Trainer
        from rapydli.trainer.task import WARMUP_STEPS, timing_summary

        steps = CALIBRATION_STEPS + WARMUP_STEPS
        cfg = config.replace(
            batch_size=batch,
            grad_accum=1,
            max_steps=steps,
            epochs=math.ceil(steps * batch / len(train)) + 1,
            eval_every=0,
            checkpoint_dir=None,
            checkpoint_every=0,
            resume=False,
            **ONE_PROCESS,
            microbatches=1,
            workers=1,
            autotune=False,
        )
        torch.manual_seed(cfg.seed)
        trainer = Trainer(spec.model_fn().to(device), None, train, None, cfg, comm=comm, **spec.code)
        try:
            history = trainer.fit()
        finally:
            trainer.close()
        return float(timing_summary(history)["step_time_s"])

    return time


def optimizer_factory(model: Any, config: TrainConfig, optimizer_fn: OptimizerFn | None) -> Callable[[list[Any]], Any]:
    """What the profiler times the run's optimizer step with: ``factory(parameters) -> optimizer``.

    Without ``optimizer_fn``: ``config.optimizer`` over the parameters given. With it: the
    user's optimizer as the run builds it on ``model`` (its class and settings), made again
    over the parameters given (the whole model's, or their host copies for offloading).
    """
    from rapydli.trainer.optim import make_optimizer, optimizer_over

    if optimizer_fn is None:
        return lambda params: optimizer_over(params, config)
    template = make_optimizer(model, config, optimizer_fn)
    return lambda params: type(template)(params, **template.defaults)


def _profile(
    spec: RunSpec,
    config: TrainConfig,
    sizes: Sequence[int],
    tensor_parallel: Sequence[int],
    data_sizes: Sequence[int],
    device: torch.device,
    comm: Any = None,
) -> Profile:
    import torch
    from torch.utils.data import default_collate

    train, _ = spec.data_fn()
    count = max(sizes)
    inputs, targets = default_collate([train[i % len(train)] for i in range(count)])[:2]
    sample = (inputs.to(device), targets.to(device))

    def build() -> Any:
        torch.manual_seed(config.seed)
        return spec.model_fn().to(device)

    step = train_step_time(spec, train, config, device, comm) if comm is not None else None
    optimizer = optimizer_factory(build() if spec.optimizer_fn is not None else None, config, spec.optimizer_fn)
    return profile_model(
        build,
        sample,
        sizes,
        tensor_parallel,
        tensor_plan(config),
        optimizer,
        train,
        data_sizes,
        step,
        loss_fn=spec.loss_fn,
    )


def profile_task(
    spec: RunSpec,
    config: dict[str, Any],
    sizes: Sequence[int],
    tensor_parallel: Sequence[int],
    data_sizes: Sequence[int],
) -> Profile:
    """Engine half of :func:`measure_profile`: this rank's measurement, on its device (the loop's overhead on one rank alone)."""
    from mpi4py import MPI

    from rapydli.cluster.engine import context

    return _profile(
        spec, TrainConfig.from_dict(config), sizes, tensor_parallel, data_sizes, context().device, MPI.COMM_SELF
    )


def measure_profile(
    cluster: Cluster,
    targets: Sequence[int],
    spec: RunSpec,
    config: TrainConfig,
    sizes: Sequence[int],
    tensor_parallel: Sequence[int],
    data_sizes: Sequence[int],
) -> Profile:
    """Every target engine measures at once; their times are averaged (the loss, optimizer and metrics are the run's: ``spec``)."""
    ranks = list(targets)
    profiles = cluster.run(
        profile_task, spec, config.to_dict(), list(sizes), list(tensor_parallel), list(data_sizes), targets=ranks
    )
    return Profile.combine(profiles, source=f"{len(ranks)} engines")


def local_profile(
    spec: RunSpec | Callable[[], Any],
    data_fn: Callable[[], Any] | None,
    config: TrainConfig,
    sizes: Sequence[int],
    tensor_parallel: Sequence[int],
    data_sizes: Sequence[int],
) -> Profile:
    """Measure in this process (on the CPU, with this process's threads; the loop's overhead is not measured: no MPI here).

    ``spec`` is the run's :class:`RunSpec`, or a model function with ``data_fn`` beside it (the defaults' loss and optimizer).
    """
    import torch

    from rapydli.experiments.spec import RunSpec

    profile = _profile(RunSpec.of(spec, data_fn), config, sizes, tensor_parallel, data_sizes, torch.device("cpu"))
    profile.source = "this process"
    return profile
