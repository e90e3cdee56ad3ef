"""Measuring what a layout planner needs of a model: per-block time, bytes and parameters.

:func:`profile_model` runs the model's pipeline blocks (:func:`rapydli.parallel.split.pipeline_blocks`;
a model that has none is one block) one after the other on a sample batch and times each
block's forward and backward separately, at every micro-batch size and tensor-parallel
degree asked for. Per block it also records the bytes autograd keeps for backward
(:class:`~rapydli.parallel.memory.ActivationMeter`), the bytes of its output (what a stage
boundary sends forward, and the gradient back), its parameters on one tensor-parallel rank
and the bytes of every tensor-parallel allreduce it makes in each direction. The last
block's forward includes the loss (cross-entropy, as a pipeline's last stage computes it)
and its backward starts from the loss.

A tensor-parallel degree ``t`` is measured on rank 0's shard alone: the model is split with
:func:`rapydli.parallel.tensor.parallelize` over a :class:`ShardProbe`, a group of ``t``
ranks whose allreduces do not communicate but record their sizes, so the time is one
rank's computation and the communication is left to the network model.

:class:`Profile` holds the measurements and answers for sizes and degrees that were not
measured: times interpolate linearly in the micro-batch size (and extrapolate from the
two nearest sizes), bytes scale with it, and a degree ``t`` that was not measured follows
``q(t) = q_replicated + q_split / t`` fitted on the two smallest measured degrees.
"""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError
from rapydli.objective import LossFn, Objective
from rapydli.parallel.memory import ActivationMeter
from rapydli.parallel.split import model_blocks

#: Timed repetitions of each measurement (after one untimed warm-up); the median is kept.
REPEATS = 5


@dataclass(frozen=True)
class BlockCost:
    """One block of the model, measured at one micro-batch size on one tensor-parallel rank.

    Attributes
    ----------
    forward_s, backward_s
        Median seconds of the block's forward (with the loss, for the last block) and backward.
    saved_bytes
        Bytes autograd holds for the block's backward after its forward (one micro-batch).
    output_bytes
        Bytes of the block's output (sent to the next stage; its gradient comes back).
    parameter_bytes
        Bytes of each of the block's parameters on this rank, in registration order; a
        parameter an earlier block also uses (tied embeddings) is left out here.
    tp_forward_bytes, tp_backward_bytes
        Bytes of each tensor-parallel allreduce the block makes forward and backward.
    holds_parameters
        Whether the block has parameters (tied ones included): ``pipeline_split="auto"`` gives
        every stage one (:func:`rapydli.parallel.split.balance`).
    input_bytes
        Bytes of the block's input (what a recomputed block keeps from its forward to its backward).
    saved_input_bytes
        Bytes of ``saved_bytes`` that are the block's input itself (its first layer saves it; a
        recomputed block's input is kept already, so its recomputation does not add them again).
    recomputed
        Whether ``activation_checkpointing="blocks"`` recomputes the block (it holds a block of
        :func:`rapydli.parallel.split.model_blocks`; a model's embedding and head often do not).
    """

    forward_s: float
    backward_s: float
    saved_bytes: int
    output_bytes: int
    parameter_bytes: tuple[int, ...]
    tp_forward_bytes: tuple[int, ...] = ()
    tp_backward_bytes: tuple[int, ...] = ()
    holds_parameters: bool = True
    input_bytes: int = 0
    saved_input_bytes: int = 0
    recomputed: bool = True

    @property
    def parameters_bytes(self) -> int:
        """All the block's parameter bytes on this rank."""
        return sum(self.parameter_bytes)


