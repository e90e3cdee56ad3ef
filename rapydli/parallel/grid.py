"""The process grid: this rank's place in a :class:`~rapydli.parallel.layout.Layout` and its communicators.

The layout owns the degrees and the arithmetic (world rank ``r`` is tensor rank
``r % tensor_parallel`` of stage ``(r // tensor_parallel) % pipeline_stages`` of replica
``r // (tensor_parallel * pipeline_stages)``: the tensor-parallel ranks of one layer are
neighbours, since they allreduce in every layer and should share a node, then the stages of
one pipeline). The grid holds the layout and four sub-communicators from ``Comm.Split``:

* ``tensor``: the ranks that split this stage's layers (rank = tensor rank);
* ``pipeline``: the stages of this rank's replica at its tensor rank (rank = stage index);
* ``data``: this (stage, tensor rank) in every replica (rank = replica index), over which
  gradients are averaged and ZeRO shards the optimizer state;
* ``model``: every rank of this replica (stages x tensor), over which a global gradient
  norm is summed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.parallel.layout import Layout


@dataclass
class ProcessGrid:
    """This rank's place in the grid and the communicators of its rows and columns.

    Attributes
    ----------
    layout
        The run's :class:`~rapydli.parallel.layout.Layout` (its degrees: ``data_parallel``,
        ``pipeline_stages``, ``tensor_parallel``).
    world
        The communicator the grid was made from.
    stage, replica, tensor_rank
        This rank's stage, replica and tensor-parallel index.
    pipeline
        The stages of this replica at this tensor rank (mpi4py communicator; its rank is ``stage``).
    data
        This (stage, tensor rank) in every replica (its rank is ``replica``).
    tensor
        The tensor-parallel ranks of this stage (its rank is ``tensor_rank``).
    model
        Every rank of this replica (``pipeline_stages * tensor_parallel`` ranks).
    """

    layout: Layout
    world: Any
    stage: int
    replica: int
    tensor_rank: int
    pipeline: Any
    data: Any
    tensor: Any
    model: Any

    @classmethod
    def create(cls, world: Any, layout: Layout) -> ProcessGrid:
        """Split ``world`` into ``layout``'s grid (collective over ``world``; ``layout.world_size`` is its size)."""
        rank = world.Get_rank()
        stage, tensor_rank, replica = layout.coordinates(rank)
        position = rank // layout.tensor_parallel
        tensor = layout.tensor_parallel
        pipeline = world.Split(color=replica * tensor + tensor_rank, key=stage)
        data = world.Split(color=stage * tensor + tensor_rank, key=replica)
        tensor_comm = world.Split(color=position, key=tensor_rank)
        model = world.Split(color=replica, key=rank)
        return cls(layout, world, stage, replica, tensor_rank, pipeline, data, tensor_comm, model)

    @property
    def first(self) -> bool:
        """Whether this rank runs the first stage (it reads the inputs)."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this rank runs the last stage (it computes the loss)."""
        return self.stage == self.layout.pipeline_stages - 1

    def data_communicator(self, algorithm: str) -> Any:
        """A :class:`~rapydli.comm.Communicator` over ``data`` (``None`` with one replica)."""
        if not self.layout.uses_data_parallel:
            return None
        from rapydli.comm import Communicator

        return Communicator(self.data, algorithm=algorithm)

    def world_rank(self, stage: int, replica: int | None = None, tensor_rank: int | None = None) -> int:
        """World rank of ``stage`` in ``replica`` at ``tensor_rank`` (defaults: this rank's)."""
        replica = self.replica if replica is None else replica
        tensor_rank = self.tensor_rank if tensor_rank is None else tensor_rank
        return self.layout.world_rank(stage, tensor_rank, replica)

    def free(self) -> None:
        """Release the sub-communicators."""
        for comm in (self.pipeline, self.data, self.tensor, self.model):
            comm.Free()
