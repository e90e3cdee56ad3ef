"""Sharded optimizer state (ZeRO stages 1 and 2) over the data-parallel group.

Every rank keeps the whole model but only ``1 / N`` of the optimizer state. The
parameters are grouped into buckets of about ``bucket_mb`` in backward order (as the
:class:`~rapydli.comm.GradientSynchronizer` groups them); each bucket's parameters *live*
end to end in one flat buffer (``param.data`` is a view into it), padded to a multiple of
``N``, and rank ``r`` owns the ``r``-th equal slice of every bucket. The inner optimizer
runs over views of the owned slices (one per parameter the slice touches), so it keeps
state for ``1 / N`` of the elements and writes its update straight into the model. A step:

1. gradients: stage 1 takes the gradients the ``GradientSynchronizer`` averaged (the
   owned pieces' gradients are views into them, nothing is copied); stage 2 copies each
   parameter's gradient into its bucket from a gradient hook and drops it, and
   reduce-scatters a bucket (``MPI.Reduce_scatter_block`` on the communication thread)
   as soon as backward completes it, so each rank keeps only the averaged gradient of
   its own slices (at most :data:`IN_FLIGHT` full buckets exist at a time). A bucket's
   whole buffer is made only once its gradients come to ``1 /`` :data:`HOLD_FRACTION` of it (or
   the last comes): small ones that come early wait as autograd made them. A bucket of
   one parameter is reduce-scattered from the gradient autograd made, without a copy;
2. the optimizer updates the owned slices (Adam's moments, SGD's momentum: elementwise,
   so a slice updates exactly as the same elements of the whole would);
3. every bucket is allgathered in place (``MPI.Allgather``), which updates every rank's
   parameters.

Parameters without a gradient are handled as DDP does with ``find_unused_parameters=True``.
Stage 1 takes the synchronizer's gradients, which already are. Stage 2 marks each
parameter whose gradient hook ran since :meth:`~ShardedOptimizer.zero_grad` (over every
micro-step) and reduces the marks over the group once per step (one small
``MPI.Allreduce``, ``MAX``): a parameter some ranks used is averaged with zeros from the
others; the owned pieces of one no rank used get ``grad=None`` for that step, so the
optimizer leaves them alone (no momentum, no weight decay).

Bytes per rank with ``P`` fp32 parameters: ``4P`` of parameters, gradients ``4P``
(stage 1, the synchronizer's buckets) or ``4P / N`` plus the buckets in flight
(stage 2), optimizer state ``1 / N`` of the unsharded one (AdamW: ``8P / N``), plus at
most ``N - 1`` elements of padding per bucket. Gradient clipping by global norm is the
caller's, before :meth:`ShardedOptimizer.step`: at stage 2 over :meth:`~ShardedOptimizer.gradient_pieces`
(:func:`rapydli.parallel.clip.clip_grad_norm_` sums their squares over the group).

Examples
--------
On every rank::

    optimizer = ShardedOptimizer(model.parameters(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), MPI.COMM_WORLD, stage=2)
    loss.backward()          # no synchronizer at stage 2: the buckets are reduce-scattered during backward
    optimizer.step()
    optimizer.zero_grad()
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from rapydli.comm.synchronizer import SyncStats
from rapydli.errors import ConfigError
from rapydli.parallel import deferred

STAGES = (1, 2)

#: Stages a subclass may run (3: :class:`~rapydli.parallel.zero3.FullyShardedOptimizer`).
_ALL_STAGES = (1, 2, 3)

#: Stage 2: gradient buckets being reduce-scattered at once; launching one more first waits for the oldest.
IN_FLIGHT = 2

#: Stage 2: a bucket's gradients are held as autograd made them, and its whole buffer made only when they come to more
#: than ``1 / HOLD_FRACTION`` of it or the last one comes: a bucket whose small gradients come early (a final norm's, at
#: the start of backward) and whose large one comes last (a tied embedding's, at the end) is not kept whole all backward.
HOLD_FRACTION = 8


class _Bucket:
    """Parameters whose values live end to end in ``values``; this rank's slice and the pieces of it."""

    def __init__(self, params: list[nn.Parameter], size: int, rank: int, group: int = 0) -> None:
        self.params = params
        self.group = group  # the index of the optimizer's parameter group the bucket's parameters belong to
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // size)  # elements per rank
        self.padded = self.shard * size  # elements of the whole bucket, padding included
        first = params[0]
        self.dtype, self.device = first.dtype, first.device
        self.values = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        self.offsets: list[int] = []
        offset = 0
        with torch.no_grad():
            for p in params:
                self.values[offset : offset + p.numel()].copy_(
                    deferred.value(p).reshape(-1)
                )  # a model never built whole: made now
                if deferred.is_lazy(p):
                    p.data = self.values[offset : offset + p.numel()].view(p.shape)
                    deferred.forget(p)
                self.offsets.append(offset)
                offset += p.numel()
        self.attach()
        low, high = rank * self.shard, (rank + 1) * self.shard
        #: (parameter index, first and end element within it) of each piece of this rank's slice
        self.pieces = [
            (i, max(low, start) - start, min(high, start + p.numel()) - start)
            for i, (p, start) in enumerate(zip(params, self.offsets))
            if max(low, start) < min(high, start + p.numel())
        ]
        self.owned = [nn.Parameter(self.values[self.offsets[i] + a : self.offsets[i] + b]) for i, a, b in self.pieces]
        self.grad_shard: torch.Tensor | None = None  # stage 2: the averaged gradient of this rank's slice
        self.grads: torch.Tensor | None = None  # stage 2: the bucket's local gradients until they are reduce-scattered
        #: stage 2: gradients that came before ``grads`` exists, as autograd made them (small ones: see ``ShardedOptimizer._hook``)
        self.held: list[tuple[int, torch.Tensor]] = []
        self.missing = len(params)
        self.ready = [False] * len(params)  # stage 2: got a gradient in this backward
        self.used = [False] * len(params)  # stage 2: got a gradient on this rank since the last zero_grad

    def view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.values[self.offsets[i] : self.offsets[i] + p.numel()].view_as(p)

    def attach(self) -> None:
        """Point every parameter's data at its place in ``values`` (copying values that moved)."""
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.view(i)
                if p.data.data_ptr() != view.data_ptr():
                    view.copy_(p.data)
                    p.data = view

    def piece_grads(self) -> list[torch.Tensor | None]:
        """Each owned piece's gradient: a view of ``grad_shard`` (stage 2) or of the parameter's gradient (stage 1, None without one)."""
        grads: list[torch.Tensor | None] = []
        low = 0
        for i, a, b in self.pieces:
            if self.grad_shard is not None:
                grads.append(self.grad_shard[low : low + b - a])
                low += b - a
            else:
                grad = self.params[i].grad
                grads.append(None if grad is None else grad.reshape(-1)[a:b])
        return grads

    def give_grads(self, used: list[bool] | None = None) -> None:
        """Set each owned piece's ``.grad`` to :meth:`piece_grads`, or to None where ``used`` says no rank used its parameter."""
        for piece, (i, _, _), grad in zip(self.owned, self.pieces, self.piece_grads()):
            piece.grad = grad if used is None or used[i] else None