@dataclass
class Profile:
    """What :func:`profile_model` measured, and estimates for what it did not.

    Attributes
    ----------
    names
        The blocks' names in forward order.
    measured
        ``{(tensor_parallel, microbatch_size): [BlockCost per block]}``.
    unsupported
        ``{tensor_parallel: reason}`` for degrees the model's tensor plan cannot split.
    optimizer_s_per_byte
        Seconds of one optimizer step per byte of parameters (the step over the whole model, divided).
    gradient_copy_s_per_byte
        Seconds per byte of parameters to add their gradients into one flat buffer (what
        ZeRO 2's gradient hooks do, :class:`rapydli.parallel.zero.ShardedOptimizer`).
    data_s
        ``{batch size: seconds}`` to collate a batch of the training set.
    step_overhead_s
        What one step of the real training loop takes beyond the blocks, the optimizer and
        collating the batch (the loader, zeroing gradients, the learning-rate schedule,
        logging): a few steps of single-rank training timed, less what the rest of the
        profile predicts for them (0 when not measured).
    source
        Where it was measured (``"2 engines"``, ``"this process"``).
    device
        The device type the blocks ran on (``cpu``, ``cuda``).
    host_optimizer_s_per_byte
        On a GPU: seconds of one optimizer step in host memory per byte of parameters
        (what ``offload_optimizer=True`` steps; 0 on a CPU, where offloading changes nothing).
    host_copy_s_per_byte
        On a GPU: seconds per byte to copy between the device and page-locked host memory,
        one way (0 on a CPU).
    """

    names: list[str]
    measured: dict[tuple[int, int], list[BlockCost]]
    unsupported: dict[int, str] = field(default_factory=dict)
    optimizer_s_per_byte: float = 0.0
    gradient_copy_s_per_byte: float = 0.0
    data_s: dict[int, float] = field(default_factory=dict)
    step_overhead_s: float = 0.0
    source: str = ""
    device: str = "cpu"
    host_optimizer_s_per_byte: float = 0.0
    host_copy_s_per_byte: float = 0.0

    @property
    def stage_blocks(self) -> int:
        """Blocks that hold parameters: the most pipeline stages the model splits into (a stage needs one)."""
        return sum(b.holds_parameters for b in next(iter(self.measured.values()), []))

    @property
    def degrees(self) -> list[int]:
        """Tensor-parallel degrees measured."""
        return sorted({t for t, _ in self.measured})

    def sizes(self, tensor_parallel: int) -> list[int]:
        """Micro-batch sizes measured at ``tensor_parallel``."""
        return sorted(b for t, b in self.measured if t == tensor_parallel)

    def supports(self, tensor_parallel: int) -> bool:
        """Whether blocks split ``tensor_parallel`` ways are known (measured or estimated from two degrees)."""
        if tensor_parallel in self.unsupported:
            return False
        return tensor_parallel in self.degrees or (len(self.degrees) >= 2 and 1 in self.degrees)

    def blocks(self, tensor_parallel: int, size: int) -> list[BlockCost]:
        """Every block's cost at micro-batch ``size`` on one of ``tensor_parallel`` ranks."""
        if tensor_parallel in self.degrees:
            return self._at_size(tensor_parallel, size)
        if not self.supports(tensor_parallel):
            why = self.unsupported.get(tensor_parallel, "measure it, or degree 1 and another")
            raise ConfigError(f"tensor_parallel={tensor_parallel} was not measured and cannot be estimated: {why}")
        low, high = self.degrees[0], self.degrees[1]
        return [
            _split_model(a, b, low, high, tensor_parallel)
            for a, b in zip(self._at_size(low, size), self._at_size(high, size))
        ]

    def _at_size(self, tensor_parallel: int, size: int) -> list[BlockCost]:
        sizes = self.sizes(tensor_parallel)
        if size in sizes:
            return self.measured[(tensor_parallel, size)]
        lo, hi = _neighbours(sizes, size)
        return [
            _interpolate(a, b, lo, hi, size)
            for a, b in zip(self.measured[(tensor_parallel, lo)], self.measured[(tensor_parallel, hi)])
        ]

    def data_time(self, size: int) -> float:
        """Seconds to collate a batch of ``size`` (linear between, and beyond, the sizes measured)."""
        if not self.data_s:
            return 0.0
        lo, hi = _neighbours(sorted(self.data_s), size)
        return _line(self.data_s[lo], self.data_s[hi], lo, hi, size)

    @classmethod
    def combine(cls, profiles: Sequence[Profile], source: str = "") -> Profile:
        """The mean of profiles measured at the same time on several ranks (times averaged, bytes equal)."""
        first = profiles[0]
        measured = {
            key: [
                replace(
                    block,
                    forward_s=statistics.fmean(p.measured[key][i].forward_s for p in profiles),
                    backward_s=statistics.fmean(p.measured[key][i].backward_s for p in profiles),
                )
                for i, block in enumerate(blocks)
            ]
            for key, blocks in first.measured.items()
        }
        return cls(
            names=list(first.names),
            measured=measured,
            unsupported=dict(first.unsupported),
            optimizer_s_per_byte=statistics.fmean(p.optimizer_s_per_byte for p in profiles),
            gradient_copy_s_per_byte=statistics.fmean(p.gradient_copy_s_per_byte for p in profiles),
            data_s={k: statistics.fmean(p.data_s[k] for p in profiles) for k in first.data_s},
            step_overhead_s=statistics.fmean(p.step_overhead_s for p in profiles),
            source=source or first.source,
            device=first.device,
            host_optimizer_s_per_byte=statistics.fmean(p.host_optimizer_s_per_byte for p in profiles),
            host_copy_s_per_byte=statistics.fmean(p.host_copy_s_per_byte for p in profiles),
        )


