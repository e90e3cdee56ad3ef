"""The process grid: ranks = data-parallel degree x pipeline stages x tensor-parallel degree.

World rank ``r`` is tensor rank ``r % tensor`` of stage ``(r // tensor) % stages`` of
data-parallel replica ``r // (tensor * stages)``: the tensor-parallel ranks of one layer
are neighbours (they allreduce in every layer, so they should share a node), then the
stages of one pipeline. Four sub-communicators come from ``Comm.Split``:

* ``tensor``: the ranks that split this stage's layers (rank = tensor rank);
* ``pipeline``: the stages of this rank's replica at its tensor rank (rank = stage index);
* ``data``: this (stage, tensor rank) in every replica (rank = replica index), over which
  gradients are averaged and ZeRO shards the optimizer state;
* ``model``: every rank of this replica (stages x tensor), over which a global gradient
  norm is summed.

Examples
--------
>>> data_parallel_degree(world_size=4, stages=2)
2
>>> data_parallel_degree(world_size=8, stages=2, tensor=2)
2
>>> data_parallel_degree(world_size=3, stages=2)
Traceback (most recent call last):
...
rapydli.errors.ConfigError: 3 ranks cannot run pipeline_stages=2: the number of ranks must be a multiple of pipeline_stages (2, 4, 6, ...)
>>> data_parallel_degree(world_size=6, stages=2, tensor=2)
Traceback (most recent call last):
...
rapydli.errors.ConfigError: 6 ranks cannot run pipeline_stages=2 x tensor_parallel=2: the number of ranks must be a multiple of 4 (4, 8, 12, ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rapydli.errors import ConfigError


def data_parallel_degree(world_size: int, stages: int, tensor: int = 1) -> int:
    """Replicas of the model: ``world_size / (stages * tensor)``; a remainder is a :class:`ConfigError`."""
    per_replica = stages * tensor
    if stages < 1 or tensor < 1 or world_size < per_replica or world_size % per_replica:
        multiples = ", ".join(str(per_replica * k) for k in (1, 2, 3))
        parts = {"pipeline_stages": stages, "tensor_parallel": tensor}
        named = {k: v for k, v in parts.items() if v > 1} or {"pipeline_stages": stages}
        layout = " x ".join(f"{k}={v}" for k, v in named.items())
        what = next(iter(named)) if len(named) == 1 else str(per_replica)
        raise ConfigError(
            f"{world_size} ranks cannot run {layout}: the number of ranks must be a multiple of {what} ({multiples}, ...)"
        )
    return world_size // per_replica


@dataclass
class ProcessGrid:
    """This rank's place in the grid and the communicators of its rows and columns.

    Attributes
    ----------
    world
        The communicator the grid was made from.
    stages, replicas, tensor_parallel
        Pipeline stages, data-parallel replicas and tensor-parallel degree
        (``stages * replicas * tensor_parallel`` ranks).
    stage, replica, tensor_rank
        This rank's stage, replica and tensor-parallel index.
    pipeline
        The stages of this replica at this tensor rank (mpi4py communicator; its rank is ``stage``).
    data
        This (stage, tensor rank) in every replica (its rank is ``replica``).
    tensor
        The tensor-parallel ranks of this stage (its rank is ``tensor_rank``).
    model
        Every rank of this replica (``stages * tensor_parallel`` ranks).
    """

    world: Any
    stages: int
    replicas: int
    tensor_parallel: int
    stage: int
    replica: int
    tensor_rank: int
    pipeline: Any
    data: Any
    tensor: Any
    model: Any

    @classmethod
    def create(cls, world: Any, stages: int, tensor: int = 1) -> ProcessGrid:
        """Split ``world`` into the grid (collective over ``world``)."""
        replicas = data_parallel_degree(world.Get_size(), stages, tensor)
        rank = world.Get_rank()
        position, tensor_rank = divmod(rank, tensor)
        replica, stage = divmod(position, stages)
        pipeline = world.Split(color=replica * tensor + tensor_rank, key=stage)
        data = world.Split(color=stage * tensor + tensor_rank, key=replica)
        tensor_comm = world.Split(color=position, key=tensor_rank)
        model = world.Split(color=replica, key=rank)
        return cls(world, stages, replicas, tensor, stage, replica, tensor_rank, pipeline, data, tensor_comm, model)

    @property
    def first(self) -> bool:
        """Whether this rank runs the first stage (it reads the inputs)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.stage == self.stages - 1

    def data_communicator(self, algorithm: str) -> Any:
        """A :class:`~rapydli.comm.Communicator` over ``data`` (``None`` with one replica)."""
        if self.replicas == 1:
            return None
        from rapydli.comm import Communicator

        return Communicator(self.data, algorithm=algorithm)

    def world_rank(self, stage: int, replica: int | None = None, tensor_rank: int | None = None) -> int:
        """World rank of ``stage`` in ``replica`` at ``tensor_rank`` (defaults: this rank's)."""
        replica = self.replica if replica is None else replica
        tensor_rank = self.tensor_rank if tensor_rank is None else tensor_rank
        return (replica * self.stages + stage) * self.tensor_parallel + tensor_rank

    def free(self) -> None:
        """Release the sub-communicators."""
        for comm in (self.pipeline, self.data, self.tensor, self.model):
            comm.Free()
