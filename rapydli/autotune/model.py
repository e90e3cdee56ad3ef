"""Tuning a whole model: find its convolutions, tune each shape, pick a layout, swap in tuned layers.

The decision is a picklable :class:`Plan`, made once (in the notebook or on rank 0) and
applied identically on every rank::

    plan = plan_for(model, example_input)            # tunes (cached) -> Plan
    model = apply_plan(model, plan)                  # on every rank: swaps in TunedConv2d

:func:`autotune_model` does both on a copy and returns ``(tuned_model, report)``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn

from rapydli.autotune.candidates import PASSES, Instance, SplitInstance, conv_apply, get
from rapydli.autotune.conv import TuneResult, tune_conv2d
from rapydli.autotune.problem import LAYOUTS, ConvShape
from rapydli.autotune.search import MODES, Config
from rapydli.errors import ConfigError


@dataclass(frozen=True)
class LayerChoice:
    """What one convolution runs: a candidate, its parameters and its memory layout.

    ``candidate`` and ``params`` run the forward pass; ``data_grad`` and ``weight_grad``
    name other configurations (of the same layout) for the gradients when train-mode
    tuning found them faster there (None: the forward's configuration). ``time_ms`` is
    the sum of the chosen passes.
    """

    shape: ConvShape
    candidate: str
    params: tuple[tuple[str, Any], ...]
    layout: str
    time_ms: float
    default_ms: float | None = None
    data_grad: Config | None = None
    weight_grad: Config | None = None

    @property
    def configs(self) -> dict[str, Config]:
        """The configuration of each pass."""
        forward = Config(self.candidate, self.params)
        return {"forward": forward, "data_grad": self.data_grad or forward, "weight_grad": self.weight_grad or forward}

    def __str__(self) -> str:
        configs = self.configs
        if len(set(configs.values())) == 1:
            return str(configs["forward"])
        return ", ".join(f"{name}={config}" for name, config in configs.items())


@dataclass
class Plan:
    """The tuned choice for every convolution of a model, by module name (picklable).

    Attributes
    ----------
    layers
        Module name -> :class:`LayerChoice`.
    mode
        ``"train"`` or ``"inference"``: what was timed.
    fingerprint
        The device the plan was tuned on.
    estimates_ms
        Estimated convolution time of the whole model per strategy: ``default`` (F.conv2d NCHW),
        ``all_nchw``, ``all_nhwc``, ``planned`` (layout conversions included); and, when the
        plan was verified, ``measured_planned``, ``measured_library_nchw``,
        ``measured_library_nhwc`` (and ``measured_planned_whole`` when the plan splits passes,
        ``measured_planned_1.1x`` / ``measured_planned_1.25x`` when it has layers less than
        that much faster than the library): whole-model step times of those plans.
    chosen
        Which of those whole-model plans won (``"planned"`` unless a library plan, the plan
        without per-pass splits, ``"planned_whole"``, or one with its small gains put back on the
        library, ``"planned_1.1x"`` / ``"planned_1.25x"``, was faster).
    """

    layers: dict[str, LayerChoice]
    mode: str
    fingerprint: str
    estimates_ms: dict[str, float] = field(default_factory=dict)
    chosen: str = "planned"

    @property
    def layout(self) -> str:
        """The layout most planned layers use."""
        counts = {l: sum(c.layout == l for c in self.layers.values()) for l in LAYOUTS}
        return max(counts, key=lambda l: counts[l])


class TunedConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` that runs its planned candidate; same parameters and state-dict keys.

    Falls back to ``F.conv2d`` for inputs a generated kernel does not take (not float32, not CPU).
    """

    choice: LayerChoice
    generated: bool  # a pass runs a generated kernel (float32 CPU tensors only)

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, choice: LayerChoice) -> TunedConv2d:
        """Wrap ``conv`` (sharing its parameter objects) to run ``choice``."""
        tuned = cls.__new__(cls)
        tuned.__dict__.update(conv.__dict__)
        tuned._parameters = dict(conv._parameters)
        tuned._buffers = dict(conv._buffers)
        tuned._modules = dict(conv._modules)
        tuned.choice = choice
        tuned.generated = any(get(c.candidate).kind != "library" for c in choice.configs.values())
        tuned._inst = None
        fmt = torch.channels_last if choice.layout == "nhwc" else torch.contiguous_format
        with torch.no_grad():  # keep the weight in the layout its kernel reads: no per-step copy
            tuned.weight.data = tuned.weight.data.contiguous(memory_format=fmt)
        return tuned

    def instance(self) -> Instance:
        """The runnable instance (built, and compiled if generated, on first use).

        A :class:`SplitInstance` when the passes run on different configurations.
        """
        if self._inst is None:
            configs = self.choice.configs
            built = {c: get(c.candidate).instance(self.choice.shape, c.param_dict) for c in set(configs.values())}
            if len(built) == 1:
                self._inst = next(iter(built.values()))
            else:
                self._inst = SplitInstance(*(built[configs[name]] for name in PASSES))
        return self._inst

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.generated and (x.dtype != torch.float32 or x.device.type != "cpu" or self.weight.dtype != torch.float32):
            return F.conv2d(x, self.weight, self.bias, self.stride, self.padding)
        y = conv_apply(self.instance(), x, self.weight)
        if self.bias is not None:
            y = y + self.bias.view(1, -1, 1, 1)
        return y

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_inst"] = None  # ctypes handles do not pickle; rebuilt on first use
        return state

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, tuned={self.choice}"