def _neighbours(sizes: Sequence[int], size: int) -> tuple[int, int]:
    """The two measured sizes around ``size`` (the two nearest at either end; one size: itself twice)."""
    if len(sizes) == 1:
        return sizes[0], sizes[0]
    index = min(max(bisect.bisect_left(sizes, size), 1), len(sizes) - 1)
    return sizes[index - 1], sizes[index]


def _line(x: float, y: float, size_x: int, size_y: int, size: int) -> float:
    """The line through ``(size_x, x)`` and ``(size_y, y)`` at ``size``; proportional when they are one point."""
    if size_x == size_y:
        return x * size / size_x
    return max(0.0, x + (y - x) * (size - size_x) / (size_y - size_x))


def _interpolate(a: BlockCost, b: BlockCost, size_a: int, size_b: int, size: int) -> BlockCost:
    """Times on the line through the two measured sizes; bytes proportional to the size."""
    scale = size / size_b
    return BlockCost(
        forward_s=_line(a.forward_s, b.forward_s, size_a, size_b, size),
        backward_s=_line(a.backward_s, b.backward_s, size_a, size_b, size),
        saved_bytes=round(b.saved_bytes * scale),
        output_bytes=round(b.output_bytes * scale),
        parameter_bytes=b.parameter_bytes,
        tp_forward_bytes=tuple(round(x * scale) for x in b.tp_forward_bytes),
        tp_backward_bytes=tuple(round(x * scale) for x in b.tp_backward_bytes),
        holds_parameters=b.holds_parameters,
        input_bytes=round(b.input_bytes * scale),
        saved_input_bytes=round(b.saved_input_bytes * scale),
        recomputed=b.recomputed,
    )


def _split_model(a: BlockCost, b: BlockCost, t_a: int, t_b: int, t: int) -> BlockCost:
    """``q(t) = q_rep + q_split / t`` through the block at degrees ``t_a`` and ``t_b``."""

    def at(x: float, y: float) -> float:
        split = (x - y) / (1 / t_a - 1 / t_b)
        return max(0.0, x - split / t_a + split / t)

    params = tuple(round(at(x, y)) for x, y in zip(a.parameter_bytes, b.parameter_bytes))
    return BlockCost(
        forward_s=at(a.forward_s, b.forward_s),
        backward_s=at(a.backward_s, b.backward_s),
        saved_bytes=round(at(a.saved_bytes, b.saved_bytes)),
        output_bytes=b.output_bytes,
        parameter_bytes=params,
        tp_forward_bytes=b.tp_forward_bytes,
        tp_backward_bytes=b.tp_backward_bytes,
        holds_parameters=b.holds_parameters,
        input_bytes=b.input_bytes,
        saved_input_bytes=b.saved_input_bytes,
        recomputed=b.recomputed,
    )


