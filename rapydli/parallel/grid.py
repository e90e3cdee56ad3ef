"""The process grid: ranks = data-parallel degree x pipeline stages.

World rank ``r`` is stage ``r % stages`` of data-parallel replica ``r // stages``: the
stages of one pipeline are neighbouring ranks (on one node when ranks are packed by
node, where activations move fastest). Two sub-communicators come from
``Comm.Split``: ``pipeline`` (the stages of this rank's replica, rank = stage index)
and ``data`` (this stage's copies in every replica, rank = replica index), over which
gradients are averaged.

Examples
--------
>>> data_parallel_degree(world_size=4, stages=2)
2
>>> data_parallel_degree(world_size=3, stages=2)
Traceback (most recent call last):
...
rapydli.errors.ConfigError: 3 ranks cannot run pipeline_stages=2: the number of ranks must be a multiple of pipeline_stages (2, 4, 6, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapydli.errors import ConfigError


def data_parallel_degree(world_size: int, stages: int) -> int:
    """Replicas of the pipeline: ``world_size / stages``; a remainder is a :class:`ConfigError`."""
    if stages < 1 or world_size < stages or world_size % stages:
        multiples = ", ".join(str(stages * k) for k in (1, 2, 3))
        raise ConfigError(
            f"{world_size} ranks cannot run pipeline_stages={stages}: "
            f"the number of ranks must be a multiple of pipeline_stages ({multiples}, ...)"
        )
    return world_size // stages


@dataclass
class ProcessGrid:
    """This rank's place in the grid and the communicators of its row and column.

    Attributes
    ----------
    world
        The communicator the grid was made from.
    stages, replicas
        Pipeline stages and data-parallel replicas (``stages * replicas`` ranks).
    stage, replica
        This rank's stage index and replica index.
    pipeline
        The stages of this replica (mpi4py communicator; its rank is ``stage``).
    data
        This stage in every replica (its rank is ``replica``).
    """

    world: Any
    stages: int
    replicas: int
    stage: int
    replica: int
    pipeline: Any
    data: Any

    @classmethod
    def create(cls, world: Any, stages: int) -> ProcessGrid:
        """Split ``world`` into the grid (collective over ``world``)."""
        replicas = data_parallel_degree(world.Get_size(), stages)
        rank = world.Get_rank()
        replica, stage = divmod(rank, stages)
        pipeline = world.Split(color=replica, key=stage)
        data = world.Split(color=stage, key=replica)
        return cls(world, stages, replicas, stage, replica, pipeline, data)

    @property
    def first(self) -> bool:
        """Whether this rank runs the first stage (it reads the inputs)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.stage == self.stages - 1

    def world_rank(self, stage: int, replica: int | None = None) -> int:
        """World rank of ``stage`` in ``replica`` (default: this rank's replica)."""
        return (self.replica if replica is None else replica) * self.stages + stage

    def free(self) -> None:
        """Release the two sub-communicators."""
        for comm in (self.pipeline, self.data):
            comm.Free()