def conv_shape_of(conv: nn.Conv2d, x_shape: torch.Size) -> ConvShape | None:
    """The :class:`ConvShape` of ``conv`` on an input of ``x_shape``, or None if not tunable."""
    square = conv.stride[0] == conv.stride[1] and isinstance(conv.padding, tuple) and conv.padding[0] == conv.padding[1]
    if (conv.groups != 1 or conv.dilation != (1, 1) or not square or conv.padding_mode != "zeros"
            or len(x_shape) != 4):
        return None
    n, c, h, w = (int(v) for v in x_shape)
    return ConvShape(n, c, h, w, conv.out_channels, *conv.kernel_size, stride=conv.stride[0], pad=conv.padding[0])


def conv_layers(model: nn.Module, example_input: torch.Tensor) -> list[tuple[str, nn.Conv2d, ConvShape | None]]:
    """Every ``nn.Conv2d`` in execution order with its input shape (found with forward hooks).

    Runs ``example_input`` through a copy of ``model``, so batch-norm statistics are untouched.
    """
    probe = copy.deepcopy(model)
    seen: list[tuple[str, torch.Size]] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.append((name, args[0].shape)))
        for name, m in probe.named_modules() if isinstance(m, nn.Conv2d)
    ]
    try:
        with torch.no_grad():
            probe(example_input)
    finally:
        for h in handles:
            h.remove()
    modules = dict(model.named_modules())
    order: dict[str, torch.Size] = {}
    for name, shape in seen:
        order.setdefault(name, shape)  # a module used twice keeps its first input shape
    return [(name, modules[name], conv_shape_of(modules[name], shape)) for name, shape in order.items()]


def _conversion_ms(shape: ConvShape, mode: str, reps: int = 5) -> float:
    """Time to change an input of ``shape`` between NCHW and NHWC (x2 in train mode: the gradient too)."""
    x = torch.randn(shape.n, shape.c, shape.h, shape.w)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        x.contiguous(memory_format=torch.channels_last)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3 * (2 if mode == "train" else 1)


def _layout_of(config: Config) -> str:
    return get(config.candidate).layout(config.param_dict)


