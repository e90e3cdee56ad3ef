"""Counting the memory a rank holds for training: activations, and parameters, gradients and optimizer state.

:class:`ActivationMeter` installs ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd saves during forward is wrapped in a holder that adds its bytes to the
meter while it lives; the holder goes when backward frees the graph. Tensors that share
storage with the model's parameters (weights saved for backward) are not activations and
are not counted; a storage saved twice is counted once while both are held.

:func:`step_memory` measures one training step of a run's config on every rank with it.
:func:`training_bytes` counts what a rank keeps between steps: the storage of its
parameters, of its gradients (a synchronizer's buckets, ZeRO-2's slices and buckets in
flight, or plain ``.grad`` tensors) and of its optimizer state, each storage once.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python >= 3.11; the project supports 3.10


class _Held:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int | None) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key
        if key is not None:
            meter._add(key, tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._drop(self.key)


class ActivationMeter:
    """Live and peak bytes of tensors saved for backward while the meter is entered.

    Parameters
    ----------
    parameters
        Tensors whose storage is not counted: the model's parameters, and anything else
        that is not an activation (e.g. the input batch, there whatever the schedule).

    Examples
    --------
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
    >>> with ActivationMeter(model.parameters()) as meter:
    ...     loss = model(torch.randn(8, 4)).sum()
    >>> meter.live > 0 and meter.peak >= meter.live
    True
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()) -> None:
        self._weights = {p.untyped_storage().data_ptr() for p in parameters}
        self._counts: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]
        self.live = 0
        self.peak = 0
        self._hooks: Any = None

    def _add(self, key: int, nbytes: int) -> None:
        entry = self._counts.setdefault(key, [0, nbytes])
        entry[0] += 1
        if entry[0] == 1:
            self.live += nbytes
            self.peak = max(self.peak, self.live)

    def _drop(self, key: int) -> None:
        entry = self._counts[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._counts[key]

    def _pack(self, tensor: torch.Tensor) -> _Held:
        pointer = tensor.untyped_storage().data_ptr()
        return _Held(tensor, self, None if pointer in self._weights else pointer)

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live

    def __enter__(self) -> Self:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def step_memory(model: nn.Module, config: Any, train_data: Any, world: Any = None, loss_fn: Any = None) -> dict[str, Any]:
    """Peak activation bytes of one training step of ``config`` on this rank (collective over ``world``).

    Call it on every rank of the run's world (e.g. with ``Cluster.run``). Pipelined
    (``pipeline_stages > 1``): this rank's stage of ``config.pipeline_split`` runs one step
    of the config's schedule and micro-batches through the pipeline, on its replica's first
    ``batch_size`` samples (give the run's own split: ``"auto"`` measures and may choose
    another). Otherwise: the whole model on this rank's first ``batch_size`` samples. The
    input batch is not counted; the loss (``loss_fn``, else the model's outputs as
    :class:`~rapydli.objective.Objective` reads them) is.
    A tensor-parallel config is a :class:`~rapydli.errors.ConfigError` (its layers' slices
    are not measured here).

    Returns
    -------
    dict
        ``rank``, ``stage``, ``replica``, ``peak_activation_bytes`` and ``parameters`` (of
        the part of the model this rank holds).
    """
    import contextlib

    from torch.utils.data import default_collate

    from rapydli.errors import ConfigError
    from rapydli.objective import Objective

    if config.tensor_parallel > 1:
        raise ConfigError(
            f"step_memory measures data-parallel and pipelined configs; tensor_parallel={config.tensor_parallel} is not "
            "measured (set tensor_parallel=1)"
        )
    if world is None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    objective = Objective(model, loss_fn)
    pipeline = None
    part, stage, replica = model, 0, world.Get_rank()
    if config.pipeline_stages > 1:
        from rapydli.parallel.training import PipelineTraining

        pipeline = PipelineTraining(model, config, world, train_data, objective)
        pipeline.attach(None, contextlib.nullcontext)
        part, stage, replica = pipeline.module, pipeline.grid.stage, pipeline.grid.replica
    first = replica * config.batch_size
    inputs, targets = default_collate([train_data[i] for i in range(first, first + config.batch_size)])[:2]
    try:
        with ActivationMeter([*part.parameters(), inputs]) as meter:
            if pipeline is not None:
                pipeline.train_step(inputs, targets, 1.0)
            else:
                objective(model, inputs, targets)[0].backward()
    finally:
        if pipeline is not None:
            pipeline.close()
    return {
        "rank": world.Get_rank(),
        "stage": stage,
        "replica": replica,
        "peak_activation_bytes": meter.peak,
        "parameters": sum(p.numel() for p in part.parameters()),
    }


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages under ``tensors`` (views of one buffer count it once; ``None`` is skipped)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        if tensor is not None:
            storage = tensor.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def training_bytes(model: torch.nn.Module, optimizer: Any, sync: Any = None) -> dict[str, int]:
    """``{"params", "grads", "optimizer_state"}``: bytes this rank holds for training ``model``.

    Call it after a backward (plain ``.grad`` tensors exist then). ``optimizer`` is a
    ``torch.optim.Optimizer`` or a :class:`~rapydli.parallel.zero.ShardedOptimizer`
    (at ZeRO-3 the parameters are its slices plus the most whole blocks it gathered at once);
    ``sync`` the :class:`~rapydli.comm.GradientSynchronizer` whose buckets hold the
    gradients, if there is one.
    """
    from rapydli.parallel.zero import ShardedOptimizer

    params = list(model.parameters())
    if sync is not None:
        grads = sync.buffer_bytes()
    elif isinstance(optimizer, ShardedOptimizer) and optimizer.stage >= 2:
        grads = optimizer.gradient_bytes()
    else:
        grads = storage_bytes(p.grad for p in params)
    inner = optimizer.optimizer if isinstance(optimizer, ShardedOptimizer) else optimizer
    state = storage_bytes(value for entry in inner.state.values() for value in entry.values() if isinstance(value, torch.Tensor))
    kept = optimizer.parameter_bytes() if hasattr(optimizer, "parameter_bytes") else storage_bytes(params)  # ZeRO-3: its slices
    return {"params": kept, "grads": grads, "optimizer_state": state}
