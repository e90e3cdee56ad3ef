"""Pipeline stages that run the model's own forward, skipping the layers other stages hold.

A library's model (``transformers``' GPT-2, Llama, BERT, ViT) cannot be cut by tracing
(:mod:`rapydli.parallel.traced`): its forward branches on its inputs and hands its layers
more than one tensor (masks, rotary tables, a cache). It still has a repeated block list
(:func:`~rapydli.parallel.traced.block_list`: the ``ModuleList`` of identical layers), and
each layer reads the previous layer's output plus *side inputs* that the forward computes
from the batch alone. So, cutting at the layers as torchtitan and PiPPy do, every stage
runs the model's own ``forward`` on the micro-batch:

* each layer before the stage's range is skipped: it returns what the previous stage sent
  (the output of the layer before the stage's first), which the first layer then reads;
* the stage's layers run as they are, with the side inputs its own forward computed;
* after its last layer the forward stops and that layer's output is sent on; the last
  stage runs the forward to its end (final norm, head, a loss the model computes itself).

What the forward reads before the first layer (embeddings) is trained by stage 0 (one block
with the first layer: :func:`layer_blocks`), what it reads after the last layer (final
norm, head) by the last stage; a weight read in both (a
head tied to the embedding) is held by both, one parameter whose gradient is summed
(:mod:`rapydli.parallel.shared`). On every other stage that part of the forward runs only
for its side inputs: anything computed from a tensor the stage does not hold (a meta tensor
of a model built deferred) is zeros of the right shape there (:class:`_Absent`), and the
skipped layers discard it. Buffers outside the layers (rotary tables, position ids) are
made on every stage (:attr:`LayerStage.context`).

Which parameters the forward reads where, and what a layer returns, is found once by
running the forward on a shape-only copy of the model on a sample it makes from the
model's config (token ids, or images of the configured size): :func:`layer_plan`. A model
is refused, with the reason, when it has no block list, calls a layer twice or out of
order, reads a parameter outside its layers between them or from inside one, or gives a
layer a second input computed from parameters (an encoder-decoder's decoder layers read
the encoder's output, which would have to reach every stage).
"""

from __future__ import annotations

import contextlib
import inspect
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from rapydli.errors import ConfigError
from rapydli.parallel.sample import sample_call, shape_only, unchanged


@dataclass(frozen=True)
class LayerPlan:
    """How a model's forward uses its layers, read from one shape-only run (:func:`layer_plan`).

    Attributes
    ----------
    name
        The block list's name (``"transformer.h"``).
    count
        Its number of layers.
    before, after
        Names of the parameters outside the layers that the forward reads before the first
        layer (with those it never reads), and after the last.
    buffers
        Names of the buffers outside the layers.
    output
        The structure of a layer's output (a pytree spec) and its leaves that are not
        tensors, by position: what a stage rebuilds from the tensors it receives.
    """

    name: str
    count: int
    before: tuple[str, ...]
    after: tuple[str, ...]
    buffers: tuple[str, ...]
    output: tuple[Any, dict[int, Any]]

    def layers(self, model: nn.Module) -> nn.ModuleList:
        """The block list of ``model``."""
        return model.get_submodule(self.name)  # type: ignore[return-value]

    def sent(self, output: Any) -> Any:
        """A layer's output as it travels: its tensors (one tensor alone, or a tuple)."""
        tensors = [leaf for leaf in pytree.tree_leaves(output) if isinstance(leaf, torch.Tensor)]
        return tensors[0] if len(tensors) == 1 else tuple(tensors)

    def received(self, payload: Any) -> Any:
        """The layer output that ``payload`` (what :meth:`sent` made) carries."""
        spec, constants = self.output
        tensors = iter([payload] if isinstance(payload, torch.Tensor) else payload)
        leaves = [constants[i] if i in constants else next(tensors) for i in range(spec.num_leaves)]
        return pytree.tree_unflatten(leaves, spec)


class _Held(nn.Module):
    """Parameters (or buffers) of a model outside its layers, held as one block (names with ``:`` for ``.``), with the
    first layer (:attr:`layer`) where they are what runs before it."""

    def __init__(
        self,
        model: nn.Module,
        parameters: tuple[str, ...] = (),
        buffers: tuple[str, ...] = (),
        layer: nn.Module | None = None,
    ) -> None:
        super().__init__()
        for name in parameters:
            self.register_parameter(name.replace(".", ":"), model.get_parameter(name))
        for name in buffers:
            self.register_buffer(name.replace(".", ":"), model.get_buffer(name))
        self.layer = layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a stage runs the model's own forward; its held parameters are never called as a block")