class ShardedOptimizer:
    """An optimizer whose state is split across the ranks of ``comm`` (ZeRO stage 1 or 2).

    Parameters
    ----------
    params
        The model's parameters (the same on every rank). Their ``.data`` is moved into the
        optimizer's flat buckets.
    build
        ``build(params) -> torch.optim.Optimizer``: the optimizer over the whole ``params``
        (``lambda ps: torch.optim.AdamW(ps, lr=...)``), with any parameter groups (weight
        decay for some, another rate for others: what an ``optimizer_fn`` returns). As
        DeepSpeed does, each group is sharded on its own: its parameters are bucketed apart
        from the other groups', and the optimizer is kept with its groups and
        hyperparameters, each group now holding this rank's pieces of its buckets (a group
        of which this rank owns nothing is empty here).
    comm
        The data-parallel group (mpi4py).
    stage
        1: gradients come in averaged (keep using the synchronizer); 2: gradients are
        reduce-scattered from hooks during backward (no synchronizer; call :meth:`wait`
        after backward, or let :meth:`step` do it).
    bucket_mb
        Target bucket size in MiB.
    offload
        Keep the optimizer's state, and the fp32 copy of this rank's slices it steps, in
        host memory (ZeRO-Offload's idea): each step copies the slices' averaged gradients
        to the host, steps there and copies the updated slices back before they are
        gathered. On CPU ranks everything is in host memory already: nothing changes.

    Attributes
    ----------
    optimizer
        The inner optimizer over this rank's slices (the one ``build`` returned, its groups
        now over this rank's pieces); ``param_groups`` is its groups, so a learning-rate
        schedule sets ``lr`` as for any optimizer.
    stats
        Stage 2: the :class:`~rapydli.comm.synchronizer.SyncStats` of the last :meth:`wait`.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        build: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
        comm: Any,
        stage: int = 1,
        bucket_mb: float = 25.0,
        offload: bool = False,
    ) -> None:
        if stage not in (_ALL_STAGES if type(self) is not ShardedOptimizer else STAGES):
            raise ConfigError(f"zero={stage!r} is invalid: one of {', '.join(map(str, STAGES))}")
        self.comm, self.stage = comm, stage
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        params = list(params)
        # the optimizer over the whole parameters, with its groups; each group is bucketed apart (a bucket never mixes two
        # groups' hyperparameters), the buckets ordered as backward reaches them; then the groups hold this rank's pieces
        self.optimizer = build(params)
        self.buckets: list[_Bucket] = self._buckets(params, bucket_mb)
        #: (piece of this rank's slices, the host copy the optimizer steps in its place): offloaded pieces only
        self.host_copies: list[tuple[nn.Parameter, nn.Parameter]] = []
        for index, group in enumerate(self.optimizer.param_groups):
            pieces = [piece for bucket in self.buckets if bucket.group == index for piece in bucket.owned]
            copies = [(piece, _host_copy(piece)) if offload and _in_device_memory(piece) else None for piece in pieces]
            self.host_copies += [pair for pair in copies if pair is not None]
            group["params"] = [piece if pair is None else pair[1] for piece, pair in zip(pieces, copies)]
        self._stepped = {id(piece): host for piece, host in self.host_copies}
        self.optimizer.state.clear()
        self.param_groups = self.optimizer.param_groups
        self.stats = SyncStats()
        self._hooks: list[Any] = []
        self._communicator: Any = None
        if stage >= 2:
            from rapydli.comm import Communicator

            self._communicator = Communicator(comm, algorithm="mpi")
            for bucket in (
                self.buckets
            ):  # grad_shard: made by the step's first reduce-scatter of the bucket, dropped by zero_grad
                self._hooks += [
                    p.register_post_accumulate_grad_hook(self._hook(bucket, i)) for i, p in enumerate(bucket.params)
                ]
        self._pending: list[tuple[_Bucket, Any]] = []
        self._next = 0  # the bucket to reduce-scatter next in this backward
        self._queued = False  # the end-of-backward callback is queued
        self._handles: list[
            tuple[Any, int]
        ] = []  # finished reduce-scatters since the last wait(), with their input bytes
        self._waited = 0.0
        self._in_flight_bytes = 0
        self.peak_gradient_buffer_bytes = 0  # stage 2: the most bytes of whole buckets alive at once

    def _buckets(self, params: list[nn.Parameter], bucket_mb: float) -> list[_Bucket]:
        """Each group's trained parameters in buckets of about ``bucket_mb``, ordered as backward completes them."""
        order = {id(p): i for i, p in enumerate(params)}
        buckets = []
        for index, group in enumerate(self.optimizer.param_groups):
            trained = sorted((p for p in group["params"] if p.requires_grad), key=lambda p: order.get(id(p), -1))
            for members in _groups(trained, bucket_mb):
                buckets.append(_Bucket(members, self.size, self.rank, index))
        buckets.sort(key=lambda b: -order.get(id(b.params[0]), -1))
        return buckets

    # -- stage 2: reduce-scatter during backward --------------------------------------------
    def _hook(self, bucket: _Bucket, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._queued:  # once per backward: reduce-scatter what is left when it ends
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
                self._queued = True
            grad = param.grad
            assert grad is not None
            param.grad = None
            if bucket.grads is not None:
                bucket.grads[bucket.offsets[i] : bucket.offsets[i] + param.numel()].add_(grad.reshape(-1))
            elif _adoptable(
                bucket, grad
            ):  # the bucket is this one gradient: reduce-scattered as autograd made it, no copy
                self._count_in_flight(bucket)
                bucket.grads = grad.detach().reshape(-1)
            else:
                bucket.held.append((i, grad))
                last = bucket.missing == 1 and not bucket.ready[i]
                if last or sum(g.numel() for _, g in bucket.held) * HOLD_FRACTION > bucket.padded:
                    self._fill(bucket)
            bucket.used[i] = True
            if not bucket.ready[i]:
                bucket.ready[i] = True
                bucket.missing -= 1
            while self._next < len(self.buckets) and self.buckets[self._next].missing == 0:
                self._launch(self.buckets[self._next])

        return hook

    def _count_in_flight(self, bucket: _Bucket) -> None:
        self._in_flight_bytes += _nbytes(bucket)
        self.peak_gradient_buffer_bytes = max(self.peak_gradient_buffer_bytes, self._in_flight_bytes)

    def _fill(self, bucket: _Bucket) -> None:
        """Make the bucket's whole gradient buffer (zeros where no gradient came) and add the held gradients into it."""
        self._count_in_flight(bucket)
        bucket.grads = torch.zeros(bucket.padded, dtype=bucket.dtype, device=bucket.device)
        for i, grad in bucket.held:
            bucket.grads[bucket.offsets[i] : bucket.offsets[i] + grad.numel()].add_(grad.reshape(-1))
        bucket.held = []

    def _launch(self, bucket: _Bucket) -> None:
        """Start the bucket's reduce-scatter (its parameters without a gradient count as zero)."""
        if bucket.grads is None:
            self._fill(bucket)
        assert bucket.grads is not None
        out = torch.empty(bucket.shard, dtype=bucket.dtype, device=bucket.device)
        self._pending.append((bucket, self._communicator.ireduce_scatter_(bucket.grads, out, op="avg")))
        bucket.grads = None  # the handle's work holds it until the reduce-scatter has run
        self._next += 1
        while len(self._pending) > IN_FLIGHT:
            self._finish_oldest()

    def _finish_oldest(self) -> None:
        bucket, handle = self._pending.pop(0)
        started = time.perf_counter()
        out = handle.wait()
        self._waited += time.perf_counter() - started
        if bucket.grad_shard is None:  # the step's first reduce-scatter of it: its output is the slice's gradient
            bucket.grad_shard = out
        else:
            bucket.grad_shard.add_(out)
        self._in_flight_bytes -= _nbytes(bucket)
        self._handles.append(
            (handle.timing(), _nbytes(bucket))
        )  # its times: holding its output would keep every bucket's

    def _end_of_backward(self) -> None:
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            bucket.missing, bucket.ready = len(bucket.params), [False] * len(bucket.params)
        self._next, self._queued = 0, False

    def wait(self) -> SyncStats:
        """Stage 2: finish the reduce-scatters of the backward passes so far; returns their stats.

        ``comm_time`` is the time the reduce-scatters ran, ``wait_time`` the time this rank
        blocked for them (in :meth:`wait` and when :data:`IN_FLIGHT` was reached).
        """
        called = time.perf_counter()
        while self._pending:
            self._finish_oldest()
        handles = [h for h, _ in self._handles]
        comm_time = sum(h.duration for h in handles)
        hidden = sum(
            max(0.0, min(h.finished, called) - h.started)
            for h in handles
            if h.started is not None and h.finished is not None
        )
        self.stats = SyncStats(
            step=self.stats.step + 1,
            comm_time=comm_time,
            wait_time=self._waited,
            hidden_time=hidden,
            hidden_fraction=hidden / comm_time if comm_time > 0 else 0.0,
            buckets=len(handles),
            launched_in_backward=len(handles),  # every bucket starts from a gradient hook or as backward ends
            bytes=sum(nbytes for _, nbytes in self._handles),
        )
        self._handles, self._waited = [], 0.0
        return self.stats

    # -- the step --------------------------------------------------------------------------
    def gradient_pieces(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """The averaged gradient of each piece of this rank's slices that has one, with the model parameter it belongs to.

        Views: scaling them in place (clipping) scales what :meth:`step` applies. At stage 2
        call it after :meth:`wait`.
        """
        return [
            (bucket.params[i], grad)
            for bucket in self.buckets
            for (i, _, _), grad in zip(bucket.pieces, bucket.piece_grads())
            if grad is not None
        ]

    def step(self) -> None:
        """Update this rank's slices from their averaged gradients, then allgather every bucket.

        Stage 2: pieces of parameters no rank produced a gradient for since :meth:`zero_grad`
        are skipped (collective: every rank of the group calls it).
        """
        if self.stage >= 2:
            if self._pending:
                self.wait()
            for bucket, used in zip(self.buckets, self._used_anywhere()):
                bucket.give_grads(used)
        else:
            for bucket in self.buckets:
                bucket.give_grads()
        for piece, host in self.host_copies:  # offloaded: the gradients to the host, the step there, the slices back
            host.grad = None if piece.grad is None else piece.grad.detach().to(host.device, copy=True)
        self.optimizer.step()
        with torch.no_grad():
            for piece, host in self.host_copies:
                piece.copy_(host)
                host.grad = None
        self._after_step()

    def stepped(self, piece: torch.Tensor) -> torch.Tensor:
        """The tensor the inner optimizer steps (and keys its state by) for ``piece`` of this rank's slices: its host copy when offloaded."""
        return self._stepped.get(id(piece), piece)

    def _copy_to_host(self) -> None:
        """The offloaded pieces' host copies take the pieces' values (after a load wrote into the pieces)."""
        with torch.no_grad():
            for piece, host in self.host_copies:
                host.copy_(piece)

    def _after_step(self) -> None:
        """Every rank's updated slices into every rank's buckets (stages 1 and 2 keep the whole parameters)."""
        for bucket in self.buckets:
            _allgather(self.comm, bucket.values)

    def _used_anywhere(self) -> list[list[bool]]:
        """Stage 2, per bucket: whether each parameter got a gradient on any rank of the group (one allreduce)."""
        flags = torch.tensor([used for bucket in self.buckets for used in bucket.used], dtype=torch.uint8)
        self.comm.Allreduce(MPI.IN_PLACE, flags.numpy(), op=MPI.MAX)
        marks = flags.bool().tolist()
        out, start = [], 0
        for bucket in self.buckets:
            out.append(marks[start : start + len(bucket.params)])
            start += len(bucket.params)
        return out

    def refresh(self) -> None:
        """Keep the parameters in the buckets after their data was replaced (a load that swapped tensors); offloaded, copy the slices to the host."""
        for bucket in self.buckets:
            bucket.attach()
        self._copy_to_host()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's gradients, this rank's gradient slices and which parameters got one."""
        for bucket in self.buckets:
            bucket.grad_shard = None  # freed between steps, as FSDP2 frees its sharded gradients
            for piece in bucket.owned:
                piece.grad = None
            bucket.used = [False] * len(bucket.params)
            for p in bucket.params:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def close(self) -> None:
        """Remove the gradient hooks and stop the communication thread (stage 2)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self._communicator is not None:
            self._communicator.close()
            self._communicator = None

    # -- measurements and checkpoints ------------------------------------------------------
    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (moments, momentum buffers, step counters)."""
        return sum(
            value.numel() * value.element_size()
            for state in self.optimizer.state.values()
            for value in state.values()
            if isinstance(value, torch.Tensor)
        )

    def gradient_bytes(self) -> int:
        """Stage 2 and 3: bytes of this rank's gradient slices plus the most whole buckets alive at once; stage 1: 0 (the synchronizer's).

        The slices exist from a step's first reduce-scatter to :meth:`zero_grad` (freed between
        steps, as FSDP2 frees them): counted at that peak, whether or not they exist now.
        """
        if self.stage == 1:
            return 0
        shards = sum(b.shard * b.dtype.itemsize for b in self.buckets)
        return shards + self.peak_gradient_buffer_bytes

    def state_dict(self) -> dict[str, Any]:
        """This rank's shard of the optimizer state, with the layout it belongs to (a sharded checkpoint)."""
        return {
            "zero": self.stage,
            "world_size": self.size,
            "rank": self.rank,
            "numel": self._layout(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a shard written by :meth:`state_dict` by the same rank of the same layout (refused otherwise)."""
        if state["world_size"] != self.size or state["numel"] != self._layout():
            raise ConfigError(
                f"this sharded optimizer state was written by {state['world_size']} ranks over {sum(state['numel'])} elements; "
                f"this run has {self.size} ranks over {sum(self._layout())}: resume a zero={state['zero']} "
                "checkpoint on the same number of ranks and the same model"
            )
        if state["rank"] != self.rank:
            raise ConfigError(
                f"this optimizer shard belongs to data-parallel rank {state['rank']}, not to rank {self.rank}: each rank loads its own"
            )
        self.optimizer.load_state_dict(state["optimizer"])

    def _layout(self) -> list[int]:
        return [b - a for bucket in self.buckets for _, a, b in bucket.pieces]


def _in_device_memory(piece: torch.Tensor) -> bool:
    """Whether ``piece`` lives outside host memory (what offloading moves the optimizer away from)."""
    return piece.device.type != "cpu"


def _host_copy(piece: nn.Parameter) -> nn.Parameter:
    """A host-memory copy of ``piece`` for the offloaded optimizer (page-locked from a GPU, so the copies each step are fast)."""
    host = piece.detach().to("cpu", copy=True)
    if piece.device.type == "cuda":
        host = host.pin_memory()
    return nn.Parameter(host)


def _adoptable(bucket: _Bucket, grad: torch.Tensor) -> bool:
    """Whether ``grad`` can be the bucket's gradient buffer itself: the bucket is this one parameter, unpadded, and the gradient dense and contiguous."""
    return (
        len(bucket.params) == 1
        and bucket.padded == grad.numel()
        and grad.layout == torch.strided
        and grad.is_contiguous()
        and (grad.dtype, grad.device) == (bucket.dtype, bucket.device)
    )


def _nbytes(bucket: _Bucket) -> int:
    """Bytes of the bucket whole (its padding included)."""
    return bucket.padded * bucket.dtype.itemsize


def _groups(params: list[nn.Parameter], bucket_mb: float) -> list[list[nn.Parameter]]:
    """Parameters in backward (reverse) order, in buckets of one dtype and device of at most ``bucket_mb`` (or one parameter)."""
    limit = bucket_mb * (1 << 20)
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        last = groups[-1][-1] if groups else None
        if last is not None and (last.dtype, last.device) == (p.dtype, p.device) and size + nbytes <= limit:
            groups[-1].append(p)
            size += nbytes
        else:
            groups.append([p])
            size = nbytes
    return groups


def _allgather(comm: Any, values: torch.Tensor) -> None:
    """Every rank's slice of ``values`` into every rank's ``values``, in place."""
    host = values if values.device.type == "cpu" else values.cpu()
    comm.Allgather(MPI.IN_PLACE, host.numpy())
    if host is not values:
        values.copy_(host)
