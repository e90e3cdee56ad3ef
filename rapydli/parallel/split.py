"""Splitting a model into pipeline stages at module boundaries.

A model is a sequence of *blocks*, run one after the other:

* an ``nn.Sequential``'s items, with nested ``nn.Sequential`` items expanded
  (``"blocks.2"`` is item 2 of the item ``blocks``);
* or what the model's own ``pipeline_blocks()`` method returns: ``(name, module)`` pairs
  whose composition is the model's forward (for models whose forward is not a plain
  chain, such as :class:`rapydli.zoo.models.TinyLM`);
* or, for any other model, the blocks read from its traced ``forward``
  (:mod:`rapydli.parallel.traced`: a GPT-2, Llama or nanoGPT as written needs nothing
  added), checked once against the model's own forward on a sample (:func:`decide`);
* or, for a model whose forward cannot be traced (a library's: ``transformers``' GPT-2,
  Llama, BERT, ViT), what it reads before its block list, each layer, and what it reads
  after: every stage runs the model's own forward, skipping other stages' layers
  (:mod:`rapydli.parallel.skipping`).

A split point names the block a new stage begins with: a block's name, or the name of
a container whose first block it is (``"blocks"`` = ``"blocks.0"``). ``"auto"`` times
every block's forward and backward on a sample batch and balances the stages on that
measurement (:func:`measure`, :func:`balance`); the decision is made once on rank 0 and
broadcast (:func:`decide`).

Examples
--------
>>> from torch import nn
>>> model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 2))
>>> [name for name, _ in pipeline_blocks(model)]
['0', '1', '2.0', '2.1', '3']
>>> boundaries(model, ["2"], stages=2)
[0, 2, 5]
>>> balance([1.0, 1.0, 4.0, 1.0, 1.0], stages=3)
[0, 2, 3, 5]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError
from rapydli.parallel.sample import unchanged
from rapydli.parallel.skipping import LayerStage, layer_blocks, layer_plan, splits_at_layers

#: Forward+backward repetitions per block when measuring for ``"auto"`` (the fastest kept).
MEASURE_REPEATS = 3


def pipeline_blocks(model: nn.Module, targets: str | None = None) -> list[tuple[str, nn.Module]]:
    """The model's blocks in the order its forward runs them, with their names.

    ``targets``: for a traced model that computes its own loss, the ``forward`` parameter
    it takes the targets by; its last block then takes ``(x, targets)``
    (:func:`rapydli.parallel.traced.traced_blocks`). Ignored for a model that lists its blocks.
    """
    own = getattr(model, "pipeline_blocks", None)
    if callable(own):
        return [(str(name), module) for name, module in own()]
    if isinstance(model, nn.Sequential):
        return _expand(model, "")
    from rapydli.parallel.traced import traced_blocks

    try:
        return traced_blocks(model, targets)
    except ConfigError as untraceable:  # a library's model: every stage runs its forward, skipping other stages' layers
        try:
            layer_plan(model)
        except ConfigError as no_plan:
            raise ConfigError(f"{no_plan}. Nor can it be traced: {untraceable}") from None
        return layer_blocks(model)


def lists_blocks(model: nn.Module) -> bool:
    """Whether ``model`` gives its blocks itself (an ``nn.Sequential``, or a ``pipeline_blocks()`` method) rather than being traced."""
    return callable(getattr(model, "pipeline_blocks", None)) or isinstance(model, nn.Sequential)


def _expand(sequential: nn.Sequential, prefix: str) -> list[tuple[str, nn.Module]]:
    blocks = []
    for name, child in sequential.named_children():
        full = f"{prefix}{name}"
        blocks += _expand(child, full + ".") if isinstance(child, nn.Sequential) and len(child) else [(full, child)]
    return blocks


def split_points(names: Sequence[str]) -> list[str]:
    """Every name a stage may begin with: each block but the first, and containers that begin at one."""
    allowed = []
    for index, name in enumerate(names):
        if index == 0:
            continue
        parts = name.split(".")
        for depth in range(1, len(parts) + 1):
            prefix = ".".join(parts[:depth])
            if prefix not in allowed and _first_index(names, prefix) == index:
                allowed.append(prefix)
    return allowed


def _first_index(names: Sequence[str], point: str) -> int | None:
    for index, name in enumerate(names):
        if name == point or name.startswith(point + "."):
            return index
    return None


def boundaries(model: nn.Module, points: Sequence[str], stages: int) -> list[int]:
    """Block indices where stages begin, plus the end: ``[0, b1, ..., len(blocks)]``.

    ``points`` are ``stages - 1`` split-point names in forward order; anything else is a
    :class:`ConfigError` naming the allowed split points.
    """
    names = [name for name, _ in pipeline_blocks(model)]
    _check_blocks(names, stages)
    allowed = split_points(names)
    if len(points) != stages - 1:
        raise ConfigError(
            f"pipeline_split names {len(points)} split point(s) for pipeline_stages={stages}: give {stages - 1}, "
            f"from: {', '.join(allowed)}"
        )
    cuts = [0]
    for point in points:
        index = _first_index(names, point) if point in allowed else None
        if index is None:
            raise ConfigError(
                f"pipeline_split point {point!r} is not a split point of {type(model).__name__}; allowed: {', '.join(allowed)}"
            )
        if index <= cuts[-1]:
            raise ConfigError(
                f"pipeline_split points must be in forward order with a block between them; {point!r} comes too early in {list(points)}"
            )
        cuts.append(index)
    _check_stages_hold_parameters(model, cuts + [len(names)])
    return cuts + [len(names)]


def _check_blocks(names: Sequence[str], stages: int) -> None:
    if len(names) < stages:
        raise ConfigError(
            f"the model has {len(names)} block(s) ({', '.join(names)}): it cannot be split into "
            f"pipeline_stages={stages}; allowed split points: {', '.join(split_points(names)) or 'none'}"
        )


def measure(model: nn.Module, sample: Any, repeats: int = MEASURE_REPEATS) -> list[float]:
    """Seconds of forward + backward of every block on ``sample`` (the model's input): the fastest of
    ``repeats``, the least disturbed by other work on a shared machine (a median of 3 is not,
    when 2 of them were preempted). A model split at its layers has its own forward timed at
    them (:func:`rapydli.parallel.skipping.measure`). Either way the model is left as it was
    (:func:`~rapydli.parallel.sample.unchanged`: BatchNorm's statistics, the random state)."""
    blocks = [module for _, module in pipeline_blocks(model)]
    if splits_at_layers(model) and not lists_blocks(model):  # a library's model: its own forward, timed at its layers
        from rapydli.parallel import skipping

        return skipping.measure(model, sample, repeats)
    with unchanged(
        model
    ):  # the measured forwards are no training step (BatchNorm's statistics, dropout's random state)
        return _measure(blocks, sample, repeats)


def _measure(blocks: list[nn.Module], sample: Any, repeats: int) -> list[float]:
    costs = []
    x = sample
    for block in blocks:
        times = []
        for _ in range(repeats):
            inp = _detached(x)
            started = time.perf_counter()
            out = block(inp)
            outs = [t for t in _tensors(out) if t.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
            times.append(time.perf_counter() - started)
        costs.append(min(times))
        with torch.no_grad():
            x = block(_detached(x, grad=False))
    block_grads = [p for b in blocks for p in b.parameters()]
    for p in block_grads:
        p.grad = None
    return costs


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, tuple | list) else []


def _detached(value: Any, grad: bool = True) -> Any:
    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        t = t.detach()
        return t.requires_grad_(True) if grad and t.is_floating_point() else t

    return tuple(one(t) for t in value) if isinstance(value, tuple) else one(value)


def balance(costs: Sequence[float], stages: int, holds: Sequence[bool] | None = None) -> list[int]:
    """Contiguous split of ``costs`` into ``stages`` non-empty parts minimising the largest part.

    With ``holds`` (a flag per block: it has parameters), every part holds at least one
    flagged block: a stage without parameters trains nothing and only adds a hop.
    Returns the boundaries ``[0, b1, ..., len(costs)]`` (dynamic programming, exact).

    >>> balance([1.0, 9.0, 1.0, 1.0], stages=2, holds=[False, False, True, True])
    [0, 3, 4]
    """
    n = len(costs)
    if n < stages:
        raise ConfigError(f"{n} block(s) cannot be balanced over pipeline_stages={stages}")
    flags = [True] * n if holds is None else list(holds)
    check_stage_count(flags, stages)
    prefix, held = [0.0], [0]
    for c, flag in zip(costs, flags, strict=True):
        prefix.append(prefix[-1] + c)
        held.append(held[-1] + flag)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: first i blocks in k stages
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if held[i] == held[j]:
                    continue  # blocks j..i would be a stage without parameters
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def check_stage_count(holds: Sequence[bool], stages: int) -> None:
    """Refuse more ``stages`` than blocks that hold parameters (``holds``: a flag per block)."""
    if sum(holds) < stages:
        raise ConfigError(
            f"only {sum(holds)} of the model's {len(holds)} blocks hold parameters: pipeline_stages={stages} "
            "needs one per stage (a stage without parameters trains nothing)"
        )


def holds_parameters(model: nn.Module) -> list[bool]:
    """Whether each of ``model``'s blocks (:func:`pipeline_blocks`) has parameters of its own."""
    return [any(True for _ in module.parameters()) for _, module in pipeline_blocks(model)]


def _check_stages_hold_parameters(model: nn.Module, bounds: Sequence[int]) -> None:
    """Refuse a split with a stage that has no parameters, naming it and its blocks."""
    blocks, holds = pipeline_blocks(model), holds_parameters(model)
    for stage, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if not any(holds[start:end]):
            names = ", ".join(name for name, _ in blocks[start:end])
            raise ConfigError(
                f"pipeline stage {stage} would hold only blocks without parameters ({names}): a stage "
                "that trains nothing only adds a hop; move its split point so that it holds a block "
                "with parameters"
            )


def decide(
    model: nn.Module,
    split: str | Sequence[str],
    stages: int,
    sample: Any,
    world: Any,
    labels: Any = None,
    targets: str | None = None,
) -> list[int]:
    """Stage boundaries every rank uses: checked (or measured, for ``"auto"``) on rank 0, broadcast.

    Collective over ``world``. An invalid split raises the same :class:`ConfigError` on
    every rank. A traced model's blocks are first run against its own forward on
    ``sample`` (and ``labels``, passed by the keyword ``targets`` when the model computes its
    own loss): blocks that compute something else are refused
    (:func:`rapydli.parallel.traced.check_faithful`).
    """
    bounds, error = None, None
    if world.Get_rank() == 0:
        try:
            names = [name for name, _ in pipeline_blocks(model, targets)]
            at_layers = splits_at_layers(model)
            if sample is not None and not lists_blocks(model) and not at_layers:
                from rapydli.parallel.traced import check_faithful

                check_faithful(model, sample, labels, targets)
            if split == "auto":
                _check_blocks(names, stages)
                bounds = balance(measure(model, sample), stages, holds_parameters(model))
            else:
                bounds = boundaries(model, list(split), stages)
        except ConfigError as exc:
            error = str(exc)
    bounds, error = world.bcast((bounds, error), root=0)
    if error is not None:
        raise ConfigError(error)
    return bounds


class Stage(nn.Sequential):
    """One stage's blocks, run in order (an ``nn.Sequential`` sharing the model's modules).

    The last stage of a traced model that computes its own loss is called
    ``stage(x, targets)``: its last block takes them (:attr:`takes_targets`).

    Attributes
    ----------
    counted_elsewhere
        ``id``s of this stage's parameters that an earlier stage also holds (tied weights,
        :mod:`rapydli.parallel.shared`): a global gradient norm counts them there, once.
    """

    counted_elsewhere: frozenset[int] = frozenset()

    def forward(self, x: Any, targets: Any = None) -> Any:
        for block in self:
            x = block(x, targets) if getattr(block, "takes_targets", False) else block(x)
        return x

    @property
    def takes_targets(self) -> bool:
        """Whether a block of this stage takes the targets (the model's own loss, traced)."""
        return any(getattr(block, "takes_targets", False) for block in self)


def stage_module(
    model: nn.Module, bounds: Sequence[int], stage: int, targets: str | None = None
) -> tuple[Stage | LayerStage, list[str]]:
    """Stage ``stage``'s blocks as one module (sharing the model's modules) and their names.

    A :class:`Stage` running the blocks in turn, or for a model split at its layers a
    :class:`~rapydli.parallel.skipping.LayerStage` running the model's forward.
    ``targets``: as for :func:`pipeline_blocks`.
    """
    blocks = pipeline_blocks(model, targets)[bounds[stage] : bounds[stage + 1]]
    names = [name for name, _ in blocks]
    if splits_at_layers(model) and not lists_blocks(model):
        return LayerStage.between(model, bounds, stage, targets), names
    return Stage(*(module for _, module in blocks)), names


def model_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks ``model``'s forward calls, in order: what ZeRO-3 gathers and activation checkpointing recomputes one at a time.

    The modules of :func:`pipeline_blocks` that are ``model``'s own submodules (a
    ``pipeline_blocks()`` may wrap some of the model's modules in new ones, such as an
    embedding stage, which the model's own forward never calls). A model that has no
    ``pipeline_blocks()`` and is not an ``nn.Sequential``: its children that hold
    parameters, the items of a ``ModuleList`` or ``ModuleDict`` child counting one by one,
    and a child that holds such a list (Hugging Face's ``LlamaForCausalLM.model``,
    ``GPT2LMHeadModel.transformer``) giving its own children in its place, so a decoder's
    layers are blocks of their own however deep the model nests them.

    Examples
    --------
    >>> from torch import nn
    >>> class Net(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed, self.layers, self.act = nn.Embedding(4, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.ReLU()
    >>> [name for name, _ in model_blocks(Net())]
    ['embed', 'layers.0', 'layers.1']
    >>> class CausalLM(nn.Module):  # the decoder one level down, as Hugging Face nests it
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.model, self.lm_head = Net(), nn.Linear(2, 4)
    >>> [name for name, _ in model_blocks(CausalLM())]
    ['model.embed', 'model.layers.0', 'model.layers.1', 'lm_head']
    """
    own = {id(m) for m in model.modules() if m is not model}
    if lists_blocks(model):
        return [(name, block) for name, block in pipeline_blocks(model) if id(block) in own]
    return _children_blocks(model, "")


def _children_blocks(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
    blocks: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        if isinstance(child, nn.ModuleList | nn.ModuleDict):
            blocks.extend((f"{prefix}{name}.{item}", m) for item, m in child.named_children() if _holds_parameters(m))
        elif any(
            isinstance(c, nn.ModuleList | nn.ModuleDict) and any(_holds_parameters(m) for m in c.children())
            for c in child.children()
        ):
            blocks.extend(_children_blocks(child, f"{prefix}{name}."))
        elif _holds_parameters(child):
            blocks.append((f"{prefix}{name}", child))
    return blocks


def _holds_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())