def _choose_layouts(layers: list[tuple[str, ConvShape]], results: Mapping[ConvShape, TuneResult], mode: str,
                    input_layout: str) -> tuple[dict[str, str], dict[str, float]]:
    """Per-layer layout minimising conv time + conversions between consecutive convolutions (Viterbi)."""
    best_ms = {}
    for shape, result in results.items():
        for layout in LAYOUTS:
            split = result.best_split(lambda c, layout=layout: _layout_of(c) == layout)
            best_ms[(shape, layout)] = split.seconds * 1e3 if split is not None else float("inf")
    convert = {shape: _conversion_ms(shape, mode) for _, shape in layers}
    cost = {input_layout: 0.0, **{l: float("inf") for l in LAYOUTS if l != input_layout}}
    back: list[dict[str, str]] = []
    for _, shape in layers:
        new, step = {}, {}
        for layout in LAYOUTS:
            prev = min(LAYOUTS, key=lambda p: cost[p] + (0.0 if p == layout else convert[shape]))
            new[layout] = cost[prev] + (0.0 if prev == layout else convert[shape]) + best_ms[(shape, layout)]
            step[layout] = prev
        cost = new
        back.append(step)
    layout = min(LAYOUTS, key=lambda l: cost[l])
    chosen: list[str] = []
    for step in reversed(back):
        chosen.append(layout)
        layout = step[layout]
    chosen.reverse()
    estimates = {
        "planned": min(cost.values()),
        **{f"all_{l}": sum(best_ms[(s, l)] for _, s in layers)
           + (0.0 if l == input_layout or not layers else convert[layers[0][1]]) for l in LAYOUTS},
    }
    return {name: lay for (name, _), lay in zip(layers, chosen)}, estimates


def plan_for(model: nn.Module, example_input: torch.Tensor, mode: str = "train", engines: Any = None,
             verify: bool = True, **tune_options: Any) -> Plan:
    """Tune every unique convolution of ``model`` and plan each layer's candidate and layout.

    Parameters
    ----------
    model
        Any module with ``nn.Conv2d`` layers (grouped/dilated ones are left as they are).
    example_input
        One batch as the model will see it (its shape decides the tuned shapes).
    mode
        ``"train"`` (forward + both gradients timed) or ``"inference"``.
    engines
        A cluster to measure on in parallel (see :func:`~rapydli.autotune.tune_conv2d`).
    verify
        Time whole-model steps of the per-layer plan against all-NCHW and all-channels-last
        library plans and keep the fastest, so a tuned model is never slower than the
        best whole-model library layout.
    **tune_options
        Passed to :func:`~rapydli.autotune.tune_conv2d` (``strategy``, ``options``, ``preset``, ...).

    Returns
    -------
    Plan
        Picklable; ship it to every rank and call :func:`apply_plan` there.
    """
    return _plan(model, example_input, mode, engines, verify, **tune_options)[0]


def _plan(model: nn.Module, example_input: torch.Tensor, mode: str, engines: Any, verify: bool,
          **tune_options: Any) -> tuple[Plan, dict[ConvShape, TuneResult]]:
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    found = [(name, shape) for name, _, shape in conv_layers(model, example_input) if shape is not None]
    results: dict[ConvShape, TuneResult] = {}
    for _, shape in found:
        if shape not in results:
            results[shape] = tune_conv2d(shape, "cpu", mode, engines, **tune_options)
    input_layout = "nhwc" if example_input.dim() == 4 and example_input.is_contiguous(memory_format=torch.channels_last) \
        and not example_input.is_contiguous() else "nchw"
    layouts, estimates = _choose_layouts(found, results, mode, input_layout)
    layers: dict[str, LayerChoice] = {}
    default_total = 0.0
    for name, shape in found:
        result = results[shape]
        split = result.best_split(lambda c, lay=layouts[name]: _layout_of(c) == lay)
        default = result.best_of(lambda c: c.candidate == "torch_nchw")
        default_ms = default.median * 1e3 if default is not None else None
        default_total += default_ms or 0.0
        forward = split.config("forward")
        layers[name] = LayerChoice(shape, forward.candidate, forward.params, layouts[name], split.seconds * 1e3,
                                   default_ms, *(_other(split.config(p), forward) for p in PASSES[1:]))
    estimates["default"] = default_total
    fingerprint = next(iter(results.values())).device.fingerprint() if results else ""
    plan = Plan(layers, mode, fingerprint, estimates)
    if verify and layers:
        plan = _verified(model, example_input, plan, results)
    return plan, results


def _other(config: Config, forward: Config) -> Config | None:
    return None if config == forward else config


LIBRARY_OF_LAYOUT = {"nchw": "torch_nchw", "nhwc": "torch_channels_last"}


