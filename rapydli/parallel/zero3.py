"""Fully sharded parameters (ZeRO stage 3) over the data-parallel group.

Between steps a rank keeps only ``1 / N`` of each parameter: as at stage 2 the trained
parameters live end to end in flat buckets, padded to a multiple of ``N``, and rank ``r``
owns the ``r``-th slice; at stage 3 the slice is all it keeps (``local``), and the
optimizer's pieces are views of it. A bucket is the parameters of one *unit* in one
optimizer parameter group. The units are the model's blocks, the modules its forward
calls one after the other (:func:`rapydli.parallel.split.model_blocks`: a transformer's
layers, an ``nn.Sequential``'s items), and the *root*: every parameter no block holds
(embeddings, final norm, head). A parameter used by two modules (tied weights) belongs to
the first unit that holds it, and the other module gathers that unit too.

A step, on every rank of the data group:

1. forward: a block's forward pre-hook allgathers its units' buckets (``MPI.Allgather``
   of the slices into a new whole buffer; the parameters' ``.data`` become views of it);
   its forward hook frees them again and hooks the block's outputs. The root is gathered
   when the model's forward begins and kept until backward ends. The first forward
   records the order the units are gathered in; from then on gathering a unit also
   starts the next one's gather (``MPI.Iallgather``, finished when that unit is needed:
   the prefetch overlaps the current block's compute as far as MPI progresses
   non-blocking collectives);
2. backward: a hook on a block's outputs gathers its units again before the block's
   backward runs (and starts the gather of the block before it); gradients are
   reduce-scattered into the owned slices bucket by bucket as at stage 2; a unit is freed
   as soon as every parameter of it has its gradient, the rest when backward ends;
3. the optimizer updates the owned slices; nothing is gathered after the step.

A freed parameter's ``.data`` is a one-element NaN broadcast to its shape: its shape,
dtype and device stay, its memory is gone, and a use outside its block's forward (or
after :meth:`FullyShardedOptimizer.close`) gives NaN, not an old value. Use
:meth:`~rapydli.trainer.loop.Trainer.full_state_dict` for the whole model, or
:meth:`FullyShardedOptimizer.unshard` to make the module whole on every rank.

Rules, as FSDP's: every rank of the group calls the same blocks in the same order (a
block only some ranks call would leave the others waiting in its gather, or exchange the
wrong slices; in the first step the ranks compare every gather, and the end of each
backward, and refuse such a model with one error); parameters
without a gradient (a pooler called under ``no_grad``, a branch some ranks skip in the
loss) are handled as at stage 2, as DDP does with ``find_unused_parameters=True``;
frozen parameters (``requires_grad=False``) are not sharded: every rank keeps them whole.
A unit's parameters of one group are cut into buckets of about ``bucket_mb``, as at stage
2, in the order backward completes them (a transformer block's MLP, then its attention),
so a block's first bucket is reduce-scattered while the rest of its backward runs and
fewer whole gradient buffers exist at once; a parameter larger than the rest of its unit
together (an embedding) has a bucket of its own, whose gradient is reduce-scattered as
autograd made it.

Composes with the other layouts through :class:`~rapydli.parallel.layout.Layout`: with
tensor parallelism each tensor rank's slices of the split layers are sharded over its data
group; with a pipeline the module is the rank's stage (an ``nn.Sequential`` of the blocks
it runs, each a unit) sharded over the stage's replicas, every micro-batch's backward
gathering and freeing the blocks again (weights tied across stages are refused before
anything starts, as at stage 2: :func:`~rapydli.parallel.shared.check_honoured`).

Bytes per rank with ``P`` fp32 parameters: ``4P / N`` of parameters between steps plus
the whole parameters of at most three units during forward and backward (the current
one, the prefetched one, the root), ``4P / N`` of gradient slices plus the buckets being
reduce-scattered, optimizer state ``1 / N`` of the unsharded one (AdamW: ``8P / N``).

Examples
--------
On every rank::

    optimizer = FullyShardedOptimizer(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), MPI.COMM_WORLD)
    loss = model(x).sum()    # blocks gathered and freed one by one
    loss.backward()          # gathered again, gradients reduce-scattered into this rank's slices
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from rapydli.comm.tensors import address_array
from rapydli.errors import ConfigError
from rapydli.parallel.zero import ShardedOptimizer, _Bucket, _groups


class _Shard(_Bucket):
    """A bucket of which this rank keeps only its slice (``local``); ``values`` exists while the bucket is gathered."""

    def __init__(self, params: list[nn.Parameter], size: int, rank: int, group: int, unit: _Unit) -> None:
        self.shapes = [p.shape for p in params]
        super().__init__(params, size, rank, group)
        self.unit = unit
        low = rank * self.shard
        assert self.values is not None
        self.local = self.values[low : low + self.shard].clone()
        self.owned = [
            nn.Parameter(self.local[self.offsets[i] + a - low : self.offsets[i] + b - low]) for i, a, b in self.pieces
        ]
        self.placeholder = torch.full((1,), float("nan"), dtype=self.dtype, device=self.device)
        #: the whole bucket's buffer, gathered into again each time: its storage is emptied when the bucket is freed, so the
        #: weights autograd saved in forward (views of it) hold no memory until backward gathers the same storage again
        self.full = self.values
        self.values: torch.Tensor | None = None  # type: ignore[assignment]
        self.free()

    def allocate(self) -> torch.Tensor:
        """The whole buffer, its storage allocated again (its values are what the next gather writes)."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full.element_size())
        return self.full

    def attach(self) -> None:
        """Point every parameter's data at its place in ``values`` (the gathered buffer)."""
        if self.values is None:
            return
        for i, p in enumerate(self.params):
            p.data = self.values[self.offsets[i] : self.offsets[i] + p.numel()].view(self.shapes[i])

    def free(self) -> None:
        """Drop the whole buffer: every parameter's data becomes the placeholder, the buffer's storage is emptied."""
        self.values = None
        for p, shape in zip(self.params, self.shapes):
            p.data = self.placeholder.expand(shape)
        self.full.untyped_storage().resize_(0)


