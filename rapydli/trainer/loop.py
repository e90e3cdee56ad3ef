"""The ``Trainer`` that runs on every rank, for every layout.

Each rank builds the same model (rank 0's weights are broadcast) and reads its replica's
seeded shard of the data through :func:`rapydli.data.loaders.build_loader`. The run's
:class:`~rapydli.parallel.layout.Layout` (data x pipeline x tensor, ZeRO) hands the
Trainer its part of the model (its pipeline stage, its slices of the layers: a
:class:`~rapydli.parallel.layout.ModelPart`) and what makes its gradients global (a
:class:`rapydli.comm.GradientSynchronizer` whose bucket allreduces overlap backward, or
ZeRO's sharded optimizer: :mod:`rapydli.parallel.gradients`); the loss is the run's
:class:`~rapydli.objective.Objective`. :meth:`Trainer.fit` is the loop, top to bottom in
the order it runs. Every layout checkpoints through one
:class:`~rapydli.trainer.checkpoint.CheckpointManager`, and resumes under any other.

Examples
--------
On every rank (``mpiexec -n 2 python train.py``)::

    from rapydli.trainer import Trainer, TrainConfig
    from rapydli.zoo import models, datasets

    train, val = datasets.digits()
    trainer = Trainer(models.resnet_digits(), None, train, val, TrainConfig(epochs=2))
    history = trainer.fit()
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

from rapydli.errors import ConfigError
from rapydli.objective import LossFn, MetricsArg, Objective, default_metrics, resolve_metrics
from rapydli.parallel import split
from rapydli.parallel.layout import Layout
from rapydli.trainer.callbacks import Callback, dispatch
from rapydli.trainer.checkpoint import CheckpointManager, layout_record
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.optim import OptimizerFn, apply_schedule, make_optimizer
from rapydli.trainer.outputs import global_mean
from rapydli.trainer.progress import EpochPlan, resized_config

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.parallel.zero import ShardedOptimizer


@runtime_checkable
class SizedDataset(Protocol):
    """A map-style dataset: ``len(dataset)`` samples, ``dataset[i]`` for ``0 <= i < len(dataset)``.

    What :meth:`Trainer.evaluate` and the autotuner read. :class:`torch.utils.data.Dataset`
    declares ``__getitem__`` but not ``__len__``; ``TensorDataset`` and the stores of
    :mod:`rapydli.data.store` have both.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