def _library_choice(choice: LayerChoice, results: Mapping[ConvShape, TuneResult], layout: str) -> LayerChoice | None:
    """``choice``'s layer on ``layout``'s library candidate (None when that was not measured)."""
    library = LIBRARY_OF_LAYOUT[layout]
    m = results[choice.shape].best_of(lambda c: c.candidate == library)
    return None if m is None else LayerChoice(choice.shape, library, (), layout, m.median * 1e3, choice.default_ms)


def _library_plan(plan: Plan, results: Mapping[ConvShape, TuneResult], layout: str) -> Plan:
    """Every layer of ``plan`` on ``layout``'s library candidate (``plan`` itself if one was not measured)."""
    layers = {name: _library_choice(choice, results, layout) for name, choice in plan.layers.items()}
    if any(choice is None for choice in layers.values()):
        return plan
    return Plan(layers, plan.mode, plan.fingerprint, dict(plan.estimates_ms))


def _whole_plan(plan: Plan, results: Mapping[ConvShape, TuneResult]) -> Plan:
    """``plan`` with every layer on the one configuration fastest over all its passes (no split)."""
    layers = {}
    for name, choice in plan.layers.items():
        m = results[choice.shape].best_of(lambda c, lay=choice.layout: _layout_of(c) == lay)
        layers[name] = LayerChoice(choice.shape, m.config.candidate, m.config.params, choice.layout, m.median * 1e3,
                                   choice.default_ms)
    return Plan(layers, plan.mode, plan.fingerprint, dict(plan.estimates_ms))


MARGINS = (1.1, 1.25)  # planned/library time ratios below which the whole-model check also tries the library
# interleaved rounds of the whole-model check: with 5 the bottleneck stack's fastest of the planned and library
# plans flipped between two checks of one tuning (planned_1.25x vs library_nhwc: 84.7 vs 82.3 ms, then 79.3 vs 84.0)
CHECK_REPS = 10


def _library_unless_faster(plan: Plan, results: Mapping[ConvShape, TuneResult], margin: float) -> Plan:
    """``plan`` with every layer not at least ``margin`` x faster than its layout's library candidate put back on it."""
    layers = {}
    for name, choice in plan.layers.items():
        library = _library_choice(choice, results, choice.layout)
        layers[name] = library if library is not None and library.time_ms < margin * choice.time_ms else choice
    return Plan(layers, plan.mode, plan.fingerprint, dict(plan.estimates_ms))


def _one_step(model: nn.Module, x: torch.Tensor, mode: str) -> float:
    start = time.perf_counter()
    if mode == "train":
        model.zero_grad(set_to_none=True)
        model(x).float().sum().backward()
    else:
        with torch.no_grad():
            model(x)
    return time.perf_counter() - start


def compare_steps(models: Mapping[str, nn.Module], x: torch.Tensor, mode: str, reps: int = 3) -> dict[str, float]:
    """Fastest ms of one forward (+ backward in train mode) of each model, timed in interleaved rounds.

    Interleaving (A, B, C, A, B, C, ...) after two warm-up rounds keeps a drifting machine load
    from favouring whichever model happens to be timed last; the minimum over rounds is the
    least disturbed step on a shared machine.
    """
    for model in models.values():
        model.train(mode == "train")
    for _ in range(2):  # warm-up: oneDNN primitives, allocator, kernel loading
        for model in models.values():
            _one_step(model, x, mode)
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(reps):
        for name, model in models.items():
            times[name].append(_one_step(model, x, mode))
    return {name: min(t) * 1e3 for name, t in times.items()}


def model_step_ms(model: nn.Module, x: torch.Tensor, mode: str, reps: int = 3) -> float:
    """Fastest ms of one forward (+ backward in train mode) of ``model`` on ``x`` (see :func:`compare_steps`)."""
    return compare_steps({"model": model}, x, mode, reps)["model"]


