"""Running one stage's schedule: forward, backward and the transfers between stages.

:class:`PipelineExecutor` runs the action list :mod:`rapydli.parallel.schedules` made
for its stage, moving activations and gradients with :mod:`rapydli.parallel.wire`.
The batch is cut into micro-batches with ``torch.tensor_split`` (sizes may differ by
one); the last stage scales each micro-batch's mean loss by its share of the batch's
targets, so the summed gradients are those of the batch's mean loss whatever
``microbatches`` is. With a :class:`~rapydli.comm.GradientSynchronizer` (data-parallel
copies of the stage) every backward but the stage's last runs under ``no_sync``; the
last one starts the bucket allreduces while backward goes on, as without a pipeline.

A failure in an action raises :class:`StageFailure` naming the stage and the action; an
interrupt (the notebook stopping the run after another rank failed) is re-raised as a
``KeyboardInterrupt`` whose message names the action the rank was in, which the
notebook's :class:`~rapydli.errors.RankFailure` shows beside the failed rank.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError, RapydliError
from rapydli.parallel import schedules, wire
from rapydli.parallel.timeline import Recorder

#: ``(last stage's outputs, targets) -> mean loss`` (a scalar tensor).
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
#: ``(last stage's outputs, targets) -> (sum, count)``, or ``None`` where it means nothing.
MetricFn = Callable[[Any, torch.Tensor], "tuple[float, float] | None"]


class StageFailure(RapydliError, RuntimeError):
    """An action of a pipeline stage raised; the message names the rank, stage and action."""


@dataclass
class _Micro:
    inputs: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None


class PipelineExecutor:
    """Runs this rank's stage of a pipeline, one training step at a time.

    Parameters
    ----------
    module
        This stage's part of the model.
    comm
        The pipeline's mpi4py communicator (rank = stage index).
    schedule
        Name in :data:`rapydli.parallel.schedules.SCHEDULES`.
    microbatches
        Micro-batches per step.
    loss_fn
        ``(outputs, targets) -> mean loss`` (a scalar tensor); used on the last stage.
    sync
        A :class:`~rapydli.comm.GradientSynchronizer` over this stage's data-parallel
        copies, or ``None``.
    recorder
        Where spans of every action are recorded (:class:`~rapydli.parallel.timeline.Recorder`).
    autocast
        A factory of the context forward and loss run in (bf16 autocast, or none).
    """

    def __init__(
        self,
        module: nn.Module,
        comm: Any,
        schedule: str,
        microbatches: int,
        loss_fn: LossFn,
        sync: Any = None,
        recorder: Recorder | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    ) -> None:
        self.module = module
        self.comm = comm
        self.stage, self.stages = comm.Get_rank(), comm.Get_size()
        self.microbatches = microbatches
        self.actions = schedules.build(schedule, self.stages, microbatches)[self.stage]
        self.last_backward = max(i for i, a in enumerate(self.actions) if a.kind == "backward")
        self.loss_fn = loss_fn
        self.sync = sync
        self.recorder = recorder if recorder is not None else Recorder(enabled=False)
        self.autocast = autocast
        self.device = next(module.parameters()).device
        #: the last stage of a traced model that computes its own loss: called ``module(x, targets)``
        self.takes_targets = self.last and bool(getattr(module, "takes_targets", False))
        #: a stage that runs the model's own forward (:mod:`rapydli.parallel.skipping`) reads every micro-batch's inputs
        self.reads_inputs = bool(getattr(module, "reads_inputs", False))
        self.current: schedules.Action | None = None
        self.steps = 0

    @property
    def first(self) -> bool:
        """Whether this is the first stage."""
        return self.stage == 0

    @property
    def last(self) -> bool:
        """Whether this is the last stage."""
        return self.stage == self.stages - 1

    # -- training ----------------------------------------------------------------------------
    def train_step(self, inputs: Any, targets: torch.Tensor, scale: float = 1.0) -> float:
        """Forward and backward of one batch through the pipeline; returns the batch's mean loss.

        Every stage passes the same batch (only the first reads ``inputs``, and a stage that
        runs the model's own forward, :attr:`reads_inputs`; only the last reads ``targets``).
        Gradients of ``scale`` times the mean loss accumulate in the stage's ``.grad``. The loss is broadcast from the last stage, so every stage returns it.
        """
        micro = [_Micro() for _ in range(self.microbatches)]
        in_chunks = cut(inputs, self.microbatches) if self.first or self.reads_inputs else [None] * self.microbatches
        tgt_chunks = cut(targets, self.microbatches) if self.last else [None] * self.microbatches
        total = targets.numel()
        sends: list[tuple[Any, Any]] = []
        loss_sum = 0.0
        self.recorder.begin_step(self.steps)
        for index, action in enumerate(self.actions):
            self.current = action
            mb = action.microbatch
            started = time.perf_counter()
            try:
                if action.kind == "recv_activation":
                    micro[mb].inputs = wire.recv(self.comm, self.stage - 1, "activation", mb, self.device)
                elif action.kind == "forward":
                    x = in_chunks[mb] if self.first else micro[mb].inputs
                    with self.autocast():
                        out = self._forward(x, tgt_chunks[mb], in_chunks[mb])
                        if self.last:
                            loss = self.loss_fn(out, tgt_chunks[mb])
                            micro[mb].loss = loss * (tgt_chunks[mb].numel() / total)
                            loss_sum += float(micro[mb].loss.detach())
                    micro[mb].outputs = (
                        None if self.last else out
                    )  # the last stage's outputs are not kept through backward
                    del out
                elif action.kind == "send_activation":
                    sends += wire.isend(self.comm, micro[mb].outputs, self.stage + 1, "activation", mb)
                elif action.kind == "recv_gradient":
                    grads = wire.recv(self.comm, self.stage + 1, "gradient", mb, self.device)
                    micro[mb].loss = None
                    micro[mb].outputs = (micro[mb].outputs, grads)
                elif action.kind == "backward":
                    with (
                        self.sync.no_sync()
                        if self.sync is not None and index != self.last_backward
                        else contextlib.nullcontext()
                    ):
                        self._backward(micro[mb], scale)
                    micro[mb].outputs = None
                elif action.kind == "send_gradient":
                    sends += wire.isend(self.comm, _input_grads(micro[mb].inputs), self.stage - 1, "gradient", mb)
                    micro[mb].inputs = None
            except KeyboardInterrupt:  # the run is being stopped: say where this rank was (short traceback)
                raise KeyboardInterrupt(f"pipeline stage {self.stage} was in {action} of step {self.steps}") from None
            except Exception as exc:
                raise StageFailure(
                    f"pipeline stage {self.stage} failed in {action} of step {self.steps}: {type(exc).__name__}: {exc}"
                ) from exc
            self.recorder.span(action.kind, mb, started, time.perf_counter())
        started = time.perf_counter()
        wire.wait_all([request for request, _ in sends])
        self.recorder.span("send_wait", -1, started, time.perf_counter())
        self.current = None
        self.steps += 1
        return float(self.comm.bcast(loss_sum, root=self.stages - 1))

    def _forward(self, x: Any, targets: Any, inputs: Any) -> Any:
        """The stage's forward of one micro-batch: ``x`` (its inputs, or what the stage before sent), the targets
        where the stage takes them, the inputs where it reads them besides ``x``."""
        extra = {"inputs": inputs} if self.reads_inputs and not self.first else {}
        return self.module(x, targets, **extra) if self.takes_targets else self.module(x, **extra)

    def _backward(self, micro: _Micro, scale: float) -> None:
        if self.last:
            assert micro.loss is not None
            (micro.loss * scale).backward()
            micro.loss = None
            return
        outputs, grads = micro.outputs
        outs = outputs if isinstance(outputs, tuple) else (outputs,)
        gs = grads if isinstance(grads, tuple) else (grads,)
        pairs = [(o, g) for o, g in zip(outs, gs) if g is not None and isinstance(o, torch.Tensor) and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate_batch(self, inputs: Any, targets: torch.Tensor, metrics: Sequence[MetricFn] = ()) -> list[float]:
        """Forward one batch through the pipeline without gradients.

        Returns ``[loss * targets, targets]`` followed by each metric's ``(sum, count)``
        over the batch's micro-batches (a metric that returns ``None`` adds nothing) on the
        last stage, zeros elsewhere.
        """
        totals = [0.0] * (2 + 2 * len(metrics))
        mbs = min(self.microbatches, len(targets))
        in_chunks = cut(inputs, mbs) if self.first or self.reads_inputs else [None] * mbs
        tgt_chunks = cut(targets, mbs) if self.last else [None] * mbs
        sends: list[tuple[Any, Any]] = []
        for mb in range(mbs):
            x = in_chunks[mb] if self.first else wire.recv(self.comm, self.stage - 1, "activation", mb, self.device)
            target = tgt_chunks[mb]  # None but on the last stage
            with self.autocast():
                out = self._forward(x, target, in_chunks[mb])
                loss = self.loss_fn(out, target) if target is not None else None
            if target is None or loss is None:
                sends += wire.isend(self.comm, out, self.stage + 1, "activation", mb)
                continue
            totals[0] += float(loss) * target.numel()
            totals[1] += target.numel()
            for i, metric in enumerate(metrics, start=1):  # as the Trainer's evaluate: outside autocast
                measured = metric(out, target)
                if measured is not None:
                    totals[2 * i] += float(measured[0])
                    totals[2 * i + 1] += float(measured[1])
        wire.wait_all([request for request, _ in sends])
        return totals


def cut(value: Any, microbatches: int) -> list[Any]:
    """``value`` (a tensor or tuple of tensors, batch first) in ``microbatches`` parts (sizes differ by <= 1).

    A batch smaller than ``microbatches`` is a :class:`ConfigError`.
    """
    count = value.shape[0] if isinstance(value, torch.Tensor) else value[0].shape[0]
    if count < microbatches:
        raise ConfigError(
            f"a batch of {count} samples cannot be cut into microbatches={microbatches}: lower microbatches to at most {count}"
        )
    if isinstance(value, torch.Tensor):
        return list(torch.tensor_split(value, microbatches))
    parts = [torch.tensor_split(v, microbatches) for v in value]
    return [tuple(p[i] for p in parts) for i in range(microbatches)]


def _input_grads(inputs: Any) -> Any:
    if isinstance(inputs, tuple):
        return tuple(t.grad if isinstance(t, torch.Tensor) else None for t in inputs)
    return inputs.grad