def loss_and_correct(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy over all positions, and the number of correct argmax predictions.

    Works for classification (``(B, C)`` logits) and language models (``(B, T, V)``).
    """
    flat = logits.reshape(-1, logits.shape[-1]).float()
    labels = targets.reshape(-1)
    return F.cross_entropy(flat, labels), (flat.argmax(-1) == labels).sum()


class Trainer:
    """Training of ``model`` on one rank, in the layout its config names; call :meth:`fit` on every rank.

    Parameters
    ----------
    model
        The model; every rank builds it, rank 0's parameters and buffers win.
    optimizer
        An optimizer over ``model``'s parameters, or ``None`` to build one with
        ``optimizer_fn``, else ``config.optimizer`` (:func:`~rapydli.trainer.optim.build_optimizer`). The lr
        schedule applies to every group from the rate it was built with
        (:mod:`rapydli.trainer.optim`).
    train_data, val_data
        Map-style datasets of ``(input, target)``; each rank reads its seeded shard.
        ``val_data`` may be ``None`` (no evaluation).
    config
        The run's :class:`TrainConfig`.
    comm
        A :class:`rapydli.comm.Communicator` (used as it is), an mpi4py communicator, or
        ``None`` for ``COMM_WORLD`` (a single process needs no MPI launcher). Over an
        mpi4py communicator the Trainer builds the run's Communicator with
        ``config.allreduce`` (the one place a run's Communicator is built) and closes it in
        :meth:`close`.
    callbacks
        Objects with any of ``on_step_end(metrics)``, ``on_eval_end(metrics)``,
        ``on_epoch_end(metrics)`` (see :mod:`rapydli.trainer.callbacks` for the keys);
        called on every rank.
    should_stop
        Called once per step on every rank; the loop ends after the step where it returns
        True. It must give every rank the same answer (the engine task passes one that
        agrees over the group). ``None``: never stop early.
    loss_fn
        ``loss_fn(outputs, targets) -> loss``; ``None``: the model's own loss, else
        cross-entropy on its logits (the rules are in :mod:`rapydli.objective`).
    optimizer_fn
        ``optimizer_fn(model)`` or ``optimizer_fn(model, config)`` returning the optimizer
        (when ``optimizer`` is ``None``).
    metrics
        Names or callables evaluated on ``val_data`` (``val_<name>``), averaged over the
        ranks; ``None``: accuracy where it means something.
    layout
        The run's :class:`~rapydli.parallel.layout.Layout`, built once where the run was
        planned (``rd.train``'s job passes it through the engine task); ``None``: the
        config's degrees over ``comm``'s ranks.

    Attributes
    ----------
    layout
        The run's :class:`~rapydli.parallel.layout.Layout` (degrees, ZeRO stage) over this world.
    part
        This rank's :class:`~rapydli.parallel.layout.ModelPart`; ``model`` is its module.
    gradients
        The gradient strategy (:mod:`rapydli.parallel.gradients`); ``optimizer`` is its optimizer.
    step
        Optimizer steps completed.
    history
        Rows of every step and evaluation (the dicts the callbacks received).
    stopped_early
        True when :meth:`fit` ended before ``total_steps`` because the notebook asked the
        task to stop (``should_stop`` returned True).
    autotune_plan
        With ``config.autotune``: the :class:`rapydli.autotune.Plan` rank 0 tuned and
        every rank applied (tuned convolutions share the original parameters).
    checkpoints
        The run's :class:`~rapydli.trainer.checkpoint.CheckpointManager` (every layout's
        checkpoints, and the whole model gathered by :meth:`full_state_dict`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        train_data: Dataset,
        val_data: SizedDataset | None,
        config: TrainConfig,
        comm: Any = None,
        callbacks: Sequence[Callback] = (),
        should_stop: Callable[[], bool] | None = None,
        *,
        loss_fn: LossFn | None = None,
        optimizer_fn: OptimizerFn | None = None,
        metrics: MetricsArg = None,
        layout: Layout | None = None,
    ) -> None:
        if not isinstance(config, TrainConfig):
            raise ConfigError(f"config must be a TrainConfig, got {type(config).__name__}")
        self.config = config
        self.mpi = _mpi_comm(comm)
        self.rank, self.world_size = self.mpi.Get_rank(), self.mpi.Get_size()
        # the loss as the whole model's forward decides it (a pipeline's last stage computes it on its outputs)
        self.objective = Objective(model, loss_fn)
        self.objective.check_pipelined(model, config.pipeline_stages, traced=not split.lists_blocks(model))
        # the layout of the ranks (data x pipeline x tensor, ZeRO): the run's (engine_task passes the one its
        # planner built), else the config's over this world; checked against the world that runs
        self.layout = layout if layout is not None else Layout.of(config, self.world_size)
        if self.layout.world_size != self.world_size:
            raise ConfigError(
                f"the layout {self.layout} is for {self.layout.world_size} ranks and this run has {self.world_size}"
            )
        # this rank's part of the model (its stage, its slices of the layers) and the communicator of its data group
        whole = model  # the unsplit model (tensor-parallel layers already cut in place): what checkpoints name parameters by
        self.part = self.layout.model_part(
            model, config, self.mpi, train_data, self.objective, comm, _resumed_bounds(config, self.mpi)
        )
        self.pipeline, self.grid, self.comm = self.part.pipeline, self.part.grid, self.part.comm
        self.data_rank, self.data_size = self.part.data_rank, self.part.data_size
        self._should_stop = should_stop
        self.model = model = self.part.model
        self.checkpoints = CheckpointManager(
            config.checkpoint_dir,
            self.mpi,
            whole,
            layout_record(self.layout, self.pipeline.bounds if self.pipeline else None),
            self.layout.coordinates(self.rank),
        )
        self.device = next(model.parameters()).device
        resolved = resolve_metrics(metrics)
        self.metrics = default_metrics() if resolved is None else resolved
        self.optimizer: torch.optim.Optimizer | ShardedOptimizer = (
            make_optimizer(model, config, optimizer_fn) if optimizer is None else optimizer
        )
        for group in self.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.callbacks = tuple(callbacks)
        self.val_data = val_data
        # a checkpoint to resume from, and what it was written with (it may be another layout, another global batch)
        resumed = self.checkpoints.read() if config.resume else None
        self._lr_scale, resume_from = 1.0, None
        if resumed is not None:
            if resumed.batch_size * resumed.grad_accum * resumed.data_size != config.global_batch(self.data_size):
                config, self._lr_scale = resized_config(config, resumed.data_size, resumed.grad_accum, self.data_size)
            self.config = config
            if resumed.data_size != self.data_size:
                resume_from = (resumed.epoch, resumed.position)
        self.loader = _loader(
            train_data, config, self.data_rank, self.data_size, resume_from, pin_memory=self.device.type == "cuda"
        )
        self.steps_per_epoch = len(self.loader) // config.grad_accum
        if self.steps_per_epoch < 1:
            raise ConfigError(
                f"TrainConfig.grad_accum={config.grad_accum} is larger than the {len(self.loader)} batches "
                f"each rank gets per epoch (batch_size={config.batch_size}, {self.data_size} data-parallel ranks): lower it"
            )
        self.plan = EpochPlan(self.steps_per_epoch, config.epochs)
        if resume_from is not None:
            epoch, start = resume_from
            steps = self.loader.batches_in(epoch) // config.grad_accum
            self.plan = EpochPlan(self.steps_per_epoch, config.epochs, resumed.step, epoch, start, steps)  # type: ignore[union-attr]
        self.total_steps = self.plan.total(config.max_steps)
        self.autotune_plan: Any = None
        if config.autotune:
            self._autotune(train_data)
        # what makes the gradients global (a synchronizer, ZeRO's sharded optimizer over the optimizer's groups, or nothing)
        self.gradients = self.layout.gradients(self.part, self.optimizer, config, self._autocast)
        self.optimizer, self.sync = self.gradients.optimizer, self.gradients.sync
        self.step = 0
        self.epoch = 0
        self._evaluated_at = self._saved_at = 0  # the step of the last evaluation / checkpoint
        self.history: list[dict[str, Any]] = []
        #: rank 0's rows of the attempts before the checkpoint this run resumed from (``[]`` when it did not)
        self.resumed_history: list[dict[str, Any]] = resumed.history if resumed is not None else []
        self.stopped_early = False
        self._started = time.perf_counter()
        if resumed is not None:  # every rank loads its pieces of the checkpoint, cut for this layout
            self.step = self._evaluated_at = self._saved_at = self.checkpoints.load(self.model, self.optimizer)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> list[dict[str, Any]]:
        """Train to ``total_steps`` (``epochs``, capped by ``max_steps``); return :attr:`history`.

        A checkpoint being written is on disk when ``fit`` returns, and also when it raises
        (a callback's exception, Ctrl-C): a run resumed from that directory starts there.
        """
        try:
            self._train()
        except BaseException:
            self.checkpoints.wait(raise_error=False)  # the training error is the one to report
            raise
        self.checkpoints.wait()
        return self.history

    def _train(self) -> None:
        cfg = self.config
        while self.step < self.total_steps:
            epoch, done_in_epoch, steps_in_epoch = self.plan.locate(self.step)
            self.epoch = epoch
            self.loader.set_epoch(epoch, skip_batches=done_in_epoch * cfg.grad_accum)
            batches = iter(self.loader)
            epoch_losses: list[float] = []
            epoch_started = time.perf_counter()
            for _ in range(done_in_epoch, steps_in_epoch):
                if self.step >= self.total_steps:
                    break
                # learning rate of this step (warm-up, then the schedule), every group from its own initial rate
                lr = apply_schedule(self.optimizer, cfg, self.step, self.total_steps, scale=self._lr_scale)[0]

                # evaluate and checkpoint every N steps (once per step: not again after an epoch end or a resume)
                if cfg.eval_every and self.step % cfg.eval_every == 0 and self._evaluated_at < self.step:
                    self.evaluate()
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0 and self._saved_at < self.step:
                    self.save_checkpoint()

                # forward + backward over grad_accum micro-batches; only the last one syncs
                started = time.perf_counter()
                self.model.train()
                loss_sum, weighted, samples, data_time = 0.0, 0.0, 0, 0.0
                for micro in range(cfg.grad_accum):
                    fetch = time.perf_counter()
                    with torch.random.fork_rng(
                        devices=[]
                    ):  # loaders draw seeds; keep the model's RNG stream theirs alone
                        inputs, targets = _to_device(next(batches), self.device)
                    data_time += time.perf_counter() - fetch
                    last = micro == cfg.grad_accum - 1
                    with self.gradients.no_sync() if not last else contextlib.nullcontext():
                        micro_loss = self._forward_backward(inputs, targets)
                    loss_sum, weighted, samples = (
                        loss_sum + micro_loss,
                        weighted + micro_loss * len(inputs),
                        samples + len(inputs),
                    )
                comm_time = comm_wait = hidden = 0.0
                stats = self.gradients.wait()
                if stats is not None:
                    comm_time, comm_wait, hidden = stats.comm_time, stats.wait_time, stats.hidden_fraction
                if (
                    self.pipeline is not None
                ):  # parameters several stages hold (tied embeddings): one gradient, summed over them
                    self.pipeline.sum_shared_gradients()

                # clip the global gradient norm (gradients are already averaged; stages, tensor shards and ZeRO-2 slices add up to one norm)
                grad_norm = None
                if cfg.grad_clip is not None:
                    from rapydli.parallel.clip import clip_grad_norm_

                    grad_norm = clip_grad_norm_(self.model, cfg.grad_clip, self.grid, self.gradients.sharded)

                # optimizer step
                self.optimizer.step()
                self.gradients.zero_grad()
                self.step += 1

                # log: metrics to the history and the callbacks; the loss is the global batch's (over the data-parallel ranks)
                step_time = time.perf_counter() - started
                data_group = self.grid.data if self.grid is not None else self.mpi
                row = {
                    "kind": "train",
                    "step": self.step,
                    "epoch": epoch,
                    "loss": global_mean(data_group, weighted, samples),
                    "rank_loss": loss_sum / cfg.grad_accum,
                    "lr": lr,
                    "samples_per_s": samples * self.data_size / step_time,
                    "step_time_s": step_time,
                    "data_time_s": data_time,
                    "comm_time_s": comm_time,
                    "comm_wait_s": comm_wait,
                    "comm_hidden_fraction": hidden,
                    "grad_norm": grad_norm,
                    "rank": self.rank,
                    "world_size": self.world_size,
                    "time_s": time.perf_counter() - self._started,
                }
                epoch_losses.append(row["loss"])
                self.history.append(row)
                dispatch(self.callbacks, "on_step_end", row)

                # stop early when the notebook asked: every rank gets the same answer, so all stop after this step
                if self._stop_requested():
                    self.stopped_early = True
                    break

            # end of an epoch (or of the run): evaluate, checkpoint, tell the callbacks
            if epoch_losses:
                val = self.evaluate()
                if cfg.checkpoint_dir is not None and self._saved_at < self.step:
                    self.save_checkpoint()
                elapsed = time.perf_counter() - epoch_started
                summary = {
                    "epoch": epoch,
                    "step": self.step,
                    "train_loss": sum(epoch_losses) / len(epoch_losses),
                    "epoch_time_s": elapsed,
                    "samples_per_s": len(epoch_losses) * cfg.global_batch(self.data_size) / elapsed,
                    "rank": self.rank,
                    **{k: v for k, v in val.items() if k.startswith("val_")},
                }
                dispatch(self.callbacks, "on_epoch_end", summary)
            if self.stopped_early:
                break

    def close(self) -> None:
        """Finish a checkpoint still being written; remove the gradient hooks; release the communicator the trainer built."""
        self.checkpoints.close()
        self.gradients.close()
        self.part.close()
        self.comm = None

    # -- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, Any]:
        """Loss and the metrics on ``val_data``, averaged over every rank's shard.

        Floating buffers (BatchNorm statistics) are first averaged across ranks, so every
        rank evaluates, and later checkpoints, the same model. Returns the eval row (empty
        when there is no validation data).
        """
        self._average_buffers()
        self._evaluated_at = self.step
        if self.val_data is None or len(self.val_data) == 0:
            return {}
        self.model.eval()
        names = ["loss", *self.metrics]
        totals = torch.zeros(2 * len(names), dtype=torch.float64)  # (sum, count) of the loss and of each metric
        indices = range(
            self.data_rank, len(self.val_data), self.data_size
        )  # disjoint shards, no padding (a replica's ranks share one)
        if self.pipeline is not None:  # through the pipeline: the last stages' sums, over every rank
            totals = self.pipeline.evaluate(
                self.val_data,  # type: ignore[arg-type]
                self.config.batch_size,
                self.device,
                list(self.metrics.values()),
            )
            indices = range(0)
        for start in range(0, len(indices), self.config.batch_size):
            batch = [self.val_data[i] for i in indices[start : start + self.config.batch_size]]
            inputs, targets = _to_device(torch.utils.data.default_collate(batch), self.device)
            with self._autocast():
                loss, outputs = self.objective(self.model, inputs, targets)
            totals[0:2] += torch.tensor([loss.item() * targets.numel(), float(targets.numel())], dtype=torch.float64)
            for m, metric in enumerate(self.metrics.values(), start=1):
                measured = metric(outputs, targets)  # (sum, count), or None where it means nothing
                if measured is not None:
                    totals[2 * m : 2 * m + 2] += torch.tensor(measured, dtype=torch.float64)
        if self.data_size > 1 and self.pipeline is None:
            self.comm.allreduce_(totals, op="sum")
        averages = {
            f"val_{name}": float(totals[2 * i] / totals[2 * i + 1])
            for i, name in enumerate(names)
            if totals[2 * i + 1] > 0
        }
        row = {
            "kind": "eval",
            "step": self.step,
            "epoch": self.epoch,
            **averages,
            "rank": self.rank,
            "world_size": self.world_size,
            "time_s": time.perf_counter() - self._started,
        }
        self.history.append(row)
        dispatch(self.callbacks, "on_eval_end", row)
        return row

    # -- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path | None:
        """Write the run's state: a part per rank that holds state of its own, then rank 0's manifest (:mod:`rapydli.trainer.checkpoint`).

        The step waits for a copy of the state in memory only; threads write the files
        (atomically), and the next checkpoint, :meth:`fit`'s end and :meth:`close` wait for
        them. Returns the manifest's path on rank 0, ``None`` elsewhere or without
        ``checkpoint_dir``. Collective: call on every rank.
        """
        if self.config.checkpoint_dir is None:
            return None
        self._average_buffers()
        self._saved_at = self.step
        epoch, position = self.plan.position(self.step, self.config.global_batch(self.data_size))
        progress = {"epoch": epoch, "position": position, "data_size": self.data_size, "grad_accum": self.config.grad_accum,
                    "batch_size": self.config.batch_size, "total_steps": self.total_steps, "seed": self.config.seed,
                    "lr_schedule": self.config.lr_schedule, "config": self.config.to_dict(),
                    "history": self.resumed_history + self.history if self.rank == 0 else []}  # fmt: skip
        return self.checkpoints.save(self.step, self.model, self.optimizer, progress)

    def save_model(self, directory: str | Path) -> None:
        """Write the trained model as it lies on the ranks to ``directory``, each rank its pieces (no rank gathers it).

        :func:`rapydli.trainer.checkpoint.read_state_dict` assembles it whole, and
        :func:`~rapydli.trainer.checkpoint.iter_state` tensor by tensor. Collective.
        """
        self._average_buffers()
        self.checkpoints.write_model(directory, self.step, self.model, self.optimizer)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state (gathered from the stages, tensor slices and ZeRO's buckets) on rank 0, ``None`` elsewhere.

        Keys are the unsplit model's names, tensors on the CPU. Collective.
        """
        self._average_buffers()
        return self.checkpoints.gather_state(self.model, self.optimizer)

    # -- helpers ----------------------------------------------------------------------------
    def _stop_requested(self) -> bool:
        """Whether ``should_stop`` says to stop after this step (the same answer on every rank)."""
        return self._should_stop is not None and self._should_stop()

    def _autotune(self, train_data: Dataset) -> None:
        """Tune the convolutions once on rank 0, share the picklable plan, apply it on every rank."""
        from rapydli.autotune import apply_plan, plan_for

        plan, error = None, None
        if self.rank == 0:
            try:
                assert isinstance(train_data, SizedDataset)  # the loader built in __init__ already took its len()
                count = min(len(train_data), self.config.batch_size)
                example = torch.utils.data.default_collate([train_data[i] for i in range(count)])[0]
                plan = plan_for(
                    self.model, example.to(self.device), mode="train", budget_s=self.config.autotune_budget_s
                )
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, not block in bcast
                error = f"{type(exc).__name__}: {exc}"
        plan, error = self.mpi.bcast((plan, error), root=0)
        if error is not None:
            raise RuntimeError(f"autotuning on rank 0 failed: {error}")
        apply_plan(self.model, plan)
        self.autotune_plan = plan

    def _average_buffers(self) -> None:
        if self.data_size == 1:
            return
        for buffer in self.model.buffers():
            if buffer.is_floating_point():
                self.comm.allreduce_(buffer.data, op="avg")

    def _forward_backward(self, inputs: Any, targets: torch.Tensor) -> float:
        """Forward and backward of one micro-step (through the pipeline when there is one); its loss."""
        if self.pipeline is not None:
            return self.pipeline.train_step(inputs, targets, 1.0 / self.config.grad_accum)
        with self._autocast():
            loss = self.objective(self.model, inputs, targets)[0]  # the outputs (logits) are not kept through backward
        (loss / self.config.grad_accum).backward()
        return loss.item()

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.config.precision == "bf16")


def _to_device(batch: Any, device: torch.device) -> tuple[Any, ...]:
    return tuple(item.to(device, non_blocking=True) if isinstance(item, torch.Tensor) else item for item in batch)


def _loader(
    dataset: Dataset,
    config: TrainConfig,
    rank: int,
    world_size: int,
    resume_from: tuple[int, int] | None,
    pin_memory: bool = False,
) -> Any:
    from rapydli.data.loaders import build_loader

    disk_dir = None
    if config.cache_disk_mb > 0 and config.checkpoint_dir is not None:
        disk_dir = str(Path(config.checkpoint_dir) / f"cache-rank{rank}")
    return build_loader(
        dataset,
        batch_size=config.batch_size,
        rank=rank,
        world_size=world_size,
        seed=config.seed,
        epochs=config.epochs,
        kind=config.loader,
        num_workers=config.num_workers,
        cache_ram_mb=config.cache_ram_mb,
        cache_disk_mb=config.cache_disk_mb,
        disk_dir=disk_dir,
        resume_from=resume_from,
        pin_memory=pin_memory,
    )


def _resumed_bounds(config: TrainConfig, world: Any) -> list[int] | None:
    """The split a resumed ``"auto"`` pipeline keeps: the one its checkpoint recorded (same stage count), else None."""
    if not config.resume or config.pipeline_split.strip() != "auto":
        return None
    from rapydli.trainer.checkpoint import read_layout

    shape = read_layout(config.checkpoint_dir, world)
    return shape["bounds"] if shape is not None and shape["pipeline_stages"] == config.pipeline_stages else None


def _mpi_comm(comm: Any) -> Any:
    """The mpi4py communicator under ``comm`` (a Communicator, or an mpi4py one), or ``COMM_WORLD``."""
    if comm is not None:
        return getattr(comm, "mpi_comm", comm)
    from mpi4py import MPI

    return MPI.COMM_WORLD