#: Plans already found, by model (a model split in place by tensor parallelism keeps its names).
_plans: weakref.WeakKeyDictionary[nn.Module, LayerPlan | ConfigError] = weakref.WeakKeyDictionary()


def layer_plan(model: nn.Module) -> LayerPlan:
    """``model``'s :class:`LayerPlan` (found once per model), or :class:`ConfigError` saying why its layers cannot be stages."""
    if model not in _plans:
        try:
            _plans[model] = _find_plan(model)
        except ConfigError as exc:
            _plans[model] = exc
    found = _plans[model]
    if isinstance(found, ConfigError):
        raise ConfigError(str(found))
    return found


def layer_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks of ``model`` split at its layers: the first layer with what the forward reads before it (named as that
    layer), each other layer, and what it reads after them (named after its first module but a tied embedding).

    What runs before the first layer is no block of its own: a stage ends with a layer (whose output
    it sends) or the model's output.
    """
    plan = layer_plan(model)
    layers = plan.layers(model)
    blocks: list[tuple[str, nn.Module]] = [(f"{plan.name}.0", _Held(model, plan.before, plan.buffers, layer=layers[0]))]
    blocks += [(f"{plan.name}.{index}", layer) for index, layer in enumerate(layers) if index]
    if plan.after:
        name = _owner(
            next((n for n in plan.after if n not in plan.before), plan.after[0])
        )  # named after the head, not a tied embedding
        blocks.append((name, _Held(model, plan.after)))
    return blocks


def _owner(parameter: str) -> str:
    return parameter.rpartition(".")[0] or parameter


def splits_at_layers(model: nn.Module) -> bool:
    """Whether ``model``'s stages are made by :class:`LayerStage` (a plan was found for it)."""
    return isinstance(_plans.get(model), LayerPlan)


# -- finding the plan ------------------------------------------------------------------------------


class _Reads(TorchFunctionMode):
    """Records which watched tensors (parameters, by ``id``) each phase of a forward reads."""

    def __init__(self, watched: dict[int, str]) -> None:
        super().__init__()
        self.watched = watched
        self.phase = "before"
        self.depth = 0  # > 0 inside a layer
        self.reads: dict[str, set[str]] = {"before": set(), "between": set(), "after": set(), "inside": set()}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        phase = "inside" if self.depth else self.phase
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor) and id(leaf) in self.watched:
                self.reads[phase].add(self.watched[id(leaf)])
        return func(*args, **kwargs)