class _Unit:
    """The buckets of one block (or of the root) and where it stands in this step."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.params: list[nn.Parameter] = []
        self.buckets: list[_Shard] = []
        self.gathered = False
        self.users = 0  # forward calls under way that need it
        self.pending: list[
            tuple[_Shard, Any, torch.Tensor, torch.Tensor]
        ] = []  # a prefetch: (bucket, request, whole, host)
        self.got = 0  # its parameters with a gradient in this backward
        self.done = False  # every parameter has its gradient in this backward


class FullyShardedOptimizer(ShardedOptimizer):
    """ZeRO stage 3: parameters, gradients and optimizer state split across the ranks of ``comm``.

    Parameters
    ----------
    model
        The module this rank trains (the same on every rank of ``comm``: the model, its
        tensor-parallel split, or a pipeline stage). Its trained parameters' ``.data`` is
        moved into the buckets' slices; hooks gather them around each block.
    build
        ``build(params) -> torch.optim.Optimizer`` over ``model``'s parameters, with any
        parameter groups (each group is sharded on its own, as at stages 1 and 2).
    comm
        The data-parallel group (mpi4py).
    bucket_mb
        Target bucket size in MiB within a unit (see the module's description).

    Attributes
    ----------
    units
        The units, the root last (``name`` ``""``).
    gathers
        Units gathered so far (each an allgather per bucket, blocking or prefetched).
    prefetched
        Of those, the ones started ahead of their unit's use.
    peak_gathered_bytes
        The most bytes of whole (gathered) buckets held at once so far.
    """

    def __init__(
        self,
        model: nn.Module,
        build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        comm: Any,
        bucket_mb: float = 25.0,
        offload: bool = False,
    ) -> None:
        self.model = model
        self.units: list[_Unit] = []
        self._needs: dict[int, list[_Unit]] = {}  # id(module) -> the units its forward uses
        self._own: dict[int, _Unit] = {}  # id(module) -> the unit of its own parameters (or the first it uses)
        self._gather_comm = comm.Dup()
        self._order: list[_Unit] = []  # units in the order the first forward gathered them
        self._module_hooks: list[Any] = []
        self._whole = False
        self._checking = True  # until the first step: the ranks compare the units they gather
        self.gathers = self.prefetched = 0
        self._gathered_bytes = 0
        self.peak_gathered_bytes = 0  # the most bytes of whole buckets this optimizer held at once
        super().__init__(model.parameters(), build, comm, stage=3, bucket_mb=bucket_mb, offload=offload)
        self._hook_modules()

    # -- building ------------------------------------------------------------------------
    def _buckets(self, params: list[nn.Parameter], bucket_mb: float) -> list[_Bucket]:
        from rapydli.parallel.split import model_blocks

        trained = {id(p) for p in params if p.requires_grad}
        unit_of: dict[int, _Unit] = {}
        modules: list[tuple[nn.Module, _Unit]] = []
        for name, block in model_blocks(self.model):
            unit = _Unit(name)
            for p in block.parameters():
                if id(p) in trained and id(p) not in unit_of:
                    unit_of[id(p)] = unit
                    unit.params.append(p)
            modules.append((block, unit))
            self.units.append(unit)
        root = _Unit("")
        root.params = [p for p in params if id(p) in trained and id(p) not in unit_of]
        unit_of.update((id(p), root) for p in root.params)
        self.units = [u for u in self.units if u.params] + ([root] if root.params else [])
        for block, unit in modules:  # a block gathers every unit whose parameters it holds (a tied weight's too)
            needed = _unique(unit_of[id(p)] for p in block.parameters() if id(p) in unit_of)
            if needed:
                self._needs[id(block)] = needed
                self._own[id(block)] = unit if unit.params else needed[0]
        self._blocks = [block for block, _ in modules if id(block) in self._needs]
        self._root = root if root.params else None
        # buckets: each unit's parameters of each group in buckets of about bucket_mb (a parameter larger than the rest of
        # them together in one of its own), ordered as backward completes them (the root's embeddings last)
        order = {id(p): i for i, p in enumerate(params)}
        buckets: list[_Bucket] = []
        for unit in self.units:
            members = {id(p) for p in unit.params}
            for index, group in enumerate(self.optimizer.param_groups):
                mine = sorted((p for p in group["params"] if id(p) in members), key=lambda p: order[id(p)])
                for part in _apart_from_the_largest(mine):
                    for cut in _groups(part, bucket_mb):  # in backward order: each cut back in the parameters' order
                        unit.buckets.append(
                            _Shard(sorted(cut, key=lambda p: order[id(p)]), self.size, self.rank, index, unit)
                        )
                        buckets.append(unit.buckets[-1])
        buckets.sort(key=lambda b: -min(order[id(p)] for p in b.params))
        return buckets

    def _hook_modules(self) -> None:
        for block in self._blocks:
            self._module_hooks.append(block.register_forward_pre_hook(self._before_forward))
            self._module_hooks.append(block.register_forward_hook(self._after_forward))
        if self._root is not None:
            self._module_hooks.append(self.model.register_forward_pre_hook(self._before_root))
            self._module_hooks.append(self.model.register_forward_hook(self._after_root))
        for unit in self.units:
            for p in unit.params:
                self._module_hooks.append(p.register_post_accumulate_grad_hook(self._counted(unit)))

    # -- gathering and freeing -----------------------------------------------------------
    def _gather(self, unit: _Unit) -> None:
        """Make ``unit`` whole on this rank (finishing its prefetch if one was started); collective."""
        if unit.gathered and not unit.pending:
            return
        if not unit.pending:
            self._start(unit)
        for bucket, request, whole, host in unit.pending:
            request.Wait()
            if (
                host is not whole
            ):  # a storage copy: the saved views' version counter must not move (autograd would refuse them)
                whole.untyped_storage().copy_(host.untyped_storage())
            bucket.values = whole
            bucket.attach()
        unit.pending = []
        unit.gathered = True
        if unit not in self._order:
            self._order.append(unit)

    def _start(self, unit: _Unit) -> None:
        """Start the allgather of every bucket of ``unit`` (collective).

        Until the first step is done the ranks first compare which unit each gathers (one
        small allgather), so a model whose ranks call different blocks fails with one
        error instead of exchanging the wrong slices or waiting forever.
        """
        if self._checking:
            self._agree(unit.name or "the root")
        for bucket in unit.buckets:
            whole = bucket.allocate()
            host = whole if whole.device.type == "cpu" else torch.empty(bucket.padded, dtype=bucket.dtype)
            local = bucket.local if bucket.local.device.type == "cpu" else bucket.local.cpu()
            request = self._gather_comm.Iallgather(local.numpy(), address_array(host))
            unit.pending.append((bucket, request, whole, host))
        unit.gathered = True
        self.gathers += 1
        self._gathered_bytes += sum(b.padded * b.dtype.itemsize for b in unit.buckets)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self._gathered_bytes)

    def _agree(self, what: str) -> None:
        """Raise :class:`ConfigError` on every rank unless every rank of the group is at ``what`` (a block's gather, or the end of backward)."""
        wanted = self._gather_comm.allgather(what)
        if len(set(wanted)) > 1:
            named = ", ".join(f"rank {r}: {name}" for r, name in enumerate(wanted))
            raise ConfigError(
                f"zero=3: the ranks gathered different blocks at the same point ({named}): every rank of the data-parallel group "
                "must call the same blocks in the same order (a block only some ranks call cannot be fully sharded); train this "
                "model with zero=2"
            )

    def _prefetch(self, unit: _Unit, step: int) -> None:
        """Start gathering the unit ``step`` places after ``unit`` in the recorded forward order, if it is not whole yet."""
        if unit not in self._order:
            return
        position = self._order.index(unit) + step
        if 0 <= position < len(self._order):
            after = self._order[position]
            if not after.gathered and not after.done:
                self._start(after)
                self.prefetched += 1

    def _free(self, unit: _Unit) -> None:
        if unit.pending:
            self._gather(unit)  # a prefetch never used: finish it (its peers did) before dropping it
        if unit.gathered:
            self._gathered_bytes -= sum(b.padded * b.dtype.itemsize for b in unit.buckets)
        for bucket in unit.buckets:
            bucket.free()
        unit.gathered = False

    # -- hooks ---------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: Any) -> None:
        needed = self._needs[id(module)]
        for unit in needed:
            unit.users += 1
            self._gather(unit)
        self._prefetch(self._own[id(module)], 1)

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        needed = self._needs[id(module)]
        for unit in needed:
            unit.users -= 1
            if unit.users == 0 and unit is not self._root:
                self._free(unit)
        if torch.is_grad_enabled():
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._before_backward(needed, self._own[id(module)]))
        return output

    def _before_root(self, module: nn.Module, args: Any) -> None:
        assert self._root is not None
        self._gather(self._root)

    def _after_root(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled() and self._root is not None:  # evaluation: nothing comes back for it
            self._free(self._root)
        return output

    def _before_backward(self, needed: list[_Unit], own: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._queue_end()
            for unit in needed:
                if not unit.done:
                    self._gather(unit)
            self._prefetch(own, -1)

        return hook

    def _counted(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._queue_end()
            unit.got += 1
            if unit.got == len(unit.params):  # every use of its parameters has run backward
                unit.done = True
                self._free(unit)

        return hook

    def _queue_end(self) -> None:
        if not self._queued:  # the stage-2 hooks queue the same callback: one per backward
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
            self._queued = True

    def _end_of_backward(self) -> None:
        """Launch the buckets left (stage 2's end of backward), then free what is gathered."""
        super()._end_of_backward()
        if self._checking:  # a rank with a gather left in this backward learns it here, not in a later collective
            self._agree("the end of backward")
        for unit in self.units:
            if unit.gathered:
                self._free(unit)
            unit.got, unit.done = 0, False

    # -- the step and the rest -------------------------------------------------------------
    def _after_step(self) -> None:
        """Nothing to gather: the next forward gathers each unit from the updated slices."""
        for unit in self.units:
            if unit.gathered:
                self._free(unit)

    def step(self) -> None:
        """Update this rank's slices (see :meth:`ShardedOptimizer.step`); nothing is gathered after it."""
        if self._whole:
            raise RuntimeError(
                "this ZeRO-3 optimizer was unsharded (unshard()): the model is whole and no longer trained in slices"
            )
        super().step()
        self._checking = False

    def unshard(self) -> None:
        """Gather every unit for good and remove the hooks: the module holds its whole parameters again (collective).

        For a check or an export after training (it takes the whole model's memory on
        every rank); the optimizer is not stepped after it.
        """
        self._after_step()
        for unit in self.units:
            self._gather(unit)
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks = []
        self._whole = True

    def refresh(self) -> None:
        """Drop what is gathered: a load wrote into this rank's slices (the pieces), which the next forward gathers (offloaded: copied to the host)."""
        self._after_step()
        self._copy_to_host()

    def parameter_pieces(self) -> Iterator[tuple[nn.Parameter, nn.Parameter]]:
        """``(model parameter, piece)`` of every piece of this rank's slices: the piece's data is that part of the parameter."""
        for bucket in self.buckets:
            for (i, _, _), piece in zip(bucket.pieces, bucket.owned, strict=True):
                yield bucket.params[i], piece

    def sharded_ids(self) -> frozenset[int]:
        """``id()`` of every parameter held in slices (the trained ones)."""
        return frozenset(id(p) for unit in self.units for p in unit.params)

    def parameter_bytes(self) -> int:
        """Bytes of parameters this rank holds at its peak: its slices, the frozen parameters it keeps whole, and :attr:`peak_gathered_bytes`.

        Not counted: a whole buffer autograd still holds after its unit was freed (a
        block that saved a view of a parameter, not the parameter, for its backward).
        """
        sharded = self.sharded_ids()
        local = sum(b.local.numel() * b.local.element_size() for b in self.buckets)  # type: ignore[attr-defined]
        return (
            local
            + self.peak_gathered_bytes
            + sum(p.numel() * p.element_size() for p in self.model.parameters() if id(p) not in sharded)
        )

    def close(self) -> None:
        """Remove the hooks, stop the communication thread, release the gathers' communicator.

        The parameters stay sharded: their ``.data`` is the placeholder (gather the whole
        model first, with :meth:`~rapydli.trainer.loop.Trainer.full_state_dict` on rank 0
        or :meth:`unshard` on every rank).
        """
        if self._module_hooks:
            self._after_step()  # a prefetch still under way is finished (every rank of the group has the same one)
        for hook in self._module_hooks:
            hook.remove()
        self._module_hooks = []
        super().close()
        if self._gather_comm != MPI.COMM_NULL:
            self._gather_comm.Free()


def _apart_from_the_largest(params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
    """``params`` as the buckets of one unit's group: one bucket, or two when one parameter is larger than the rest together.

    That parameter (a language model's embedding, in the root) then has a bucket of its
    own, whose gradient is reduce-scattered as autograd made it, without copying it into
    a whole bucket beside it (see :func:`rapydli.parallel.zero._adoptable`).
    """
    if len(params) < 2:
        return [params] if params else []
    largest = max(params, key=lambda p: p.numel())
    if 2 * largest.numel() <= sum(p.numel() for p in params):
        return [params]
    return [[largest], [p for p in params if p is not largest]]


def _unique(units: Iterator[_Unit] | Any) -> list[_Unit]:
    out: list[_Unit] = []
    for unit in units:
        if unit not in out:
            out.append(unit)
    return out


def _tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in a module's output (a tensor, or tuples, lists and mappings of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, Mapping):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    return []
