"""The α–β performance model of a ring allreduce, and how to fit it on a cluster.

A ring allreduce of ``S`` bytes on ``n`` ranks sends ``2(n−1)`` messages of ``S/n``
bytes per rank (scatter-reduce, then allgather), so it takes

    T(n, S) = 2(n−1)·α + 2(n−1)/n · S · β

with ``α`` the per-message latency (s) and ``β`` the inverse bandwidth (s/byte).
:func:`measure_ring` times allreduces of several sizes on engines of a cluster and fits
``α`` and ``β`` by least squares; a :class:`RingModel` can also be given for a target
network. :func:`predict_step_time` adds the model's allreduce time to a measured compute
time per step (no overlap assumed, so it is an upper bound where backward hides
communication).

Examples
--------
>>> model = RingModel(alpha=5e-6, beta=1e-9)
>>> round(model.allreduce_time(4, 1e6), 6)
0.00153
>>> fitted = fit_ring([1e3, 1e6], [model.allreduce_time(2, 1e3), model.allreduce_time(2, 1e6)], n=2)
>>> round(fitted.alpha, 9), round(fitted.beta, 12)
(5e-06, 1e-09)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster import Cluster

SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)


@dataclass(frozen=True)
class RingModel:
    """α (s per message) and β (s per byte) of a ring allreduce; ``source`` says where they came from."""

    alpha: float
    beta: float
    source: str = "given"

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ConfigError(f"RingModel(alpha={self.alpha!r}, beta={self.beta!r}) is invalid: both must be >= 0")

    def allreduce_time(self, n: int, size_bytes: float) -> float:
        """Seconds for one allreduce of ``size_bytes`` on ``n`` ranks (0 for one rank)."""
        if n <= 1:
            return 0.0
        return 2 * (n - 1) * self.alpha + 2 * (n - 1) / n * size_bytes * self.beta

    def describe(self) -> str:
        """``α = 12.3 µs, β = 0.45 ns/B (2.2 GB/s)``."""
        bandwidth = f" ({1 / self.beta / 1e9:.2g} GB/s)" if self.beta > 0 else ""
        return f"α = {self.alpha * 1e6:.3g} µs, β = {self.beta * 1e9:.3g} ns/B{bandwidth}"


def fit_ring(sizes: Sequence[float], times: Sequence[float], n: int, source: str = "fitted") -> RingModel:
    """Least-squares fit of α, β to allreduce ``times`` (s) of ``sizes`` (bytes) on ``n`` ranks."""
    import numpy as np

    if n < 2 or len(sizes) != len(times) or len(sizes) < 2:
        raise ConfigError(
            f"fit_ring needs n >= 2 ranks and at least two (size, time) pairs; got n={n}, {len(sizes)} sizes"
        )
    design = np.array([[2 * (n - 1), 2 * (n - 1) / n * s] for s in sizes], dtype=float)
    (alpha, beta), *_ = np.linalg.lstsq(design, np.asarray(times, dtype=float), rcond=None)
    return RingModel(alpha=max(float(alpha), 0.0), beta=max(float(beta), 0.0), source=source)


def allreduce_task(sizes: Sequence[int], algorithm: str, repeats: int = 20) -> list[float]:
    """Engine half of :func:`measure_ring`: seconds per allreduce per size (median of 3 rounds of ``repeats``)."""
    import torch

    from rapydli.cluster.engine import context
    from rapydli.comm import Communicator

    ctx = context()
    comm = Communicator(ctx.comm, algorithm=algorithm)
    medians = []
    try:
        for size in sizes:
            tensor = torch.ones(max(1, size // 4), dtype=torch.float32)
            comm.allreduce_(tensor)
            samples = []
            for _ in range(3):  # back to back, as gradient allreduces run; a round's time is the slowest rank's
                ctx.comm.Barrier()
                started = time.perf_counter()
                for _ in range(repeats):
                    comm.allreduce_(tensor)
                samples.append(ctx.comm.allreduce((time.perf_counter() - started) / repeats, op=_max()))
            medians.append(statistics.median(samples))
    finally:
        comm.close()
    return medians


def _max() -> Any:
    from mpi4py import MPI

    return MPI.MAX


def measure_ring(
    cluster: Cluster,
    targets: Sequence[int] | None = None,
    algorithm: str = "auto",
    sizes: Sequence[int] = SIZES,
    repeats: int = 20,
) -> RingModel:
    """Fit α, β from allreduces timed on ``targets`` (default: every engine) of ``cluster``."""
    ranks = list(range(cluster.n)) if targets is None else list(targets)
    if len(ranks) < 2:
        raise ConfigError("measuring the allreduce needs at least 2 engines; give RingModel(alpha, beta) instead")
    times = cluster.run(allreduce_task, list(sizes), algorithm, repeats, targets=ranks)[0]
    return fit_ring(list(sizes), times, n=len(ranks), source=f"fitted: {algorithm} allreduce on {len(ranks)} engines")


def predict_step_time(model: RingModel, n: int, compute_time_s: float, gradient_bytes: float) -> float:
    """Step time on ``n`` ranks: compute plus one allreduce of the gradients (not overlapped)."""
    return compute_time_s + model.allreduce_time(n, gradient_bytes)
