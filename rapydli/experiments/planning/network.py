"""The network a layout communicates over: three α–β models, given or fitted on a cluster.

A layout moves data three ways, each priced by its own model:

* ``allreduce``: the data-parallel gradient allreduce (the run's ``TrainConfig.allreduce``
  algorithm), a :class:`~rapydli.experiments.planning.perfmodel.RingModel`;
* ``collectives``: MPI's reduce-scatter and allgather (ZeRO) and the tensor-parallel
  allreduce, also a ring: a reduce-scatter or an allgather is half of
  ``RingModel.allreduce_time`` (``(n−1)·α + (n−1)/n · S · β``), fitted on timed
  reduce-scatter + allgather pairs;
* ``p2p``: one message between neighbouring pipeline stages, ``α + S · β``
  (:class:`LinkModel`), fitted on round trips of the pipeline's own transfers
  (:mod:`rapydli.parallel.wire`), and how late a receive that waited notices its message.

:func:`measure_network` fits the three on engines of a cluster; ``Network.from_ring``
uses one given α, β for all of them (a target machine one does not have).

Examples
--------
>>> net = Network.from_ring(RingModel(alpha=5e-6, beta=1e-9))
>>> round(net.p2p.send_time(1e6), 6), round(net.collectives.allreduce_time(4, 1e6) / 2, 6)
(0.001005, 0.000765)
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rapydli.errors import ConfigError
from rapydli.experiments.planning.perfmodel import SIZES, RingModel, fit_ring, measure_ring

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster import Cluster


@dataclass(frozen=True)
class LinkModel:
    """One message of ``S`` bytes between two ranks takes ``α + S · β`` seconds.

    ``waits``: ``(wait, delay)`` pairs measured on the pipeline's transfers: a receive that
    waited ``wait`` seconds for its message noticed it ``delay`` seconds late (a waiting
    rank polls with growing sleeps, :func:`rapydli.parallel.wire.wait`); empty: no delay.
    """

    alpha: float
    beta: float
    source: str = "given"
    waits: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        if not (self.alpha >= 0 and self.beta >= 0):
            raise ConfigError(f"LinkModel(alpha={self.alpha!r}, beta={self.beta!r}) is invalid: both must be >= 0")

    def send_time(self, size_bytes: float) -> float:
        """Seconds for one message of ``size_bytes``."""
        return self.alpha + size_bytes * self.beta

    def delay_after(self, wait: float) -> float:
        """How late a receive that waited ``wait`` seconds sees its message (linear between the measured waits, flat beyond)."""
        if not self.waits or wait <= 0:
            return 0.0
        points = [(0.0, 0.0), *sorted(self.waits)]
        for (w0, d0), (w1, d1) in zip(points, points[1:]):
            if wait <= w1:
                return d0 + (d1 - d0) * (wait - w0) / (w1 - w0) if w1 > w0 else d1
        return points[-1][1]


def fit_link(sizes: Sequence[float], times: Sequence[float], source: str = "fitted") -> LinkModel:
    """Least-squares α, β of one-way message ``times`` (s) for ``sizes`` (bytes)."""
    import numpy as np

    if len(sizes) != len(times) or len(sizes) < 2:
        raise ConfigError(
            f"fit_link needs at least two (size, time) pairs; got {len(sizes)} sizes and {len(times)} times"
        )
    design = np.array([[1.0, float(s)] for s in sizes])
    (alpha, beta), *_ = np.linalg.lstsq(design, np.asarray(times, dtype=float), rcond=None)
    return LinkModel(alpha=max(float(alpha), 0.0), beta=max(float(beta), 0.0), source=source)


@dataclass(frozen=True)
class Network:
    """How long a layout's communication takes: see the module's description of each model."""

    allreduce: RingModel
    collectives: RingModel
    p2p: LinkModel

    @classmethod
    def from_ring(cls, ring: RingModel) -> Network:
        """One α, β for every kind of communication (a network described by its latency and bandwidth)."""
        return cls(allreduce=ring, collectives=ring, p2p=LinkModel(ring.alpha, ring.beta, ring.source))

    def describe(self) -> str:
        """One line per model."""
        return (
            f"allreduce: {self.allreduce.describe()} ({self.allreduce.source}); "
            f"reduce-scatter/allgather: {self.collectives.describe()}; "
            f"point to point: α = {self.p2p.alpha * 1e6:.3g} µs, β = {self.p2p.beta * 1e9:.3g} ns/B"
            + (
                f", a receive that waited {self.p2p.waits[-1][0] * 1e3:g} ms sees it {self.p2p.waits[-1][1] * 1e6:.0f} µs late"
                if self.p2p.waits
                else ""
            )
        )


def collectives_task(sizes: Sequence[int], repeats: int = 20) -> list[float]:
    """Engine half of :func:`measure_network`: seconds of one reduce-scatter + allgather pair per size."""
    import numpy as np
    from mpi4py import MPI

    from rapydli.cluster.engine import context

    comm = context().comm
    n = comm.Get_size()
    medians = []
    for size in sizes:
        per_rank = max(1, size // 4 // n)
        whole, part = np.ones(per_rank * n, dtype=np.float32), np.empty(per_rank, dtype=np.float32)
        comm.Reduce_scatter_block(whole, part, op=MPI.SUM)
        samples = []
        for _ in range(3):
            comm.Barrier()
            started = time.perf_counter()
            for _ in range(repeats):
                comm.Reduce_scatter_block(whole, part, op=MPI.SUM)
                comm.Allgather(part, whole)
            samples.append(comm.allreduce((time.perf_counter() - started) / repeats, op=MPI.MAX))
        medians.append(statistics.median(samples))
    return medians


#: Waits (s) after which the delay of a pipeline receive is measured.
WAITS = (2e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def p2p_task(sizes: Sequence[int], repeats: int = 20) -> tuple[list[float], list[float]]:
    """Engine half of :func:`measure_network`: pipeline transfers between ranks 0 and 1.

    Returns one-way seconds per size (half of a round trip of
    :func:`rapydli.parallel.wire.isend` / ``recv``: the header and the bytes, as between
    stages; the median of ``repeats``) and, per wait in :data:`WAITS`, how late rank 0
    noticed a reply that rank 1 held back that long (its round trip, less the wait and
    the round trip of the smallest size).
    """
    import torch

    from rapydli.cluster.engine import context
    from rapydli.parallel import wire

    ctx = context()
    comm, rank = ctx.comm, ctx.comm.Get_rank()
    peer = 1 - rank
    medians = []
    for size in sizes:
        tensor = torch.ones(max(1, size // 4))
        trips = []
        for i in range(repeats + 1):
            comm.Barrier()
            started = time.perf_counter()
            if rank == 0:
                wire.wait_all([r for r, _ in wire.isend(comm, tensor, peer, "activation", i)])
                wire.recv(comm, peer, "gradient", i, tensor.device)
            else:
                got = wire.recv(comm, peer, "activation", i, tensor.device)
                wire.wait_all([r for r, _ in wire.isend(comm, got.detach(), peer, "gradient", i)])
            trips.append(time.perf_counter() - started)
        medians.append(statistics.median(trips[1:]) / 2)
    small = torch.ones(max(1, min(sizes) // 4))
    delays = []
    for w, wait in enumerate(WAITS):
        trips = []
        for i in range(repeats // 2 + 1):
            mb = 1000 + w * 100 + i
            comm.Barrier()
            started = time.perf_counter()
            if rank == 0:
                wire.wait_all([r for r, _ in wire.isend(comm, small, peer, "activation", mb)])
                wire.recv(comm, peer, "gradient", mb, small.device)
            else:
                got = wire.recv(comm, peer, "activation", mb, small.device)
                _busy(wait)
                wire.wait_all([r for r, _ in wire.isend(comm, got.detach(), peer, "gradient", mb)])
            trips.append(time.perf_counter() - started)
        delays.append(max(0.0, statistics.median(trips[1:]) - wait - 2 * medians[0]))
    return comm.bcast((medians, delays), root=0)


def measure_network(
    cluster: Cluster, targets: Sequence[int], algorithm: str = "auto", sizes: Sequence[int] = SIZES
) -> Network:
    """Fit the three models on ``targets`` (at least 2 engines) of ``cluster``."""
    ranks = list(targets)
    if len(ranks) < 2:
        raise ConfigError("measuring the network needs at least 2 engines; give network=RingModel(alpha, beta) instead")
    allreduce = measure_ring(cluster, ranks, algorithm=algorithm, sizes=sizes)
    pairs = cluster.run(collectives_task, list(sizes), targets=ranks)[0]
    collectives = fit_ring(
        list(sizes), pairs, n=len(ranks), source=f"fitted: MPI reduce-scatter + allgather on {len(ranks)} engines"
    )
    one_way, delays = cluster.run(p2p_task, list(sizes), targets=ranks[:2])[0]
    fitted = fit_link(list(sizes), one_way, source="fitted: pipeline transfers between 2 engines")
    p2p = LinkModel(fitted.alpha, fitted.beta, fitted.source, tuple(zip(WAITS, delays)))
    return Network(allreduce=allreduce, collectives=collectives, p2p=p2p)