def _find_plan(model: nn.Module) -> LayerPlan:
    from rapydli.parallel.tensor_plans import meta_copy
    from rapydli.parallel.traced import block_list

    kind = type(model).__name__
    found = block_list(model)
    if found is None:
        raise ConfigError(
            f"{kind} has no block list (an nn.ModuleList of two or more layers of one class) to cut into stages"
        )
    name, _ = found
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False) or _takes(model, "decoder_input_ids"):
        raise ConfigError(
            f"{kind} is an encoder-decoder: its decoder's layers read the encoder's output, which would have to reach "
            "every stage, so it is not cut at one block list"
        )
    call = sample_call(model)
    if call is None:
        raise ConfigError(
            f"{kind}'s forward takes an input whose shape cannot be told from the model (not token ids, nor "
            "images of config.image_size), so where its layers' inputs come from cannot be found"
        )
    shadow = meta_copy(model)
    layers: nn.ModuleList = shadow.get_submodule(name)  # type: ignore[assignment]
    inside = {id(p) for p in layers.parameters()}
    names: dict[int, str] = {}
    for pname, p in shadow.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), pname)
    watched = {pid: pname for pid, pname in names.items() if pid not in inside}
    reads = _Reads(watched)
    calls: list[int] = []
    outputs: dict[int, Any] = {}
    problems: list[str] = []

    def before_layer(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
            if reads.depth == 0:
                calls.append(index)
                if index > 0 and not problems:
                    problems.extend(_side_inputs(name, index, args, kwargs, outputs.get(index - 1)))
            reads.depth += 1

        return hook

    def after_layer(index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            reads.depth -= 1
            if reads.depth == 0:
                outputs[index] = output
                reads.phase = "after" if index == len(layers) - 1 else "between"

        return hook

    handles = []
    for index, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(before_layer(index), with_kwargs=True))
        handles.append(layer.register_forward_hook(after_layer(index), with_kwargs=True))
    try:
        with shape_only(), reads:  # with autograd: which layer inputs are computed from parameters is seen
            call(shadow)
    except Exception as exc:  # noqa: BLE001 - whatever stops the shape-only run is said
        raise ConfigError(
            f"{kind}'s forward did not run on a shape-only sample ({type(exc).__name__}: {str(exc)[:200]}), so "
            "where its layers' inputs come from cannot be found"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()
    if calls != list(range(len(layers))):
        raise ConfigError(
            f"{kind}'s forward calls its layers {name} in the order {calls}, not each once in order, so they cannot be "
            "cut into stages"
        )
    for phase, where in (("between", "between its layers"), ("inside", "from inside its layers")):
        if reads.reads[phase]:
            raise ConfigError(
                f"{kind}'s forward reads {sorted(reads.reads[phase])[0]}, a parameter outside {name}, {where}, "
                "which a stage holding only some layers cannot compute"
            )
    if problems:
        raise ConfigError(problems[0])
    after = tuple(n for n in names.values() if n in reads.reads["after"])
    before = tuple(
        n
        for pid, n in names.items()
        if pid not in inside and (n in reads.reads["before"] or n not in reads.reads["after"])
    )
    inside_buffers = {id(b) for b in layers.buffers()}
    buffer_names: dict[int, str] = {}
    for bname, b in shadow.named_buffers(remove_duplicate=False):
        if id(b) not in inside_buffers:
            buffer_names.setdefault(id(b), bname)
    leaves, spec = pytree.tree_flatten(outputs[len(layers) - 1])
    constants = {i: leaf for i, leaf in enumerate(leaves) if not isinstance(leaf, torch.Tensor)}
    return LayerPlan(name, len(layers), before, after, tuple(buffer_names.values()), (spec, constants))


def _takes(model: nn.Module, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _side_inputs(name: str, index: int, args: Any, kwargs: Any, previous: Any) -> list[str]:
    """A problem for each input of layer ``index`` computed from parameters that is not the previous layer's output."""
    passed = {id(leaf) for leaf in pytree.tree_leaves(previous) if isinstance(leaf, torch.Tensor)}
    problems = []
    for where, value in [
        *((f"argument {i}", a) for i, a in enumerate(args)),
        *((f"{k}=", v) for k, v in kwargs.items()),
    ]:
        for leaf in pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and id(leaf) not in passed:
                problems.append(
                    f"layer {name}.{index} gets {where} computed from parameters besides the previous layer's output (as an "
                    "encoder-decoder's decoder reads the encoder's output), which a stage holding only some layers cannot "
                    "compute"
                )
                return problems
    return problems


# -- the stage -------------------------------------------------------------------------------------


class _Absent(TorchDispatchMode):
    """Any operation reading a meta tensor (what this stage does not hold) gives zeros of its result's shape on ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        leaves = pytree.tree_leaves((args, kwargs))
        if not any(isinstance(t, torch.Tensor) and t.is_meta for t in leaves):
            return func(*args, **kwargs)
        meta_args, meta_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        result = func(*meta_args, **meta_kwargs)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device), result
        )


class _Reached(BaseException):
    """The stage's last layer has run (raised through the model's forward, which no ``except Exception`` of its own stops)."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


class LayerStage(nn.Module):
    """Stage ``stage`` of a model split at its layers: the model's own forward, other stages' layers skipped (module docstring).

    Called ``stage(x)`` on the first stage (``x``: the micro-batch's inputs) and
    ``stage(received, inputs=x)`` on the others; the last stage of a model that computes
    its own loss also takes ``targets`` (passed as the forward's ``targets`` parameter).
    Returns what the stage's last layer returned, as it travels (:meth:`LayerPlan.sent`), or
    on the last stage the model's outputs. Its parameters are its layers' and what it
    holds of the rest (:func:`layer_blocks`); :attr:`context` holds the buffers outside
    the layers that other stages hold, which this stage reads for its side inputs.
    """

    #: the pipeline gives every stage the micro-batch's inputs (:class:`~rapydli.parallel.executor.PipelineExecutor`)
    reads_inputs = True
    counted_elsewhere: frozenset[int] = frozenset()
    whole: nn.Module  # the model (not a submodule: its other stages' parameters are not this stage's)
    context: nn.Module  # buffers outside the layers another stage holds (not a submodule)

    def __init__(
        self,
        model: nn.Module,
        blocks: list[tuple[str, nn.Module]],
        stage: int,
        stages: int,
        start: int,
        end: int,
        targets: str | None = None,
    ) -> None:
        super().__init__()
        plan = layer_plan(model)
        self.plan = plan
        self.parts = nn.ModuleList(module for _, module in blocks)
        self.names = [name for name, _ in blocks]
        object.__setattr__(
            self, "whole", model
        )  # the model is not a submodule: its other stages' parameters are not this stage's
        self.first, self.last = stage == 0, stage == stages - 1
        self.start, self.end = start, end  # this stage's layers, as indices into the block list
        self.targets = targets if self.last else None
        held = {id(b) for b in self.buffers()}
        # not a submodule either: this stage reads these buffers but does not hold (train, save, compare) them
        object.__setattr__(
            self, "context", _Held(model, buffers=tuple(n for n in plan.buffers if id(model.get_buffer(n)) not in held))
        )

    @classmethod
    def between(cls, model: nn.Module, bounds: Sequence[int], stage: int, targets: str | None = None) -> LayerStage:
        """Stage ``stage`` of ``model`` cut at ``bounds`` (indices into :func:`layer_blocks`)."""
        blocks = layer_blocks(model)
        layers = [i for i, (_, block) in enumerate(blocks) if not isinstance(block, _Held) or block.layer is not None]
        start, end = (sum(1 for i in layers if i < bounds[s]) for s in (stage, stage + 1))
        return cls(model, blocks[bounds[stage] : bounds[stage + 1]], stage, len(bounds) - 1, start, end, targets)

    @property
    def takes_targets(self) -> bool:
        """Whether the last stage passes the targets to the model's forward (the model computes its own loss)."""
        return self.targets is not None

    def train(self, mode: bool = True) -> LayerStage:
        """Training or evaluation mode for the whole model, whose forward the stage runs (its dropout and BatchNorm outside the layers too)."""
        super().train(mode)
        self.whole.train(mode)
        return self

    def pipeline_blocks(self) -> list[tuple[str, nn.Module]]:
        """This stage's layers: the units ZeRO-3 gathers (what it holds outside them is gathered for the whole forward)."""
        layers = self.plan.layers(self.whole)
        return [(f"{self.plan.name}.{i}", layers[i]) for i in range(self.start, self.end)]

    def forward(self, x: Any, targets: Any = None, inputs: Any = None) -> Any:
        model, layers = self.whole, self.plan.layers(self.whole)
        batch = x if self.first else inputs
        device = next(self.parameters()).device
        absent = None if self.first else _Absent(device)
        with contextlib.ExitStack() as stack:
            if absent is not None:
                stack.enter_context(_until_first_layer(absent, layers[0]))
                received = self.plan.received(x)
                for index in range(self.start):
                    stack.enter_context(_replaced(layers[index], lambda *args, **kwargs: received))
            if not self.last:
                stack.callback(layers[self.end - 1].register_forward_hook(_stop).remove)
            try:
                return model(batch, **({self.targets: targets} if self.targets is not None else {}))
            except _Reached as reached:
                return self.plan.sent(reached.output)


def _stop(module: nn.Module, args: Any, output: Any) -> None:
    raise _Reached(output)


@contextlib.contextmanager
def _replaced(layer: nn.Module, forward: Callable[..., Any]) -> Iterator[None]:
    """``layer`` calls ``forward`` instead of its own while inside (its hooks still run)."""
    own = layer.__dict__.get("forward")  # activation checkpointing's recomputed forward, if any
    layer.forward = forward
    try:
        yield
    finally:
        if own is None:
            del layer.forward
        else:
            layer.forward = own


@contextlib.contextmanager
def _until_first_layer(mode: _Absent, first: nn.Module) -> Iterator[None]:
    """``mode`` is active from here until ``first`` (the first layer) is called: the side inputs are made by then."""
    active = [True]
    mode.__enter__()

    def leave(module: nn.Module, args: Any) -> None:
        if active[0]:
            active[0] = False
            mode.__exit__(None, None, None)

    handle = first.register_forward_pre_hook(leave, prepend=True)
    try:
        yield
    finally:
        handle.remove()
        if active[0]:
            mode.__exit__(None, None, None)


def measure(model: nn.Module, sample: Any, repeats: int = 3) -> list[float]:
    """Seconds of each of :func:`layer_blocks`' forward on ``sample``, the fastest of ``repeats``.

    One forward of the whole model is timed between its layers' hooks: what runs before the
    first layer, each layer, what runs after the last. Backward takes about twice a forward
    in each of them, so forward times balance the stages as well.
    """
    plan = layer_plan(model)
    layers = plan.layers(model)
    marks: list[float] = []
    handles = [layers[0].register_forward_pre_hook(lambda *_: marks.append(time.perf_counter()))]
    handles += [layer.register_forward_hook(lambda *_: marks.append(time.perf_counter())) for layer in layers]
    best: list[float] = []
    try:
        with torch.no_grad(), unchanged(model):
            for _ in range(repeats):
                marks.clear()
                marks.append(time.perf_counter())
                model(sample)
                marks.append(time.perf_counter())
                times = [b - a for a, b in zip(marks, marks[1:])]  # before, each layer, after
                best = times if not best else [min(a, b) for a, b in zip(best, times)]
    finally:
        for handle in handles:
            handle.remove()
    after = [best[-1]] if plan.after else []
    return [best[0] + best[1], *best[2:-1], *after]  # the first layer's block runs what comes before it too
