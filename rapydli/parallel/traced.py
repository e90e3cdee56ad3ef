"""Pipeline blocks read from a model's own ``forward``, for models that do not list them.

A model written as people write them (nanoGPT, Hugging Face GPT-2, Llama, BERT, a
ResNet) is neither an ``nn.Sequential`` nor has a ``pipeline_blocks()`` method. Its
``forward`` is traced with :mod:`torch.fx` (symbolically: no tensor is computed, so a
model on the meta device traces as well) with these modules kept whole:

* the items of every ``nn.ModuleList``, ``nn.ModuleDict`` and ``nn.Sequential`` (the
  transformer layers, the ResNet blocks);
* every module that holds parameters of its own (embeddings, norms, projections, a
  Hugging Face ``Conv1D``), and the modules of ``torch.nn``.

The traced program is then cut wherever exactly one tensor flows from what ran before to
what runs after (between two layers, after the embeddings' sum, before the final norm):
each piece between two cuts that calls a module with parameters is one block, an ``fx.GraphModule``
sharing the model's modules and parameters (so tied weights stay one parameter), named
after the first module it calls. The forward's other keyword arguments keep their
defaults (``attention_mask=None``); ``assert``\\ s on shapes are kept as checks.

A model that computes its own loss (``forward(idx, targets=None)``, Hugging Face's
``labels=None``) is traced with the targets passed, as :class:`~rapydli.objective.Objective`
passes them: its last block takes ``(x, targets)`` and returns what ``forward`` returns,
loss included; the pipeline's last stage gives it the micro-batch's targets. Targets
read before the last block cannot reach that stage, and are refused.

What cannot be traced (a branch on a tensor's value, a loop over a tensor) or cut (two
tensors flow between every pair of layers) raises :class:`~rapydli.errors.ConfigError`
saying why and naming the fix: a ``pipeline_blocks()`` method.

Examples
--------
>>> import torch
>>> from torch import nn
>>> class Net(nn.Module):
...     def __init__(self):
...         super().__init__()
...         self.embed = nn.Embedding(10, 4)
...         self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
...         self.head = nn.Linear(4, 10)
...     def forward(self, idx, targets=None):
...         x = self.embed(idx)
...         for layer in self.layers:
...             x = torch.relu(layer(x))
...         logits = self.head(x)
...         return logits if targets is None else nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
>>> [name for name, _ in traced_blocks(Net())]
['embed', 'layers.0', 'layers.1', 'head']
>>> blocks = traced_blocks(Net(), targets="targets")
>>> [getattr(block, "takes_targets", False) for _, block in blocks]
[False, False, False, True]
"""

from __future__ import annotations

import builtins
import dis
import inspect
import operator
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from rapydli.errors import ConfigError

#: ``Tensor`` methods that return sizes or Python values, not tensors (a cut never carries one).
_NOT_TENSOR_METHODS = frozenset({"size", "dim", "numel", "item", "tolist", "stride", "element_size", "is_contiguous"})
_FIX = (
    "give the model a pipeline_blocks() method returning its (name, module) blocks in forward order, "
    "or build it as an nn.Sequential"
)


class _BlockTracer(fx.Tracer):
    """Traces a forward keeping the layers (and every module with parameters of its own) whole."""

    def __init__(self, whole: set[int]) -> None:
        super().__init__()
        self.whole = whole

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return (
            id(m) in self.whole
            or any(True for _ in m.parameters(recurse=False))
            or super().is_leaf_module(m, module_qualified_name)
        )

    def to_bool(self, obj: fx.Proxy) -> bool:
        """An ``assert`` on a traced value is kept as a check (``torch._assert``); any other branch cannot be traced."""
        frame = inspect.currentframe()
        caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
        if caller is not None and _asserting(caller):
            self.create_proxy("call_function", torch._assert, (obj, f"assert in {caller.f_code.co_name}"), {})
            return True
        where = (
            f" ({caller.f_code.co_filename}:{caller.f_lineno}, in {caller.f_code.co_name})"
            if caller is not None
            else ""
        )
        raise fx.proxy.TraceError(f"forward branches on a tensor's value{where}")

    def create_arg(self, a: Any) -> Any:
        """A ``ModelOutput``-like dict subclass stays its own type (fx would return a plain dict)."""
        if isinstance(a, dict) and type(a) is not dict:
            return self.create_node("call_function", type(a), (), {str(k): self.create_arg(v) for k, v in a.items()})
        return super().create_arg(a)