class ShardProbe:
    """Rank 0 of a tensor-parallel group of ``size`` ranks that does not communicate.

    Passed to :func:`rapydli.parallel.tensor.parallelize` instead of a ``TensorGroup``: the
    layers keep rank 0's shard and call :meth:`allreduce`, which returns its input as it
    is and records the bytes (the sum over real ranks would be what the network model
    prices).
    """

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size
        self.allreduces = {"forward": 0, "backward": 0}
        self.log: dict[str, list[int]] = {"forward": [], "backward": []}

    def allreduce(self, tensor: torch.Tensor, direction: str) -> torch.Tensor:
        """``tensor`` itself; counts the call and its bytes under ``direction``."""
        self.allreduces[direction] += 1
        self.log[direction].append(tensor.numel() * tensor.element_size())
        return tensor.detach().clone()

    def maximum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` itself (a vocabulary-parallel loss's row maxima); counts the call and its bytes as forward."""
        self.allreduces["forward"] += 1
        self.log["forward"].append(tensor.numel() * tensor.element_size())
        return tensor.detach().clone()

    def gather_last(self, tensor: torch.Tensor) -> torch.Tensor:
        """``size`` copies of ``tensor`` along the last dimension (the gathered shape); counts it as forward traffic.

        An allgather of ``B`` bytes moves half what a ring allreduce of ``B`` bytes does, so it is
        recorded as an allreduce of ``B / 2`` (the network model prices allreduces).
        """
        gathered = torch.cat([tensor.detach()] * self.size, dim=-1)
        self.allreduces["forward"] += 1
        self.log["forward"].append(gathered.numel() * gathered.element_size() // 2)
        return gathered

    def take(self, direction: str) -> tuple[int, ...]:
        """The bytes recorded under ``direction`` since the last take."""
        taken, self.log[direction] = tuple(self.log[direction]), []
        return taken


def profile_model(
    build: Callable[[], nn.Module],
    sample: tuple[Any, torch.Tensor],
    sizes: Sequence[int],
    tensor_parallel: Sequence[int] = (1,),
    plan: Mapping[str, str] | None = None,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    data: Any = None,
    data_sizes: Sequence[int] = (),
    train_step: Callable[[int], float] | None = None,
    repeats: int = REPEATS,
    loss_fn: LossFn | None = None,
) -> Profile:
    """Measure the model's blocks at each micro-batch size and tensor-parallel degree.

    Parameters
    ----------
    build
        Builds the model afresh (seeded by the caller), on the device to measure.
    sample
        ``(inputs, targets)`` of at least ``max(sizes)`` samples (batch first).
    sizes
        Micro-batch sizes to measure.
    tensor_parallel
        Degrees to measure (1 is always measured); a degree the plan cannot split is
        recorded in :attr:`Profile.unsupported` with the reason.
    plan
        The tensor plan (``{module glob: "column" | "row" | "heads" | "vocab"}``); ``None``: the
        model's built-in plan (:func:`rapydli.parallel.tensor.plan_for`).
    optimizer
        Builds the run's optimizer over a list of parameters (its step is timed).
    data, data_sizes
        The training set and the batch sizes whose collation is timed.
    train_step
        ``train_step(batch)``: seconds of one step of real single-rank training at that batch
        (median after a warm-up); it gives :attr:`Profile.step_overhead_s` at the largest size.
    loss_fn
        The run's ``loss_fn`` (``None``: the model's own loss or cross-entropy on its logits):
        the loss is the run's :class:`~rapydli.objective.Objective`, so whatever ``rd.train``
        trains (a model returning ``(logits, loss)``, one whose ``forward`` takes the targets)
        is measured the same way.
    """
    inputs, targets = sample
    measured: dict[tuple[int, int], list[BlockCost]] = {}
    unsupported: dict[int, str] = {}
    names: list[str] = []
    for degree in sorted({1, *tensor_parallel}):
        model = build()
        probe = None
        if degree > 1:
            from rapydli.parallel.tensor import parallelize, plan_for

            probe = ShardProbe(degree)
            try:
                parallelize(model, plan if plan is not None else plan_for(model, degree), probe)  # type: ignore[arg-type]
            except ConfigError as exc:
                unsupported[degree] = str(exc)
                continue
        last = _LastBlock(model, loss_fn)
        names, blocks = _blocks(model, last.objective.target_parameter)
        chosen = {id(block) for _, block in model_blocks(model)}  # what checkpointing "blocks" recomputes
        recomputed = [any(id(m) in chosen for m in block.modules()) for block in blocks]
        for size in sorted(set(sizes)):
            measured[(degree, size)] = _measure_blocks(
                blocks, inputs[:size], targets[:size], probe, repeats, last, recomputed
            )
    model = build()
    per_parameter, copy_per_parameter = _optimizer_times(
        model, inputs[: min(sizes)], targets[: min(sizes)], optimizer, repeats, loss_fn
    )
    size = max(sizes)
    data_s = {n: _collate_time(data, n, repeats) for n in sorted({*data_sizes, size})} if data is not None else {}
    profile = Profile(names, measured, unsupported, per_parameter, copy_per_parameter, data_s)
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    if (
        device.type != "cpu"
    ):  # what an offloaded optimizer costs there: its step in host memory, the copies to and from it
        profile.device = device.type
        profile.host_optimizer_s_per_byte, profile.host_copy_s_per_byte = offload_times(model, optimizer, repeats)
    if train_step is not None:
        costs = measured[(1, size)]
        modelled = profile.data_time(size) + sum(b.forward_s + b.backward_s for b in costs)
        modelled += per_parameter * sum(b.parameters_bytes for b in costs)
        profile.step_overhead_s = max(0.0, train_step(size) - modelled)
    return profile


def _blocks(model: nn.Module, targets: str | None) -> tuple[list[str], list[nn.Module]]:
    """The pipeline blocks (a traced model's last block taking the targets by ``targets``), or the whole model as one."""
    from rapydli.parallel.split import pipeline_blocks

    try:
        pairs = pipeline_blocks(model, targets)
    except ConfigError:
        pairs = [("model", model)]
    return [name for name, _ in pairs], [module for _, module in pairs]


class _LastBlock:
    """The last block's forward and the loss, as the run computes them (its :class:`~rapydli.objective.Objective`).

    The whole model (no pipeline blocks) runs through the objective, so a ``forward`` that
    takes the targets gets them, as does a traced last block that computes the model's own
    loss; a pipeline's last block is scored on its outputs, as a pipeline's last stage does.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None) -> None:
        self.model, self.objective = model, Objective(model, loss_fn)

    def __call__(self, block: nn.Module, inputs: Any, targets: torch.Tensor) -> torch.Tensor:
        if block is self.model:
            return self.objective(block, inputs, targets)[0]
        outputs = block(inputs, targets) if getattr(block, "takes_targets", False) else block(inputs)
        return self.objective.loss(outputs, targets)


def _detached(value: Any) -> Any:
    value = value.detach()
    return value.requires_grad_(True) if value.is_floating_point() else value


def _measure_blocks(
    blocks: list[nn.Module],
    inputs: Any,
    targets: torch.Tensor,
    probe: ShardProbe | None,
    repeats: int,
    last: _LastBlock,
    recomputed: Sequence[bool],
) -> list[BlockCost]:
    """Forward through every block in order, then backward in reverse, as a pipeline's stages do; each block timed."""
    count = len(blocks)
    forward: list[list[float]] = [[] for _ in blocks]
    backward: list[list[float]] = [[] for _ in blocks]
    tp_forward: list[tuple[int, ...]] = [()] * count
    tp_backward: list[tuple[int, ...]] = [()] * count
    params = [p for block in blocks for p in block.parameters() if p.requires_grad]
    for _ in range(repeats + 1):
        ins, outs = [], []
        x = inputs
        for j, block in enumerate(blocks):
            inp = _detached(x)
            started = time.perf_counter()
            out = last(block, inp, targets) if j == count - 1 else block(inp)
            forward[j].append(time.perf_counter() - started)
            ins.append(inp)
            outs.append(out)
            x = out
            if probe is not None:
                tp_forward[j] = probe.take("forward")
        grad = None
        for j in reversed(range(count)):
            started = time.perf_counter()
            if outs[j].requires_grad:
                outs[j].backward(grad)
            backward[j].append(time.perf_counter() - started)
            grad = ins[j].grad if ins[j].requires_grad else None
            if probe is not None:
                tp_backward[j] = probe.take("backward")
        output_bytes = [out.numel() * out.element_size() for out in outs[:-1]] + [0]
        del ins, outs
        for p in params:
            p.grad = None
    saved, input_bytes, saved_input = [], [], []
    with ActivationMeter(params) as meter:
        held = []
        x = inputs
        for j, block in enumerate(blocks):
            before, inp = meter.live, _detached(x)
            input_bytes.append(inp.untyped_storage().nbytes())
            was_held = meter.holds(inp)
            out = last(block, inp, targets) if j == count - 1 else block(inp)
            held.append(out)
            saved.append(meter.live - before)
            saved_input.append(input_bytes[-1] if meter.holds(inp) and not was_held else 0)
            x = out
        del held
    if probe is not None:
        probe.take("forward")
    counted: set[int] = set()  # a parameter several blocks use (tied embeddings) counts once, in its first block

    def once(block: nn.Module) -> tuple[int, ...]:
        sizes = tuple(
            p.numel() * p.element_size() for p in block.parameters() if p.requires_grad and id(p) not in counted
        )
        counted.update(id(p) for p in block.parameters())
        return sizes

    return [
        BlockCost(
            forward_s=statistics.median(forward[j][1:]),
            backward_s=statistics.median(backward[j][1:]),
            saved_bytes=saved[j],
            output_bytes=output_bytes[j],
            parameter_bytes=once(block),
            tp_forward_bytes=tp_forward[j],
            tp_backward_bytes=tp_backward[j],
            holds_parameters=any(True for _ in block.parameters()),
            input_bytes=input_bytes[j],
            saved_input_bytes=saved_input[j],
            recomputed=recomputed[j],
        )
        for j, block in enumerate(blocks)
    ]


def _optimizer_times(
    model: nn.Module,
    inputs: Any,
    targets: torch.Tensor,
    optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
    repeats: int,
    loss_fn: LossFn | None = None,
) -> tuple[float, float]:
    """Seconds per parameter byte of an optimizer step, and of adding the gradients into a flat buffer."""
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    nbytes = sum(p.numel() * p.element_size() for p in params)
    last = _LastBlock(model, loss_fn)
    blocks = _blocks(model, last.objective.target_parameter)[1]
    x = inputs
    for block in blocks[:-1]:
        x = block(x)
    last(blocks[-1], x, targets).backward()
    step_s = 0.0
    if optimizer is not None:
        opt = optimizer(params)
        times = []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
        step_s = statistics.median(times[1:])
    flat = torch.zeros(count, dtype=params[0].dtype)
    copies = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        offset = 0
        for p in params:
            if p.grad is not None:
                flat[offset : offset + p.numel()].add_(p.grad.reshape(-1))
            offset += p.numel()
        copies.append(time.perf_counter() - started)
    return step_s / nbytes, statistics.median(copies[1:]) / nbytes


def offload_times(
    model: nn.Module, optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None, repeats: int
) -> tuple[float, float]:
    """Seconds per parameter byte of ``optimizer``'s step over host copies of ``model``'s trained parameters, and of one copy between them and the device.

    The host copies are page-locked when the parameters are on a CUDA device, as
    :class:`~rapydli.parallel.zero.ShardedOptimizer` keeps them with ``offload=True``; the
    copy is timed both ways and halved (the device synchronised around it).
    """
    params = [p for p in model.parameters() if p.requires_grad]
    nbytes = sum(p.numel() * p.element_size() for p in params)
    device = params[0].device
    pinned = device.type == "cuda"
    hosts = [nn.Parameter(p.detach().to("cpu", copy=True)) for p in params]
    for host in hosts:
        host.grad = torch.zeros_like(host)
    step_s = 0.0
    if optimizer is not None:
        opt, times = optimizer(hosts), []
        for _ in range(repeats + 1):
            started = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - started)
        step_s = statistics.median(times[1:])
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    staging = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=pinned)
    copies = []
    for _ in range(repeats + 1):
        _synchronize(device)
        started = time.perf_counter()
        staging.copy_(flat, non_blocking=pinned)
        flat.copy_(staging, non_blocking=pinned)
        _synchronize(device)
        copies.append(time.perf_counter() - started)
    return step_s / nbytes, statistics.median(copies[1:]) / 2 / nbytes


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _collate_time(data: Any, size: int, repeats: int) -> float:
    from torch.utils.data import default_collate

    indices = [i % len(data) for i in range(size)]
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        default_collate([data[i] for i in indices])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])
