"""The layout of a run: how its ranks split into data x pipeline x tensor, and its ZeRO stage.

:class:`Layout` is the one owner of a run's parallel degrees (in the spirit of
torchtitan's ``ParallelDims``). It is built from the ``TrainConfig`` and the number of
ranks that really run (:meth:`Layout.of`), refuses a world the degrees do not divide
(naming the ranks it has), and answers what the rest asks: the data-parallel degree, whether
each kind of parallelism is on, the describing text, and where a rank sits. On the ranks it builds the
process grid and hands the Trainer its part of the model (:meth:`Layout.model_part`) and
the object that makes its gradients global (:meth:`Layout.gradients`), so the Trainer
does not branch on the layout. The planner's candidates, scaling studies, sweeps and the
client's checks before a run use the same object for the replica arithmetic.

Its names for the degrees, ``data_parallel``, ``pipeline_stages``, ``tensor_parallel`` and
``zero``, are the config's, and every table, record and text of a run (the planner's table,
a checkpoint's layout, :meth:`Layout.describe`) uses them.

World rank ``r`` is tensor rank ``r % tensor_parallel`` of stage ``(r // tensor_parallel) %
pipeline_stages`` of replica ``r // (tensor_parallel * pipeline_stages)`` (:class:`~rapydli.parallel.grid.ProcessGrid`).

Examples
--------
>>> layout = Layout(world_size=4, pipeline_stages=2, zero=1)
>>> layout.data_parallel, layout.uses_pipeline, layout.uses_tensor_parallel, layout.uses_zero
(2, True, False, True)
>>> layout.describe()
'4 ranks (data_parallel=2 x pipeline_stages=2 x tensor_parallel=1, zero=1)'
>>> Layout(world_size=4, pipeline_stages=3, where="the cluster")
Traceback (most recent call last):
...
rapydli.errors.ConfigError: the cluster has 4 ranks: pipeline_stages=3 needs a multiple of 3 (3, 6, 9, ...)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from rapydli.objective import Objective
    from rapydli.parallel.gradients import Gradients
    from rapydli.parallel.grid import ProcessGrid
    from rapydli.parallel.settings import LayoutSettings, StepSettings
    from rapydli.parallel.training import PipelineTraining


#: The config's degree fields as one process trains (a reference run, a profile of the whole model): what a new
#: dimension adds here, the code that runs one process picks up.
ONE_PROCESS = {"pipeline_stages": 1, "tensor_parallel": 1, "zero": 0}


@dataclass(frozen=True, order=True)
class Layout:
    """``world_size`` ranks as ``data_parallel`` x ``pipeline_stages`` x ``tensor_parallel``, ZeRO stage ``zero``.

    Parameters
    ----------
    world_size
        Ranks that run (the cluster's engines, or the ranks ``mpiexec`` started).
    pipeline_stages, tensor_parallel
        Pipeline stages and tensor-parallel degree (the ``TrainConfig`` fields of the same names).
    zero
        ZeRO stage (0: off; 1, 2, 3: the optimizer state, at 2 the gradients too, at 3 the
        parameters too, sharded over the replicas).
    where
        What has the ranks, for the refusal's text (``"the cluster"``, ``"workers_per_trial"``);
        not part of the layout's identity.

    Raises
    ------
    ConfigError
        ``world_size`` is not a positive multiple of ``pipeline_stages * tensor_parallel``; the message
        names the ranks there are and the multiples that would work.
    """

    world_size: int
    pipeline_stages: int = 1
    tensor_parallel: int = 1
    zero: int = 0
    where: str = field(default="this run", compare=False, repr=False)

    def __post_init__(self) -> None:
        self.check(self.world_size, self.pipeline_stages, self.tensor_parallel, self.where)

    @staticmethod
    def check(world_size: int, pipeline_stages: int = 1, tensor_parallel: int = 1, where: str = "this run") -> None:
        """Raise the :class:`ConfigError` a layout of these degrees on ``world_size`` ranks would raise, if any
        (``TrainConfig`` checks its ``workers`` so, without making a layout)."""
        if not Layout.fits(world_size, pipeline_stages, tensor_parallel):
            per = pipeline_stages * tensor_parallel
            degrees = {"pipeline_stages": pipeline_stages, "tensor_parallel": tensor_parallel}
            named = {k: v for k, v in degrees.items() if v > 1} or {"pipeline_stages": 1}
            needs = " x ".join(f"{k}={v}" for k, v in named.items())
            multiples = ", ".join(str(per * k) for k in (1, 2, 3))
            raise ConfigError(f"{where} has {world_size} ranks: {needs} needs a multiple of {per} ({multiples}, ...)")

    @classmethod
    def of(cls, config: LayoutSettings, world_size: int, where: str = "this run") -> Layout:
        """The layout of ``config`` (``pipeline_stages``, ``tensor_parallel``, ``zero``) on ``world_size`` ranks."""
        return cls(world_size, config.pipeline_stages, config.tensor_parallel, config.zero, where)

    @staticmethod
    def fits(world_size: int, pipeline_stages: int = 1, tensor_parallel: int = 1) -> bool:
        """Whether ``world_size`` ranks divide into replicas of ``pipeline_stages * tensor_parallel`` ranks."""
        per = pipeline_stages * tensor_parallel
        return pipeline_stages >= 1 and tensor_parallel >= 1 and world_size >= per and world_size % per == 0

    # -- what the rest asks ---------------------------------------------------------------
    @property
    def data_parallel(self) -> int:
        """Data-parallel degree: copies of the model, each reading its own shard of the data."""
        return self.world_size // (self.pipeline_stages * self.tensor_parallel)

    @property
    def ranks_per_replica(self) -> int:
        """``pipeline_stages * tensor_parallel``."""
        return self.pipeline_stages * self.tensor_parallel

    @property
    def uses_data_parallel(self) -> bool:
        """More than one replica (gradients are averaged over the data group)."""
        return self.data_parallel > 1

    @property
    def uses_pipeline(self) -> bool:
        """The model is cut into pipeline stages."""
        return self.pipeline_stages > 1

    @property
    def uses_tensor_parallel(self) -> bool:
        """Layers are split over tensor-parallel ranks."""
        return self.tensor_parallel > 1

    @property
    def uses_zero(self) -> bool:
        """The optimizer state is sharded over the replicas."""
        return self.zero > 0

    @property
    def sharded(self) -> bool:
        """Some rank holds state no other rank holds (stages, tensor slices, ZeRO shards)."""
        return self.uses_pipeline or self.uses_tensor_parallel or self.uses_zero

    def builds_deferred(self, config: StepSettings) -> bool:
        """Whether ``model_fn`` is recorded on the meta device rather than built whole (:mod:`rapydli.parallel.deferred`).

        When the model is split: fully sharded (``zero=3``), cut into stages whose split is
        named (``pipeline_split="auto"`` times the whole model's blocks on rank 0, so it is
        built whole), or its layers split over tensor ranks. Each rank then makes only its
        stage, its slices and its shards, with the values of the whole model.
        """
        auto_split = self.uses_pipeline and str(config.pipeline_split).strip() == "auto"
        return (self.zero == 3 or self.uses_pipeline or self.uses_tensor_parallel) and not auto_split

    def describe(self) -> str:
        """``"4 ranks (data_parallel=2 x pipeline_stages=2 x tensor_parallel=1, zero=1)"``: the config's names."""
        degrees = f"data_parallel={self.data_parallel} x pipeline_stages={self.pipeline_stages} x tensor_parallel={self.tensor_parallel}"
        return f"{self.world_size} ranks ({degrees}, zero={self.zero})"

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """``(stage, tensor rank, replica)`` of world rank ``rank``."""
        position, tensor_rank = divmod(rank, self.tensor_parallel)
        replica, stage = divmod(position, self.pipeline_stages)
        return stage, tensor_rank, replica

    def world_rank(self, stage: int, tensor_rank: int, replica: int) -> int:
        """The world rank at ``(stage, tensor_rank, replica)``."""
        return (replica * self.pipeline_stages + stage) * self.tensor_parallel + tensor_rank

    # -- on the ranks ---------------------------------------------------------------------
    def grid(self, world: Any) -> ProcessGrid:
        """Split ``world`` into the process grid (collective over ``world``)."""
        from rapydli.parallel.grid import ProcessGrid

        self._check_world(world)
        return ProcessGrid.create(world, self)

    def model_part(
        self,
        model: nn.Module,
        config: StepSettings,
        world: Any,
        train_data: Any,
        objective: Objective,
        comm: Any = None,
        bounds: list[int] | None = None,
    ) -> ModelPart:
        """This rank's part of ``model`` and the communicator of its data group (collective over ``world``).

        Pipelined: the grid, the split (``bounds`` keeps a resumed split) and this rank's
        stage, its layers split over the tensor group when ``tensor_parallel > 1``
        (:class:`~rapydli.parallel.training.PipelineTraining`). Tensor-parallel only: the
        grid and ``model``'s layers split over the tensor group (in place). Otherwise the
        whole model. ``comm``: a :class:`~rapydli.comm.Communicator` to average gradients
        over in a plain data-parallel run (used as it is), an mpi4py communicator or
        ``None`` (a Communicator over ``world`` with ``config.allreduce`` is built, and owned).
        With ``config.activation_checkpointing`` the blocks it names recompute their
        activations in backward (:mod:`rapydli.parallel.recompute`).
        """
        self._check_world(world)
        from rapydli.parallel.deferred import recording_of

        recording = recording_of(model)
        with (
            recording if recording is not None else contextlib.nullcontext()
        ):  # slices cut from the meta model are recorded too
            part = self._part(model, config, world, train_data, objective, comm, bounds)
        if (
            recording is not None
        ):  # this rank's part only, a tensor at a time; fully sharded: each when its unit is sharded
            made = recording.materialize(part.model, lazy=self.zero == 3, within=model)
            context = getattr(part.model, "context", None)  # buffers a stage reads but another holds (rotary tables)
            if context is not None:
                recording.materialize(context, within=model)
            if part.pipeline is not None:  # its tied parameters were found on the meta model
                part.pipeline.adopt(made)
        from rapydli.parallel.batchnorm import global_batch_norm

        # BatchNorm normalises over the global batch, as in one process; a stage running the model's own forward runs its
        # BatchNorm outside the layers too (rapydli.parallel.skipping)
        global_batch_norm(getattr(part.model, "whole", part.model), part.comm)
        if (
            config.activation_checkpointing is not None
        ):  # the blocks are the whole model's: stages and split layers share them
            from rapydli.parallel.recompute import checkpoint_blocks

            checkpoint_blocks(model, config.activation_checkpointing)
        return part

    def _part(
        self,
        model: nn.Module,
        config: StepSettings,
        world: Any,
        train_data: Any,
        objective: Objective,
        comm: Any,
        bounds: list[int] | None,
    ) -> ModelPart:
        if self.uses_pipeline:
            from rapydli.parallel.training import PipelineTraining

            pipeline = PipelineTraining(model, self, config, world, train_data, objective, bounds=bounds)
            return ModelPart(
                self, pipeline.module, pipeline.grid, pipeline, pipeline.grid.data_communicator(config.allreduce), True
            )
        if self.uses_tensor_parallel:
            from rapydli.parallel.config import tensor_plan
            from rapydli.parallel.tensor import shard_model

            grid = self.grid(world)
            shard_model(model, tensor_plan(config.tensor_plan), grid.tensor)
            return ModelPart(self, model, grid, None, grid.data_communicator(config.allreduce), True)
        if comm is None or comm is world:
            from rapydli.comm import Communicator

            return ModelPart(
                self,
                model,
                None,
                None,
                Communicator(world, algorithm=config.allreduce) if self.world_size > 1 else None,
                True,
            )
        return ModelPart(self, model, None, None, comm, False)

    def gradients(
        self,
        part: ModelPart,
        optimizer: torch.optim.Optimizer,
        config: StepSettings,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> Gradients:
        """What makes ``part``'s gradients global, and the optimizer that steps it.

        One replica: nothing to average. Otherwise a
        :class:`~rapydli.comm.GradientSynchronizer` over the data group (its bucket
        allreduces overlap backward); with ZeRO ``optimizer``'s state is sharded over the
        data group group by group, any parameter groups kept
        (:class:`~rapydli.parallel.zero.ShardedOptimizer`), and at stage 2 the sharded
        optimizer reduce-scatters the gradients itself. Rank 0's parameters (replica 0's)
        are copied to the other replicas first. A pipelined part's executor is built here,
        with the synchronizer and ``autocast`` (the Trainer's mixed-precision context).
        """
        from rapydli.parallel import gradients

        strategy = gradients.build(self, part, optimizer, config)
        if part.pipeline is not None:
            part.pipeline.attach(strategy.sync, autocast or contextlib.nullcontext)
        return strategy

    def _check_world(self, world: Any) -> None:
        size = world.Get_size()
        if size != self.world_size:
            raise ConfigError(f"this layout is of {self.world_size} ranks, the communicator has {size}")


@dataclass
class ModelPart:
    """What a layout hands the Trainer: this rank's part of the model and its place in the grid.

    Attributes
    ----------
    layout
        The :class:`Layout` it belongs to.
    model
        This rank's part: a pipeline stage (an ``nn.Sequential`` sharing the model's
        modules), the model with its layers split over the tensor group, or the model.
    grid
        The :class:`~rapydli.parallel.grid.ProcessGrid` (``None`` for plain data parallelism).
    pipeline
        The :class:`~rapydli.parallel.training.PipelineTraining` of a pipelined run, else ``None``.
    comm
        The :class:`~rapydli.comm.Communicator` over the data group (``None`` with one replica).
    owns_comm
        Whether :meth:`close` closes ``comm`` (it was built here).
    data_rank, data_size
        This rank's replica and the number of replicas (the data shard it reads).
    """

    layout: Layout
    model: Any
    grid: ProcessGrid | None
    pipeline: PipelineTraining | None
    comm: Any
    owns_comm: bool

    @property
    def data_size(self) -> int:
        return self.layout.data_parallel

    @property
    def data_rank(self) -> int:
        if self.grid is not None:
            return self.grid.replica
        return self.comm.rank if self.comm is not None else 0

    def close(self) -> None:
        """Release what the layout built: the communicator it owns, the grid's communicators."""
        if self.owns_comm and self.comm is not None:
            self.comm.close()
        self.comm = None
        if self.pipeline is not None:
            self.pipeline.close()
        elif self.grid is not None:
            self.grid.free()
