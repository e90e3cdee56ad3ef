"""What the :class:`~rapydli.trainer.loop.Trainer` calls for a pipelined config.

:class:`PipelineTraining` builds the process grid, cuts the model (``pipeline_split``:
measured on rank 0 for ``"auto"``), keeps this rank's stage, and runs each step, each
evaluation and each checkpoint through the pipeline. The Trainer stays the loop: it
reads this rank's replica's data shard (every stage of a replica reads the same batch;
the first stage uses the inputs, the last the targets), averages the stage's gradients
over its data-parallel copies with its ``GradientSynchronizer``, clips, steps and logs.

With ``tensor_parallel > 1`` the grid has a tensor dimension: once the split is decided
(on the dense model), the model's layers are split over each stage's tensor-parallel
ranks (:func:`~rapydli.parallel.tensor.shard_model`) before this rank keeps its stage;
activations pass between the stages at the same tensor rank.

A parameter that blocks of several stages hold (tied input and output embeddings) stays
one parameter: :mod:`rapydli.parallel.shared` sums its gradient over those stages, or
refuses the layout before training when that cannot be done.

Checkpoints are the Trainer's; a resumed ``"auto"`` split keeps the bounds its checkpoint
recorded (the Trainer reads them and passes them as ``bounds``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from rapydli.parallel import split
from rapydli.parallel.config import split_names, tensor_plan
from rapydli.parallel.executor import MetricFn, PipelineExecutor
from rapydli.parallel.preflight import check_batch_norm
from rapydli.parallel.shared import SharedGradients, check_honoured, find_shared
from rapydli.parallel.timeline import Recorder

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.objective import Objective
    from rapydli.parallel.layout import Layout
    from rapydli.parallel.settings import StepSettings


class PipelineTraining:
    """This rank's stage of a pipelined run, and the collectives the Trainer needs for it.

    Parameters
    ----------
    model
        The whole model (built on every rank; this rank keeps its stage's blocks).
    layout
        The run's :class:`~rapydli.parallel.layout.Layout`: its stages, tensor degree and
        ZeRO stage (the degrees are read from it alone).
    config
        The run's ``TrainConfig`` (``microbatches``, ``pipeline_schedule``,
        ``pipeline_split``, ``tensor_plan``).
    world
        The mpi4py communicator of every rank of the run.
    train_data
        The training set; rank 0 times the blocks on its first ``batch_size`` samples
        for ``pipeline_split="auto"``.
    objective
        The run's :class:`~rapydli.objective.Objective` (``loss_fn``, or the loss or
        logits the model returns), made from the whole model; its ``loss`` runs on the last
        stage's outputs; a traced model that computes its own loss gets the targets in its
        last block (:mod:`rapydli.parallel.traced`). The Trainer has checked that the
        objective can run pipelined (:meth:`~rapydli.objective.Objective.check_pipelined`).
    bounds
        Where stages begin, to keep (a resumed run's recorded split), or ``None``: decided
        from ``pipeline_split`` (measured on rank 0 for ``"auto"``).

    Attributes
    ----------
    grid
        The :class:`~rapydli.parallel.grid.ProcessGrid`.
    bounds
        Block indices where stages begin (and the end).
    module, names
        This rank's stage (a :class:`~rapydli.parallel.split.Stage` sharing the model's
        modules) and its block names.
    shared
        The parameters more than one stage holds (:func:`~rapydli.parallel.shared.find_shared`),
        found on the dense model before it is split; their gradients are summed over
        those stages (:meth:`sum_shared_gradients`) and they are listed in the timeline's
        layout.
    recorder
        The spans of this rank's last steps (:mod:`rapydli.parallel.timeline`).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: Layout,
        config: StepSettings,
        world: Any,
        train_data: Dataset,
        objective: Objective,
        bounds: list[int] | None = None,
    ) -> None:
        targets = objective.target_parameter  # a traced model's own loss: its last block takes the targets by this name
        check_batch_norm(model, layout.pipeline_stages, config.microbatches)
        self.config = config
        self.grid = layout.grid(world)
        sample = labels = None
        # "auto" measures the blocks on a sample; a traced model's blocks are checked against its forward on one
        if (
            world.Get_rank() == 0
            and (config.pipeline_split.strip() == "auto" or not split.lists_blocks(model))
            and bounds is None
        ):
            count = min(len(train_data), config.batch_size)  # type: ignore[arg-type]
            device = next(model.parameters()).device
            sample, labels = (part.to(device) for part in default_collate([train_data[i] for i in range(count)])[:2])
        # a resumed "auto" run keeps the split its checkpoint was written with
        self.bounds = bounds or split.decide(
            model, split_names(config.pipeline_split), layout.pipeline_stages, sample, world, labels, targets
        )
        # parameters several stages hold (tied embeddings) stay one parameter, or the run is refused here, before training
        self.shared = find_shared(model, self.bounds)
        plan = None
        if layout.uses_tensor_parallel:
            from rapydli.parallel.tensor import plan_for

            plan = tensor_plan(config.tensor_plan) or plan_for(model, layout.tensor_parallel)
        check_honoured(self.shared, model, layout.zero, plan)
        if plan is not None:  # every rank splits the dense model; this rank keeps its stage of it below
            from rapydli.parallel.tensor import shard_model

            shard_model(model, plan, self.grid.tensor)
            self.shared = find_shared(
                model, self.bounds
            )  # a tied weight split by vocabulary rows is the new (split) parameter
        self.module, self.names = split.stage_module(model, self.bounds, self.grid.stage, targets)
        self.shared_gradients = SharedGradients(self.shared, self.module, self.grid.pipeline)
        self.shared_gradients.broadcast()
        self.module.counted_elsewhere = frozenset(self.shared_gradients.counted_elsewhere)
        self.loss_fn = objective.loss
        self.recorder = Recorder()
        self.executor: PipelineExecutor | None = None

    def attach(self, sync: Any, autocast: Callable[[], contextlib.AbstractContextManager[Any]]) -> None:
        """Build the executor, with the Trainer's synchronizer (or None) and autocast.

        The synchronizer's ``wait`` is wrapped to record the allreduce wait in the timeline.
        """
        if sync is not None:
            wait, recorder = sync.wait, self.recorder

            def timed_wait() -> Any:
                started = time.perf_counter()
                stats = wait()
                recorder.span("allreduce", -1, started, time.perf_counter())
                return stats

            sync.wait = timed_wait
        self.executor = PipelineExecutor(
            self.module,
            self.grid.pipeline,
            self.config.pipeline_schedule,
            self.config.microbatches,
            self.loss_fn,
            sync=sync,
            recorder=self.recorder,
            autocast=autocast,
        )

    def timeline_callback(self, emit: Callable[[str, Any], None]) -> Any:
        """A Trainer callback sending each step's spans through ``emit`` (see :class:`~rapydli.parallel.timeline.EmitTimeline`)."""
        from rapydli.parallel.timeline import EmitTimeline

        layout = {
            "rank": self.grid.world.Get_rank(),
            "stage": self.grid.stage,
            "replica": self.grid.replica,
            "pipeline_stages": self.grid.layout.pipeline_stages,
            "microbatches": self.config.microbatches,
            "schedule": self.config.pipeline_schedule,
            "bounds": self.bounds,
            "shared": [item.describe() for item in self.shared],
        }
        return EmitTimeline(self.recorder, emit, layout)

    def adopt(self, made: Mapping[int, torch.Tensor]) -> None:
        """Take the real parameters a model never built whole got after the split (``made``: by the meta ones' ``id``).

        The shared parameters were found, and their sub-communicators made, on the meta
        model; they now point at this rank's real tensors, and the copies start bit-equal
        (:mod:`rapydli.parallel.deferred`).
        """
        for item in self.shared:
            item.parameter = made.get(id(item.parameter), item.parameter)  # type: ignore[assignment]
        self.shared_gradients.adopt(made)
        self.shared_gradients.broadcast()
        self.module.counted_elsewhere = frozenset(self.shared_gradients.counted_elsewhere)

    def sum_shared_gradients(self) -> None:
        """Sum the gradients of parameters several stages hold over those stages (after the data-parallel average, before clipping)."""
        self.shared_gradients.sum_gradients()

    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float) -> float:
        """Forward + backward of one batch through the pipeline; the batch's mean loss on every rank."""
        assert self.executor is not None, "attach() first"
        return self.executor.train_step(inputs, targets, scale)

    @torch.no_grad()
    def evaluate(
        self, val_data: Dataset, batch_size: int, device: torch.device, metrics: Sequence[MetricFn] = ()
    ) -> torch.Tensor:
        """``[loss sum, targets]`` and each metric's ``(sum, count)`` over ``val_data``, summed over every rank (collective).

        Each replica's last stage measures its shard of ``val_data``; the other stages add zeros.
        """
        from mpi4py import MPI

        assert self.executor is not None, "attach() first"
        totals = torch.zeros(2 + 2 * len(metrics), dtype=torch.float64)
        indices = range(self.grid.replica, len(val_data), self.grid.data.Get_size())  # type: ignore[arg-type]
        self.module.eval()
        for start in range(0, len(indices), batch_size):
            batch = default_collate([val_data[i] for i in indices[start : start + batch_size]])
            inputs, targets = (t.to(device) if isinstance(t, torch.Tensor) else t for t in batch[:2])
            totals += torch.tensor(self.executor.evaluate_batch(inputs, targets, metrics), dtype=torch.float64)
        if self.grid.tensor_rank != 0:  # the tensor ranks of the last stage computed the same sums: count them once
            totals.zero_()
        self.grid.world.Allreduce(MPI.IN_PLACE, totals.numpy(), op=MPI.SUM)
        return totals

    def close(self) -> None:
        """Release the grid's communicators."""
        self.shared_gradients.free()
        self.grid.free()