def _asserting(frame: Any) -> bool:
    """Whether ``frame`` is deciding an ``assert`` (the jump it is at is followed by raising AssertionError)."""
    instructions = list(dis.get_instructions(frame.f_code))
    for index, instruction in enumerate(instructions[:-1]):
        if instruction.offset == frame.f_lasti:
            after = instructions[index + 1]
            return "JUMP" in instruction.opname and (
                after.opname == "LOAD_ASSERTION_ERROR" or after.argval == "AssertionError"
            )
    return False


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """The model's repeated block list: the ``nn.ModuleList`` of two or more modules of one class holding the most parameters."""
    best: tuple[int, str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 2 and len({type(m) for m in module}) == 1:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, name, module)
    return None if best is None else (best[1], best[2])


def _untraceable(model: nn.Module, exc: Exception) -> str:
    """Why ``model`` cannot be cut into stages: the tracer's reason, its block list where it has one, and the ways out."""
    said = f"{type(model).__name__} cannot be split into pipeline stages by tracing its forward ({type(exc).__name__}: {str(exc)[:200]})"
    found = block_list(model)
    if found is None:
        return f"{said}: {_FIX}"
    name, blocks = found
    return (
        f"{said}: its blocks are {name} ({len(blocks)} x {type(blocks[0]).__name__}), but where one tensor passes between them is "
        f"not known without the trace. Train it with zero=3 or tensor_parallel instead (both split it without a pipeline), or {_FIX}"
    )


def _kept_whole(model: nn.Module) -> set[int]:
    containers = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    return {id(child) for module in model.modules() if isinstance(module, containers) for child in module.children()}


