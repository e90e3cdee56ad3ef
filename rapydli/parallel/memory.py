"""Counting the memory a rank holds for training: activations, and parameters, gradients and optimizer state.

:class:`ActivationMeter` installs ``torch.autograd.graph.saved_tensors_hooks``: every
tensor autograd saves during forward is wrapped in a holder that adds its bytes to the
meter while it lives; the holder goes when backward frees the graph. Tensors that share
storage with the model's parameters (weights saved for backward) are not activations and
are not counted; a storage saved twice is counted once while both are held. A block whose
activations are recomputed (:mod:`rapydli.parallel.recompute`) is counted as it holds memory:
its inputs from its forward until its backward, and what its recomputation saves (the bytes
its first forward would have saved) from the recomputation until the next one or the next
forward, which is when a chain of blocks has consumed them.

:func:`step_memory` measures one training step of a run's config on every rank with it.
:func:`training_bytes` counts what a rank keeps between steps: the storage of its
parameters, of its gradients (a synchronizer's buckets, ZeRO-2's slices and buckets in
flight, or plain ``.grad`` tensors) and of its optimizer state, each storage once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is Python >= 3.11; the project supports 3.10

    from rapydli.parallel.settings import LayoutSettings


class _Held:
    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter, key: int | None) -> None:
        self.tensor, self.meter, self.key = tensor, meter, key
        if key is not None:
            meter._add(key, tensor.untyped_storage().nbytes())

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._drop(self.key)


_entered: list[ActivationMeter] = []  # the meters entered in this process, innermost last


class CheckpointedBlock:
    """One forward of a recomputed block, as :class:`ActivationMeter` counts it (made by :meth:`ActivationMeter.checkpointed`)."""

    def __init__(self, meter: ActivationMeter, inputs: Iterable[Any]) -> None:
        self.meter = meter
        self.inputs = [
            t for t in inputs if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in meter._weights
        ]
        self._input_storages = {t.untyped_storage().data_ptr() for t in self.inputs}
        self.saved: dict[int, int] = {}  # storage -> bytes the first forward saved (its inputs' left out)

    @contextlib.contextmanager
    def first_forward(self) -> Iterator[None]:
        """Run inside the checkpoint's forward: tallies what autograd saves, then hands each tensor to the checkpoint."""
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if hooks is None:  # not inside a checkpoint: nothing to chain to
            yield
            return
        pack, unpack = hooks

        def counted(tensor: torch.Tensor) -> Any:
            pointer = tensor.untyped_storage().data_ptr()
            if pointer not in self.meter._weights and pointer not in self._input_storages:
                self.saved[pointer] = tensor.untyped_storage().nbytes()
            return pack(tensor)

        with torch.autograd.graph.saved_tensors_hooks(counted, unpack):
            yield

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        """Run inside the checkpoint's recomputation: its saved bytes are held from now."""
        self.meter._recomputed(sum(self.saved.values()))
        yield

    def held_until_backward(self, output: Any) -> None:
        """Count the block's inputs while the graph of ``output`` (which keeps them for the recomputation) lives."""
        node = next((t.grad_fn for t in _tensors(output) if t.grad_fn is not None), None)
        if node is not None:
            held = [_Held(t, self.meter, t.untyped_storage().data_ptr()) for t in self.inputs]
            node.metadata["rapydli_activation_meter"] = held  # type: ignore[index]  # a dict (the stubs say a method)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def current_meter() -> ActivationMeter | None:
    """The innermost :class:`ActivationMeter` entered in this process, if any."""
    return _entered[-1] if _entered else None


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
        self._recomputing = 0  # bytes the last recomputed block holds
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

    def _recomputed(self, nbytes: int) -> None:
        """A block's recomputation holds ``nbytes`` from now; the previous one's are consumed."""
        self.live += nbytes - self._recomputing
        self._recomputing = nbytes
        self.peak = max(self.peak, self.live)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is counted now (saved for backward, or a recomputed block's input)."""
        return tensor.untyped_storage().data_ptr() in self._counts

    def checkpointed(self, inputs: Iterable[Any]) -> CheckpointedBlock:
        """How a recomputed block's forward with ``inputs`` is counted (see :class:`CheckpointedBlock`)."""
        return CheckpointedBlock(self, inputs)

    def _pack(self, tensor: torch.Tensor) -> _Held:
        if self._recomputing:  # a forward again: the last backward has consumed what was recomputed
            self._recomputed(0)
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
        _entered.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _entered.remove(self)
        self._recomputed(0)
        self._hooks.__exit__(*exc)


def step_memory(
    model: nn.Module, config: LayoutSettings, train_data: Any, world: Any = None, loss_fn: Any = None
) -> dict[str, Any]:
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
    from rapydli.parallel.layout import Layout

    if config.tensor_parallel > 1:  # refused before any rank is asked anything
        raise ConfigError(
            f"step_memory measures data-parallel and pipelined configs; tensor_parallel={config.tensor_parallel} is not "
            "measured (set tensor_parallel=1)"
        )
    if world is None:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
    layout = Layout.of(config, world.Get_size())
    objective = Objective(model, loss_fn)
    pipeline = None
    part, stage, replica = model, 0, world.Get_rank()
    if layout.uses_pipeline:
        from rapydli.parallel.training import PipelineTraining

        pipeline = PipelineTraining(model, layout, config, world, train_data, objective)
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
    state = storage_bytes(
        value for entry in inner.state.values() for value in entry.values() if isinstance(value, torch.Tensor)
    )
    kept = (
        optimizer.parameter_bytes() if hasattr(optimizer, "parameter_bytes") else storage_bytes(params)
    )  # ZeRO-3: its slices
    return {"params": kept, "grads": grads, "optimizer_state": state}
