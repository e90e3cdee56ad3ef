"""What ``rd.train`` is given to train with, checked on the client before any process starts.

The model contract itself (:class:`~rapydli.objective.Objective`, :func:`~rapydli.objective.interpret`,
the metrics) lives in :mod:`rapydli.objective`, below the trainer and ``parallel``; its
names are re-exported here for code that imported them from ``rapydli.trainer.outputs``.
"""

from __future__ import annotations

from typing import Any

from rapydli.errors import ConfigError
from rapydli.objective import (
    METRICS,
    TARGET_PARAMETERS,
    Interpreted,
    LossFn,
    MetricFn,
    MetricsArg,
    Objective,
    OutputError,
    accuracy,
    cross_entropy,
    default_metrics,
    describe_unusable,
    interpret,
    mae,
    mse,
    resolve_metrics,
    target_parameter,
)

__all__ = [
    "METRICS",
    "TARGET_PARAMETERS",
    "Interpreted",
    "LossFn",
    "MetricFn",
    "MetricsArg",
    "Objective",
    "OutputError",
    "accuracy",
    "check_training_code",
    "cross_entropy",
    "default_metrics",
    "describe_unusable",
    "global_mean",
    "interpret",
    "mae",
    "mse",
    "resolve_metrics",
    "target_parameter",
]


def check_training_code(loss_fn: Any = None, optimizer_fn: Any = None, metrics: MetricsArg = None) -> None:
    """Raise :class:`ConfigError` for a ``loss_fn``, ``optimizer_fn`` or ``metrics`` that cannot work.

    Called on the client before any process starts.
    """
    from rapydli.trainer.optim import check_optimizer_fn

    if loss_fn is not None and not callable(loss_fn):
        raise ConfigError(f"loss_fn must be a callable (outputs, targets) -> loss, got {type(loss_fn).__name__}")
    if optimizer_fn is not None:
        check_optimizer_fn(optimizer_fn)
    resolve_metrics(metrics)


def global_mean(comm: Any, weighted_sum: float, samples: int) -> float:
    """The mean over every data-parallel rank's samples of a per-sample quantity (a step's loss):
    ``sum(weighted_sum) / sum(samples)`` over ``comm`` (one allreduce of two float64; ``comm``
    None or of size 1: this rank's mean), as one process with the whole global batch reports it."""
    import numpy as np

    totals = np.array([weighted_sum, float(samples)], dtype=np.float64)
    if comm is not None and comm.Get_size() > 1:
        from mpi4py import MPI

        comm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
    return float(totals[0] / totals[1]) if totals[1] else float("nan")
