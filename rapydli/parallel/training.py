"""What the :class:`~rapydli.trainer.loop.Trainer` calls for a pipelined config.

:class:`PipelineTraining` builds the process grid, cuts the model (``pipeline_split``:
measured on rank 0 for ``"auto"``), keeps this rank's stage, and runs each step, each
evaluation and each checkpoint through the pipeline. The Trainer stays the loop: it
reads this rank's replica's data shard (every stage of a replica reads the same batch;
the first stage uses the inputs, the last the targets), averages the stage's gradients
over its data-parallel copies with its ``GradientSynchronizer``, clips, steps and logs.

Checkpoints: each stage's replica 0 writes ``stage<s>-step<N>.pt`` (its model part and
optimizer) atomically; once every stage has written, rank 0 writes
``checkpoint.pt``, naming those files with the step, the split, the sampler position
and every rank's RNG state, atomically too. A reader therefore finds the previous
complete checkpoint or the new one; stage files the manifest no longer names are
removed afterwards.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from rapydli.errors import ConfigError
from rapydli.parallel import split
from rapydli.parallel.config import split_names
from rapydli.parallel.executor import MetricFn, PipelineExecutor
from rapydli.parallel.grid import ProcessGrid
from rapydli.parallel.timeline import Recorder

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.trainer.outputs import Objective


class PipelineTraining:
    """This rank's stage of a pipelined run, and the collectives the Trainer needs for it.

    Parameters
    ----------
    model
        The whole model (built on every rank; this rank keeps its stage's blocks).
    config
        The run's ``TrainConfig`` (``pipeline_stages``, ``microbatches``,
        ``pipeline_schedule``, ``pipeline_split``).
    world
        The mpi4py communicator of every rank of the run.
    train_data
        The training set; rank 0 times the blocks on its first ``batch_size`` samples
        for ``pipeline_split="auto"``.
    objective
        The run's :class:`~rapydli.trainer.outputs.Objective` (``loss_fn``, or the loss or
        logits the model returns), made from the whole model; its ``loss`` runs on the last
        stage's outputs. An objective that needs the model's own ``forward`` (it takes the
        targets) is a :class:`ConfigError` here, before any rank measures or splits.

    Attributes
    ----------
    grid
        The :class:`~rapydli.parallel.grid.ProcessGrid`.
    bounds
        Block indices where stages begin (and the end).
    module, names
        This rank's stage (an ``nn.Sequential`` sharing the model's modules) and its
        block names.
    recorder
        The spans of this rank's last steps (:mod:`rapydli.parallel.timeline`).
    """

    def __init__(self, model: nn.Module, config: Any, world: Any, train_data: Dataset, objective: Objective) -> None:
        objective.check_pipelined(model, config.pipeline_stages)
        self.config = config
        self.grid = ProcessGrid.create(world, config.pipeline_stages)
        sample = None
        if world.Get_rank() == 0 and config.pipeline_split.strip() == "auto":
            count = min(len(train_data), config.batch_size)  # type: ignore[arg-type]
            device = next(model.parameters()).device
            sample = default_collate([train_data[i] for i in range(count)])[0].to(device)
        resumed = self._checkpoint_bounds(world) if config.resume and config.pipeline_split.strip() == "auto" else None
        # a resumed "auto" run keeps the split its checkpoint was written with
        self.bounds = resumed or split.decide(model, split_names(config.pipeline_split), config.pipeline_stages, sample, world)
        self.module, self.names = split.stage_module(model, self.bounds, self.grid.stage)
        self.loss_fn = objective.loss
        self.recorder = Recorder()
        self.executor: PipelineExecutor | None = None

    def _checkpoint_bounds(self, world: Any) -> list[int] | None:
        """The split recorded in ``checkpoint_dir``'s manifest (rank 0 reads, every rank gets it), or None."""
        from rapydli.trainer import checkpoint as ckpt

        bounds = None
        if world.Get_rank() == 0:
            path = ckpt.checkpoint_path(self.config.checkpoint_dir)
            if path.exists():
                layout = ckpt.load(path).get("pipeline")
                bounds = layout["bounds"] if layout and layout["stages"] == self.grid.stages else None
        return world.bcast(bounds, root=0)

    def data_communicator(self, algorithm: str) -> Any:
        """A Communicator over this stage's data-parallel copies (None with one replica)."""
        if self.grid.replicas == 1:
            return None
        from rapydli.comm import Communicator

        return Communicator(self.grid.data, algorithm=algorithm)

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
            "stages": self.grid.stages,
            "microbatches": self.config.microbatches,
            "schedule": self.config.pipeline_schedule,
            "bounds": self.bounds,
        }
        return EmitTimeline(self.recorder, emit, layout)

    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float) -> float:
        """Forward + backward of one batch through the pipeline; the batch's mean loss on every rank."""
        assert self.executor is not None, "attach() first"
        return self.executor.train_step(inputs, targets, scale)

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float) -> float:
        """Clip the gradient norm over every stage's parameters (the stages share one norm)."""
        grads = [p.grad for p in parameters if p.grad is not None]
        local = sum(float(g.detach().double().pow(2).sum()) for g in grads)
        total = math.sqrt(self.grid.pipeline.allreduce(local))
        factor = max_norm / (total + 1e-6)
        if factor < 1.0:
            for g in grads:
                g.detach().mul_(factor)
        return total

    @torch.no_grad()
    def evaluate(self, val_data: Dataset, batch_size: int, device: torch.device, metrics: Sequence[MetricFn] = ()) -> torch.Tensor:
        """``[loss sum, targets]`` and each metric's ``(sum, count)`` over ``val_data``, summed over every rank (collective).

        Each replica's last stage measures its shard of ``val_data``; the other stages add zeros.
        """
        from mpi4py import MPI

        assert self.executor is not None, "attach() first"
        totals = torch.zeros(2 + 2 * len(metrics), dtype=torch.float64)
        indices = range(self.grid.replica, len(val_data), self.grid.replicas)  # type: ignore[arg-type]
        self.module.eval()
        for start in range(0, len(indices), batch_size):
            batch = default_collate([val_data[i] for i in indices[start : start + batch_size]])
            inputs, targets = (t.to(device) if isinstance(t, torch.Tensor) else t for t in batch[:2])
            totals += torch.tensor(self.executor.evaluate_batch(inputs, targets, metrics), dtype=torch.float64)
        self.grid.world.Allreduce(MPI.IN_PLACE, totals.numpy(), op=MPI.SUM)
        return totals

    # -- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, trainer: Any) -> Path | None:
        """Write this stage's part (replica 0), then rank 0's manifest; collective over the world."""
        from rapydli.trainer import checkpoint as ckpt

        directory = Path(trainer.config.checkpoint_dir)
        world = self.grid.world
        name = f"stage{self.grid.stage}-step{trainer.step}.pt"
        error = None
        if self.grid.replica == 0:
            try:
                ckpt.save_atomic({"model": self.module.state_dict(), "optimizer": trainer.optimizer.state_dict()}, directory / name)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it before the manifest
                error = f"rank {world.Get_rank()}: {type(exc).__name__}: {exc}"
        rng = world.gather(ckpt.rng_state(), root=0)
        errors = [e for e in world.allgather(error) if e]
        if errors:
            raise RuntimeError("pipeline checkpoint not written: " + "; ".join(errors))
        path = None
        if world.Get_rank() == 0:
            epoch, done = divmod(trainer.step, trainer.steps_per_epoch)
            files = [f"stage{s}-step{trainer.step}.pt" for s in range(self.grid.stages)]
            state = {
                "pipeline": {"stages": self.grid.stages, "replicas": self.grid.replicas, "bounds": self.bounds, "files": files},
                "scheduler": {"name": trainer.config.lr_schedule, "step": trainer.step, "total_steps": trainer.total_steps},
                "sampler": {"epoch": epoch, "batch": done * trainer.config.grad_accum, "seed": trainer.config.seed},
                "step": trainer.step,
                "world_size": world.Get_size(),
                "rng": rng,
                "config": trainer.config.to_dict(),
            }
            path = ckpt.save_atomic(state, ckpt.checkpoint_path(directory))
        world.Barrier()  # the manifest names the new files: older stage files can go
        if self.grid.replica == 0:
            for old in directory.glob(f"stage{self.grid.stage}-step*.pt"):
                if old.name != name:
                    old.unlink(missing_ok=True)
        return path

    def resume(self, trainer: Any) -> None:
        """Load the manifest's stage file into this stage, restore RNG and step (collective)."""
        from rapydli.trainer import checkpoint as ckpt

        world = self.grid.world
        path = ckpt.checkpoint_path(trainer.config.checkpoint_dir)
        meta = None
        if world.Get_rank() == 0 and path.exists():
            state = ckpt.load(path)
            meta = {k: state.get(k) for k in ("pipeline", "step", "world_size", "rng")}
        meta = world.bcast(meta, root=0)
        if meta is None:
            return
        layout = meta["pipeline"]
        if layout is None or meta["world_size"] != world.Get_size() or layout["stages"] != self.grid.stages or layout["bounds"] != self.bounds:
            raise ConfigError(
                f"checkpoint {path} was written by {meta['world_size']} ranks with pipeline "
                f"{layout and {'stages': layout['stages'], 'bounds': layout['bounds']}}; this run has {world.Get_size()} ranks, "
                f"stages {self.grid.stages}, bounds {self.bounds}: resume with the same workers, pipeline_stages and split"
            )
        part = torch.load(path.parent / layout["files"][self.grid.stage], map_location="cpu", weights_only=False)
        self.module.load_state_dict(part["model"])
        trainer.optimizer.load_state_dict(part["optimizer"])
        ckpt.set_rng_state(meta["rng"][world.Get_rank()])
        trainer.step = trainer._evaluated_at = trainer._saved_at = meta["step"]

    def close(self) -> None:
        """Release the grid's communicators."""
        self.grid.free()
