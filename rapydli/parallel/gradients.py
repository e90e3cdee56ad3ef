"""What makes a rank's gradients global: the gradient strategy a :class:`~rapydli.parallel.layout.Layout` hands the Trainer.

Three strategies behind one small interface (:class:`Gradients`), chosen once by the layout:

* :class:`Local`: one replica, nothing to average (a single process, or a replica that is
  the whole world: stages and tensor slices exchange activations, not gradients);
* :class:`Synchronized`: a :class:`~rapydli.comm.GradientSynchronizer` over the data group
  averages each bucket while backward still runs (DDP's way); with ZeRO-1 the optimizer
  it steps is a :class:`~rapydli.parallel.zero.ShardedOptimizer` that keeps ``1 / N`` of
  the state;
* :class:`ReduceScattered`: ZeRO-2, where the sharded optimizer reduce-scatters each
  bucket during backward and keeps only its slices' averaged gradients; and ZeRO-3,
  where the optimizer (:class:`~rapydli.parallel.zero3.FullyShardedOptimizer`) also keeps
  only its slices of the parameters and gathers each block's around its forward and
  backward.

``TrainConfig.offload_optimizer``: the sharded optimizer keeps its state and steps in host
memory (:class:`~rapydli.parallel.zero.ShardedOptimizer`'s ``offload``); on CPU ranks,
where everything is in host memory already, it changes nothing.

The loop calls, every step: ``no_sync()`` around the micro-steps that only accumulate,
``wait()`` after the last backward, the optimizer's ``step()``, then ``zero_grad()``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.comm.synchronizer import SyncStats
    from rapydli.parallel.layout import Layout, ModelPart
    from rapydli.parallel.settings import StepSettings


class Gradients:
    """The interface: one replica's gradients, nothing to average (:class:`Local` is this).

    Attributes
    ----------
    optimizer
        The optimizer the loop steps (the one given, or the ZeRO optimizer built over it).
    sync
        The :class:`~rapydli.comm.GradientSynchronizer`, or ``None``.
    sharded
        At ZeRO-2 and 3 the :class:`~rapydli.parallel.zero.ShardedOptimizer` that holds this
        rank's slices of the gradients (global-norm clipping reads them), else ``None``.
    """

    sync: Any = None
    sharded: Any = None

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Context of a micro-step whose gradients only accumulate."""
        return contextlib.nullcontext()

    def wait(self) -> SyncStats | None:
        """Wait for the step's gradients to be global; the communication timings (``None``: none)."""
        return None

    def zero_grad(self) -> None:
        """Clear the gradients for the next step."""
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Remove hooks and release what this strategy holds."""


class Local(Gradients):
    """One replica: the gradients backward leaves are already the global ones."""


class Synchronized(Gradients):
    """A :class:`~rapydli.comm.GradientSynchronizer` averages the gradients over the data group."""

    def __init__(self, optimizer: Any, sync: Any) -> None:
        super().__init__(optimizer)
        self.sync = sync

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self.sync.no_sync()

    def wait(self) -> SyncStats:
        return self.sync.wait()

    def zero_grad(self) -> None:
        self.sync.zero_grad()  # the next backward's gradients are copied into the buckets

    def close(self) -> None:
        self.sync.close()
        if hasattr(self.optimizer, "close"):
            self.optimizer.close()


class ReduceScattered(Gradients):
    """ZeRO-2 and 3: the sharded optimizer reduce-scatters each bucket as backward completes it."""

    def __init__(self, optimizer: Any) -> None:
        super().__init__(optimizer)
        self.sharded = optimizer

    def wait(self) -> SyncStats:
        return self.optimizer.wait()

    def close(self) -> None:
        self.optimizer.close()


class _ShardedLocal(Gradients):
    """ZeRO-1 over one replica: the sharded optimizer (of one shard) steps; nothing is averaged."""

    def close(self) -> None:
        self.optimizer.close()


def build(layout: Layout, part: ModelPart, optimizer: torch.optim.Optimizer, config: StepSettings) -> Gradients:
    """The strategy of ``layout`` for ``part`` (see :meth:`rapydli.parallel.layout.Layout.gradients`)."""
    model, comm = part.model, part.comm if layout.uses_data_parallel else None  # one replica: nothing to average
    offload = bool(
        getattr(config, "offload_optimizer", False)
    )  # on CPU ranks the state is in host memory already: a no-op
    if layout.uses_zero:
        from rapydli.parallel import deferred
        from rapydli.parallel.zero import ShardedOptimizer

        data = part.grid.data if part.grid is not None else (comm.mpi_comm if comm is not None else None)
        if data is None:
            from mpi4py import MPI

            data = MPI.COMM_SELF
        sync = None
        if (
            layout.zero >= 2
        ):  # no synchronizer: parameters start as replica 0's, the optimizer reduce-scatters the gradients
            if comm is not None:
                for tensor in (*model.parameters(), *model.buffers()):
                    if deferred.is_lazy(
                        tensor
                    ):  # never built whole: every replica computes the same values from the recording
                        continue
                    values = tensor.data.contiguous()  # a split Conv1D keeps a transposed view
                    comm.broadcast_(values, 0)
                    if values is not tensor.data:
                        tensor.data.copy_(values)
        elif comm is not None:
            sync = _synchronizer(model, comm, config)
        sharded: ShardedOptimizer
        if layout.zero == 3:
            from rapydli.parallel.zero3 import FullyShardedOptimizer

            sharded = FullyShardedOptimizer(
                model, lambda _: optimizer, data, bucket_mb=config.bucket_mb, offload=offload
            )
        else:
            sharded = ShardedOptimizer(
                model.parameters(),
                lambda _: optimizer,
                data,
                stage=layout.zero,
                bucket_mb=config.bucket_mb,
                offload=offload,
            )
        for group in sharded.param_groups:
            group.setdefault("initial_lr", group["lr"])
        if layout.zero >= 2:
            return ReduceScattered(sharded)
        return Synchronized(sharded, sync) if sync is not None else _ShardedLocal(sharded)
    if comm is None:
        return Local(optimizer)
    return Synchronized(optimizer, _synchronizer(model, comm, config))


def _synchronizer(model: Any, comm: Any, config: StepSettings) -> Any:
    from rapydli.comm import GradientSynchronizer

    sync = GradientSynchronizer(model, comm, bucket_mb=config.bucket_mb, overlap=config.overlap)
    sync.broadcast_parameters()
    return sync