def trace(model: nn.Module, targets: str | None = None) -> fx.Graph:
    """``model``'s forward as an fx graph, its layers kept whole (module docstring); ``targets`` stays an input."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{type(model).__name__}'s forward has no signature to trace: {_FIX}") from exc
    if not parameters:
        raise ConfigError(f"{type(model).__name__}.forward takes no input: {_FIX}")
    concrete = {}
    for parameter in parameters[1:]:
        if parameter.name == targets:
            continue
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if parameter.default is parameter.empty:
            raise ConfigError(
                f"{type(model).__name__}.forward needs {parameter.name!r} besides its input, which a pipeline cannot "
                f"pass to its first stage: {_FIX}"
            )
        concrete[parameter.name] = parameter.default
    try:
        graph = _BlockTracer(_kept_whole(model)).trace(model, concrete_args=concrete)
    except Exception as exc:  # noqa: BLE001 - whatever stops the tracer is said, with the fix
        raise ConfigError(_untraceable(model, exc)) from exc
    for node in list(
        graph.nodes
    ):  # the checks that the defaults kept their value: the stages never get those arguments
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "_assert_is_none":
            graph.erase_node(node)
    return graph


def _is_tensor(node: fx.Node) -> bool:
    """Whether ``node`` computes a tensor (as far as the graph tells: sizes and attributes do not)."""
    if node.op in ("call_module", "get_attr"):
        return True
    if node.op == "call_method":
        return node.target not in _NOT_TENSOR_METHODS
    if node.op == "call_function":
        if node.target is builtins.getattr:
            return False
        if node.target is operator.getitem:
            source = node.args[0]
            return isinstance(source, fx.Node) and _is_tensor(source)
        return node.target not in (operator.add, operator.sub, operator.mul, operator.floordiv) or any(
            isinstance(a, fx.Node) and _is_tensor(a) for a in node.args
        )
    return node.op == "placeholder"


#: Blocks already traced, by model, then by (targets, the ids of its modules): a model split in place (tensor
#: parallelism swaps its layers) has other modules and is traced again; the blocks hold the old ones, so no id is reused.
_traced: weakref.WeakKeyDictionary[nn.Module, dict[tuple[Any, ...], list[tuple[str, nn.Module]] | ConfigError]] = (
    weakref.WeakKeyDictionary()
)


def traced_blocks(model: nn.Module, targets: str | None = None) -> list[tuple[str, nn.Module]]:
    """``model``'s blocks in forward order, read from its traced forward (module docstring).

    ``targets``: the ``forward`` parameter the model takes its targets by, when it computes
    its own loss (the last block then takes ``(x, targets)``); ``None`` traces it without.
    The same model with the same modules gets the same blocks (traced once).
    """
    key = (targets, tuple(id(m) for m in model.modules()))
    known = _traced.setdefault(model, {})
    if key not in known:
        try:
            known[key] = _traced_blocks(model, targets)
        except ConfigError as exc:  # said again, not traced again
            known[key] = exc
    found = known[key]
    if isinstance(found, ConfigError):
        raise ConfigError(str(found))
    return list(found)


def _traced_blocks(model: nn.Module, targets: str | None) -> list[tuple[str, nn.Module]]:
    graph = trace(model, targets)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    source, target_node = (
        placeholders[0],
        next((n for n in placeholders if n.target == targets), None) if targets else None,
    )
    body = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    output = next(n for n in graph.nodes if n.op == "output")
    position = {n: i for i, n in enumerate(body)}
    position[output] = len(body)
    last_use = {n: max((position[u] for u in n.users), default=-1) for n in [*placeholders, *body]}

    def trains(nodes: list[fx.Node]) -> bool:  # calls a module that holds parameters
        return any(
            n.op == "call_module" and any(True for _ in model.get_submodule(str(n.target)).parameters()) for n in nodes
        )

    valid = [i for i in range(1, len(body)) if _one_tensor_flows(source, body, i, last_use)]
    cuts = [
        0
    ]  # body indices where a block begins: right before a module with parameters, as late as one tensor alone flows
    for j, node in enumerate(body):
        if j and trains([node]):
            late = [i for i in valid if cuts[-1] < i <= j and trains(body[cuts[-1] : i])]
            if late:
                cuts.append(late[-1])
    while len(cuts) > 1 and not trains(body[cuts[-1] :]):
        cuts.pop()  # what follows the last module with parameters (the loss, the output's wrapping) ends the last block
    if len(cuts) == 1:
        raise ConfigError(
            f"{type(model).__name__}'s forward, traced, has no point where one tensor alone flows from one module to the "
            "next (the input is used again at the end, or several tensors flow between its layers), so it cannot be "
            f"cut into pipeline stages: {_FIX}"
        )
    segments = [body[a:b] for a, b in zip(cuts, [*cuts[1:], len(body)])]
    if target_node is not None:
        early = [u for u in target_node.users if u is not output and position[u] < cuts[-1]]
        if early:
            raise ConfigError(
                f"{type(model).__name__}.forward reads {targets!r} before its last block ({early[0].format_node()}), "
                f"where a pipeline's first stages never see the targets: pass loss_fn=fn to rd.train, or {_FIX}"
            )
    blocks: list[tuple[str, nn.Module]] = []
    names: set[str] = set()
    for index, segment in enumerate(segments):
        incoming = source if index == 0 else _crossing(source, body, cuts[index], last_use)[0]
        block = _block(
            model,
            segment,
            incoming,
            target_node if index == len(segments) - 1 else None,
            output if index == len(segments) - 1 else None,
            segments[index + 1] if index + 1 < len(segments) else None,
            last_use,
            position,
        )
        name = _name(segment, index)
        while name in names:
            name += "'"
        names.add(name)
        blocks.append((name, block))
    return blocks


def _crossing(source: fx.Node, body: list[fx.Node], cut: int, last_use: dict[fx.Node, int]) -> list[fx.Node]:
    """The values defined before ``body[cut]`` (the input included) that something from there on reads."""
    return [n for n in [source, *body[:cut]] if last_use[n] >= cut]


def _one_tensor_flows(source: fx.Node, body: list[fx.Node], cut: int, last_use: dict[fx.Node, int]) -> bool:
    """Whether a single tensor (not the input) is all that flows from ``body[:cut]`` to what follows."""
    crossing = _crossing(source, body, cut, last_use)
    return len(crossing) == 1 and crossing[0] is not source and _is_tensor(crossing[0])


def _name(segment: list[fx.Node], index: int) -> str:
    called = next((n for n in segment if n.op == "call_module"), None)
    return str(called.target) if called is not None else f"block{index}"


def _block(
    model: nn.Module,
    segment: list[fx.Node],
    incoming: fx.Node,
    target_node: fx.Node | None,
    output: fx.Node | None,
    following: list[fx.Node] | None,
    last_use: dict[fx.Node, int],
    position: dict[fx.Node, int],
) -> nn.Module:
    """One segment as an ``fx.GraphModule`` sharing ``model``'s modules: ``x -> next x`` (the last: ``(x[, targets]) -> outputs``)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {incoming: graph.placeholder("x")}
    takes_targets = target_node is not None and bool(target_node.users)
    if takes_targets:
        env[target_node] = graph.placeholder(str(target_node.target))  # type: ignore[index,union-attr]
    for node in segment:
        env[node] = graph.node_copy(node, lambda n: env[n])
    if output is not None:
        graph.output(fx.map_arg(output.args[0], lambda n: env[n]))
    else:
        end = position[segment[-1]] + 1
        passed = next(n for n in env if n is not target_node and last_use[n] >= end)
        graph.output(env[passed])
    block = fx.GraphModule(model, graph, class_name="TracedBlock")
    block.takes_targets = takes_targets  # type: ignore[assignment]
    return block