def _verified(model: nn.Module, x: torch.Tensor, plan: Plan, results: Mapping[ConvShape, TuneResult]) -> Plan:
    """Time whole-model steps of the per-layer plan and of the all-NCHW / all-channels-last library plans; keep the fastest.

    Per-layer times and conversion estimates miss what happens between convolutions
    (batch norm, residual adds in a mixed layout), so the whole-model choice is measured.
    A plan whose layers take passes from different configurations is also timed against
    the same plan without splits (``planned_whole``): a split layer runs its gradients as
    two calls through a Python autograd function, where a library layer makes one native
    call (on the bottleneck stack that cost 3-7% of a step, more than the split gained).
    For the same reason the plan is timed with the layers it makes less than 1.1x (1.25x)
    faster than their layout's library candidate put back on it (``planned_1.1x``,
    ``planned_1.25x``): the bottleneck stack gains from its Winograd 3x3 layers (1.5x in
    isolation) but loses on its split 1x1 layers (1.15x in isolation).
    """
    options = {
        "planned": plan,
        "library_nchw": _library_plan(plan, results, "nchw"),
        "library_nhwc": _library_plan(plan, results, "nhwc"),
    }
    whole = _whole_plan(plan, results)
    if whole.layers != plan.layers:
        options["planned_whole"] = whole
    for margin in MARGINS:
        mixed = _library_unless_faster(plan, results, margin)
        if all(mixed.layers != other.layers for other in options.values()):
            options[f"planned_{margin:g}x"] = mixed
    measured = compare_steps({name: apply_plan(copy.deepcopy(model), p) for name, p in options.items()}, x, plan.mode,
                             reps=CHECK_REPS)
    chosen = min(measured, key=lambda name: measured[name])
    best = options[chosen]
    best.estimates_ms = {**plan.estimates_ms, **{f"measured_{k}": v for k, v in measured.items()}}
    best.chosen = chosen
    return best


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Swap every planned ``nn.Conv2d`` of ``model`` for a :class:`TunedConv2d`, in place.

    The same plan gives the same model on every rank. Returns ``model``.
    """
    for name, choice in plan.layers.items():
        try:
            conv = model.get_submodule(name)
        except AttributeError as exc:
            raise ConfigError(f"plan names layer {name!r}, which this model does not have") from exc
        if not isinstance(conv, nn.Conv2d):
            raise ConfigError(f"plan layer {name!r} is a {type(conv).__name__}, not an nn.Conv2d")
        tuned = TunedConv2d.from_conv(conv, choice)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, tuned)
    return model


def report_table(plan: Plan) -> pd.DataFrame:
    """One row per planned layer: shape, choice, layout, time and speedup over F.conv2d NCHW."""
    rows = []
    for name, c in plan.layers.items():
        rows.append({
            "layer": name, "shape": c.shape.key.split(":", 1)[1], "candidate": c.candidate,
            "config": str(c), "layout": c.layout, "time_ms": c.time_ms,
            "default_ms": c.default_ms, "speedup": (c.default_ms / c.time_ms) if c.default_ms else None,
        })
    return pd.DataFrame(rows)


@dataclass
class AutotuneReport:
    """What :func:`autotune_model` did: the plan, a per-layer table and the estimated totals."""

    plan: Plan
    table: pd.DataFrame
    estimates_ms: dict[str, float]
    results: dict[ConvShape, TuneResult]
    seconds: float


def autotune_model(model: nn.Module, example_input: torch.Tensor, mode: str = "train", engines: Any = None,
                   verify: bool = True, **tune_options: Any) -> tuple[nn.Module, AutotuneReport]:
    """Tune ``model``'s convolutions and return a tuned copy with a report.

    Parameters
    ----------
    model, example_input, mode, engines, verify, **tune_options
        As for :func:`plan_for`.

    Returns
    -------
    (tuned_model, report)
        ``tuned_model`` is a deep copy of ``model`` with :class:`TunedConv2d` layers (same
        parameters values, same state-dict keys); its outputs and gradients equal the
        original's within float32 tolerance. ``report`` is an :class:`AutotuneReport`.

    Example
    -------
    >>> tuned, report = autotune_model(model, torch.randn(8, 3, 32, 32))  # doctest: +SKIP
    >>> report.table[["layer", "candidate", "layout", "speedup"]]  # doctest: +SKIP
    """
    started = time.perf_counter()
    plan, results = _plan(model, example_input, mode, engines, verify, **tune_options)
    tuned = apply_plan(copy.deepcopy(model), plan)
    return tuned, AutotuneReport(plan, report_table(plan), dict(plan.estimates_ms), results,
                                 time.perf_counter() - started)