def check_faithful(model: nn.Module, inputs: Any, labels: Any = None, targets: str | None = None) -> None:
    """Raise :class:`ConfigError` unless the traced blocks compute what ``model``'s forward computes on ``inputs``.

    Symbolic tracing does not run the forward: an ``isinstance`` test, or a branch on
    ``self.training``, can take another path than the real call. So the blocks (traced
    with ``targets`` when the model computes its own loss from ``labels``) and the model's
    forward both run once on the sample, with the same random state, without gradients;
    every output must agree (to float tolerance) in structure, shape and value. The
    model's buffers (BatchNorm statistics) are restored afterwards. Models on the meta
    device (built deferred) compare shapes only.
    """
    blocks = traced_blocks(model, targets)
    extra = {targets: labels} if targets is not None and labels is not None else {}
    from rapydli.parallel.sample import unchanged

    with torch.no_grad(), unchanged(model):
        torch.manual_seed(0)
        expected = model(inputs, **extra)
        torch.manual_seed(0)
        x = inputs
        for _, block in blocks:
            x = block(x, labels) if getattr(block, "takes_targets", False) else block(x)
    want, want_shape = leaves(expected)
    got, got_shape = leaves(x)
    problem = None
    if want_shape != got_shape:
        problem = f"they return {got_shape} where forward returns {want_shape}"
    else:
        for index, (a, b) in enumerate(zip(want, got, strict=True)):
            if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
                problem = f"output {index} is a {type(b).__name__} where forward returns a {type(a).__name__}"
            elif isinstance(a, torch.Tensor) and a.shape != b.shape:
                problem = f"output {index} has shape {tuple(b.shape)} where forward's has {tuple(a.shape)}"
            elif (
                isinstance(a, torch.Tensor)
                and not a.is_meta
                and not torch.allclose(a.float(), b.float(), rtol=1e-5, atol=1e-6, equal_nan=True)
            ):
                problem = (
                    f"output {index} differs from forward's by up to {float((a.float() - b.float()).abs().max()):.3g}"
                )
            if problem is not None:
                break
    if problem is not None:
        raise ConfigError(
            f"{type(model).__name__}'s blocks, read by tracing its forward, do not compute what its forward computes: "
            f"{problem} (a branch the tracer cannot follow, such as an isinstance test on a tensor). {_FIX[0].upper()}{_FIX[1:]}"
        )


def leaves(value: Any) -> tuple[list[Any], str]:
    """The values inside ``value`` (mappings by key, tuples and lists in order) and its structure, as text.

    Any mapping counts (a Hugging Face ``ModelOutput`` too, which :mod:`torch.utils._pytree`
    would take for one opaque leaf).
    """
    if isinstance(value, Mapping):
        parts = [(k, leaves(v)) for k, v in value.items()]
        return [
            x for _, (xs, _) in parts for x in xs
        ], f"{type(value).__name__}({', '.join(f'{k}={d}' for k, (_, d) in parts)})"
    if isinstance(value, tuple | list):
        items = [leaves(v) for v in value]
        return [x for xs, _ in items for x in xs], f"{type(value).__name__}({', '.join(d for _, d in items)})"
    return [value], "tensor" if isinstance(value, torch.Tensor) else type(value).__name__
