"""Tuning a whole model: find its convolutions, tune each shape, pick a layout, swap in tuned layers.

The decision is a picklable :class:`Plan`, made once (in the notebook or on rank 0) and
applied identically on every rank::

    plan = plan_for(model, example_input)            # tunes (cached) -> Plan
    model = apply_plan(model, plan)                  # on every rank: swaps in TunedConv2d

:func:`autotune_model` does both on a copy and returns ``(tuned_model, report)``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from rapydli.autotune.candidates import PASSES, Instance, SplitInstance, conv_apply, get
from rapydli.autotune.conv import TuneResult
from rapydli.autotune.problem import LAYOUTS, ConvShape
from rapydli.autotune.search import MODES, Config
from rapydli.errors import ConfigError
from rapydli.spread import load_text, machine_load


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

    @property
    def is_library_default(self) -> bool:
        """Whether every pass runs the library default (``F.conv2d``, NCHW): the layer stays a plain ``nn.Conv2d``."""
        return set(self.configs.values()) == {Config("torch_nchw")}

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
        that much faster than the library): whole-model step times of those plans (the
        fastest of the interleaved rounds), with ``speedup_low``/``speedup_high``, the range of
        the library default's step over the chosen plan's round by round, and ``speedup_rounds``.
        A speedup is claimed only where every round shows one.
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
        counts = {lay: sum(c.layout == lay for c in self.layers.values()) for lay in LAYOUTS}
        return max(counts, key=lambda lay: counts[lay])


class TunedConv2d(nn.Conv2d):
    """An ``nn.Conv2d`` that runs its planned candidate; same parameters and state-dict keys.

    Falls back to ``F.conv2d`` for inputs a generated kernel does not take: not float32
    (bf16 autocast), or on a device its candidate does not run on (the C kernels run on the
    CPU, the Triton kernel on a GPU).
    """

    choice: LayerChoice
    generated: bool  # a pass runs a generated kernel (float32 only, on the devices of its candidate)
    devices: frozenset[str]  # the device types every planned pass runs on
    _inst: Instance | None  # built on first use

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
        tuned.devices = frozenset.intersection(*(frozenset(get(c.candidate).devices) for c in choice.configs.values()))
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
        if self.generated and (
            x.dtype != torch.float32 or x.device.type not in self.devices or self.weight.dtype != torch.float32
        ):
            return self._conv_forward(x, self.weight, self.bias)
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
    """The :class:`ConvShape` of ``conv`` on an input of ``x_shape``, or None if not tunable.

    Any groups and dilation are tunable; a stride, padding or dilation that differs between
    rows and columns, a padding mode other than zeros and a non-4-D input are not.
    """
    padding = conv.padding
    square = (
        conv.stride[0] == conv.stride[1]
        and isinstance(padding, tuple)
        and padding[0] == padding[1]
        and conv.dilation[0] == conv.dilation[1]
    )
    if not square or conv.padding_mode != "zeros" or len(x_shape) != 4:
        return None
    assert isinstance(padding, tuple)  # checked in square
    n, c, h, w = (int(v) for v in x_shape)
    r, s = conv.kernel_size
    return ConvShape(
        n,
        c,
        h,
        w,
        conv.out_channels,
        r,
        s,
        stride=conv.stride[0],
        pad=padding[0],
        groups=conv.groups,
        dilation=conv.dilation[0],
    )


def conv_layers(model: nn.Module, example_input: torch.Tensor) -> list[tuple[str, nn.Conv2d, ConvShape | None]]:
    """Every ``nn.Conv2d`` in execution order with its input shape (found with forward hooks).

    Runs ``example_input`` through a copy of ``model``, so batch-norm statistics are untouched.
    """
    probe = copy.deepcopy(model)
    seen: list[tuple[str, torch.Size]] = []
    handles = [
        m.register_forward_pre_hook(lambda mod, args, name=name: seen.append((name, args[0].shape)))
        for name, m in probe.named_modules()
        if isinstance(m, nn.Conv2d)
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


def layout_of(config: Config) -> str:
    """The memory layout (``"nchw"`` or ``"nhwc"``) ``config`` runs in."""
    return get(config.candidate).layout(config.param_dict)


def in_layout(layout: str) -> Callable[[Config], bool]:
    """A predicate: whether a configuration runs in ``layout``."""
    return lambda config: layout_of(config) == layout


def _choose_layouts(
    layers: list[tuple[str, ConvShape]], results: Mapping[ConvShape, TuneResult], mode: str, input_layout: str
) -> tuple[dict[str, str], dict[str, float]]:
    """Per-layer layout minimising conv time + conversions between consecutive convolutions (Viterbi)."""
    best_ms = {}
    for shape, result in results.items():
        for layout in LAYOUTS:
            split = result.best_split(in_layout(layout))
            best_ms[(shape, layout)] = split.seconds * 1e3 if split is not None else float("inf")
    convert = {shape: _conversion_ms(shape, mode) for _, shape in layers}
    cost = {input_layout: 0.0, **{lay: float("inf") for lay in LAYOUTS if lay != input_layout}}
    back: list[dict[str, str]] = []
    for _, shape in layers:
        new, step = {}, {}
        for layout in LAYOUTS:
            prev = min(LAYOUTS, key=lambda p: cost[p] + (0.0 if p == layout else convert[shape]))
            new[layout] = cost[prev] + (0.0 if prev == layout else convert[shape]) + best_ms[(shape, layout)]
            step[layout] = prev
        cost = new
        back.append(step)
    layout = min(LAYOUTS, key=lambda lay: cost[lay])
    chosen: list[str] = []
    for step in reversed(back):
        chosen.append(layout)
        layout = step[layout]
    chosen.reverse()
    estimates = {
        "planned": min(cost.values()),
        **{
            f"all_{lay}": sum(best_ms[(s, lay)] for _, s in layers)
            + (0.0 if lay == input_layout or not layers else convert[layers[0][1]])
            for lay in LAYOUTS
        },
    }
    return {name: lay for (name, _), lay in zip(layers, chosen)}, estimates


def plan_for(
    model: nn.Module,
    example_input: torch.Tensor,
    mode: str = "train",
    engines: Any = None,
    verify: bool = True,
    budget_s: float | None = None,
    progress: bool = False,
    **tune_options: Any,
) -> Plan:
    """Tune every unique convolution of ``model`` and plan each layer's candidate and layout.

    Parameters
    ----------
    model
        Any module with ``nn.Conv2d`` layers (grouped, depthwise and dilated ones included; see
        :func:`conv_shape_of` for the few left as they are).
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
    budget_s
        Seconds the whole tuning may take, the whole-model check included (None: no limit):
        shapes are tuned costliest first, each within its share, and those the budget does
        not reach stay on the library (see :mod:`rapydli.autotune.budget` for what it bounds).
    progress
        Show a tqdm bar (layers done, configurations timed, best layer speedup).
    **tune_options
        Passed to :func:`~rapydli.autotune.tune_conv2d` (``strategy``, ``options``, ``preset``,
        ``cache``, ...); ``on_layer`` (a callable) receives each shape's row as it finishes.

    Returns
    -------
    Plan
        Picklable; ship it to every rank and call :func:`apply_plan` there.
    """
    return _plan(model, example_input, mode, engines, verify, budget_s, progress, **tune_options)[0]


def _plan(
    model: nn.Module,
    example_input: torch.Tensor,
    mode: str,
    engines: Any,
    verify: bool,
    budget_s: float | None = None,
    progress: bool = False,
    on_layer: Any = None,
    **tune_options: Any,
) -> tuple[Plan, Any]:
    """The plan and what was measured for it (a :class:`~rapydli.autotune.budget.LayerTuning`, None from a stored plan)."""
    from rapydli.autotune import plans
    from rapydli.autotune.budget import tune_layers
    from rapydli.autotune.cache import Cache
    from rapydli.autotune.check import verified
    from rapydli.autotune.conv import cache_fingerprint
    from rapydli.autotune.device import query
    from rapydli.autotune.progress import TuningProgress

    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    started = time.monotonic()
    cache = tune_options.get("cache", True)
    if cache is True:
        cache = tune_options["cache"] = Cache()
    key = None
    if cache is not False:
        info = query("cuda" if example_input.is_cuda else "cpu", tune_options.get("threads") or torch.get_num_threads())
        key = plans.plan_key(cache_fingerprint(info), model, example_input, mode, verify, budget_s, tune_options)
        stored = cache.get_plan(key)
        if stored is not None:
            return plans.plan_from_json(stored), None
    found = [(name, shape) for name, _, shape in conv_layers(model, example_input) if shape is not None]
    bar = TuningProgress(len(found), progress, on_layer)
    try:
        tuning = tune_layers(model, example_input, found, mode, engines, budget_s, started, bar, **tune_options)
        results = tuning.results
        found = [(name, shape) for name, shape in found if shape in results]  # the rest stay as they are
        input_layout = (
            "nhwc"
            if example_input.dim() == 4
            and example_input.is_contiguous(memory_format=torch.channels_last)
            and not example_input.is_contiguous()
            else "nchw"
        )
        layouts, estimates = _choose_layouts(found, results, mode, input_layout)
        layers: dict[str, LayerChoice] = {}
        default_total = 0.0
        for name, shape in found:
            result = results[shape]
            split = result.best_split(in_layout(layouts[name]))
            assert split is not None  # the layout was chosen at a finite cost: it has a split
            default = result.best_split(lambda c: c.candidate == "torch_nchw")  # summed as the choice's time is
            default_ms = default.seconds * 1e3 if default is not None else None
            default_total += default_ms or 0.0
            forward = split.config("forward")
            layers[name] = LayerChoice(
                shape,
                forward.candidate,
                forward.params,
                layouts[name],
                split.seconds * 1e3,
                default_ms,
                *(_other(split.config(p), forward) for p in PASSES[1:]),
            )
        estimates["default"] = default_total
        fingerprint = next(iter(results.values())).device.fingerprint() if results else ""
        plan = Plan(layers, mode, fingerprint, estimates)
        tuning.seconds["check"] = 0.0
        if verify and not is_library_default(plan):  # the library default is the untuned model: nothing to check
            bar.describe("autotune: whole-model check")
            checked = time.perf_counter()
            plan = verified(
                model,
                example_input,
                plan,
                results,
                deadline=None if budget_s is None else started + budget_s,
                step_ms=tuning.step_ms,
            )
            tuning.seconds["check"] = time.perf_counter() - checked
    finally:
        bar.close()
    if key is not None and cache is not False:
        cache.put_plan(key, plans.plan_to_json(plan))
    return plan, tuning


def is_library_default(plan: Plan) -> bool:
    """Whether every layer of ``plan`` runs the library default (``F.conv2d``, NCHW) in all its passes."""
    return plan.chosen == "library_nchw" or all(c.is_library_default for c in plan.layers.values())


def _other(config: Config, forward: Config) -> Config | None:
    return None if config == forward else config


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Swap every planned ``nn.Conv2d`` of ``model`` for a :class:`TunedConv2d`, in place.

    A layer planned on the library default in every pass stays the plain ``nn.Conv2d`` it
    is (no wrapper, so "the model keeps the library" costs nothing); a plan whose
    whole-model check chose the library (``chosen == "library_nchw"``) has only such
    layers, so it leaves the model as it is. The same plan gives the same model on every
    rank. Returns ``model``.
    """
    for name, choice in plan.layers.items():
        try:
            conv = model.get_submodule(name)
        except AttributeError as exc:
            raise ConfigError(f"plan names layer {name!r}, which this model does not have") from exc
        if not isinstance(conv, nn.Conv2d):
            raise ConfigError(f"plan layer {name!r} is a {type(conv).__name__}, not an nn.Conv2d")
        if choice.is_library_default:
            continue
        tuned = TunedConv2d.from_conv(conv, choice)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, tuned)
    return model


def report_table(plan: Plan) -> pd.DataFrame:
    """One row per planned layer: shape, choice, layout, time and speedup over F.conv2d NCHW."""
    rows = []
    for name, c in plan.layers.items():
        rows.append(
            {
                "layer": name,
                "shape": c.shape.text,
                "candidate": c.candidate,
                "config": str(c),
                "layout": c.layout,
                "time_ms": c.time_ms,
                "default_ms": c.default_ms,
                "speedup": (c.default_ms / c.time_ms) if c.default_ms else None,
            }
        )
    return pd.DataFrame(rows)


@dataclass
class AutotuneReport:
    """What :func:`autotune_model` did.

    Attributes
    ----------
    plan, table, estimates_ms
        The plan, one row per planned layer (see :func:`report_table`) and the estimated
        and measured totals (see :class:`Plan`).
    results
        Shape -> :class:`TuneResult` (empty when the plan came from the cache).
    seconds
        Wall seconds of the whole call.
    layers
        One row per unique shape in the order tuned (costliest first): share of the step,
        default and tuned ms, speedup, configurations evaluated, status (``"tuned"``,
        ``"skipped: budget"``).
    time_s
        Where the seconds went: ``profile`` (timing the untuned step), ``compile``,
        ``validate``, ``time`` (the measurements' phases, summed over engines), ``search``
        (the wall time of all measuring), ``check`` (the whole-model check), ``other``.
    skipped
        Layers the budget left on the library.
    budget_s, from_cache, measured
        The budget (None: none), whether the plan was read from the cache (nothing
        measured), and the configurations measured by this call.
    summary
        One line: the measured step before and after, or that nothing faster was found.
    step_ms
        The untuned model's step as the profile timed it (None from a stored plan).
    """

    plan: Plan
    table: pd.DataFrame
    estimates_ms: dict[str, float]
    results: dict[ConvShape, TuneResult]
    seconds: float
    layers: pd.DataFrame = field(default_factory=pd.DataFrame)
    time_s: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    budget_s: float | None = None
    from_cache: bool = False
    measured: int = 0
    summary: str = ""
    step_ms: float | None = None


def _rounds_text(low: float, high: float, rounds: float) -> str:
    """``"the rounds span 0.95x to 1.10x"`` or ``"one timed round"``."""
    return "one timed round" if rounds < 2 else f"the rounds span {low:.2f}x to {high:.2f}x"


def _summary(
    plan: Plan,
    seconds: float,
    budget_s: float | None,
    skipped: list[str],
    from_cache: bool,
    step_ms: float | None = None,
) -> str:
    """The one line a tuning ends with."""
    spent = f"{seconds:.1f} s" + (f" of a {budget_s:g} s budget" if budget_s is not None else "")
    if from_cache:
        spent = f"plan read from the cache in {seconds:.2f} s"
    budget = f"; {len(skipped)} layer(s) skipped by the budget" if skipped else ""
    measured = plan.estimates_ms
    base, chosen = measured.get("measured_library_nchw"), measured.get(f"measured_{plan.chosen}")
    if skipped and len(set(skipped)) >= len(plan.layers):  # nothing was tried: no finding either way
        step = f"the untuned step took {step_ms:.0f} ms, " if step_ms else ""
        return (
            f"autotune: the budget left no time to tune any layer ({step}{load_text(machine_load())}; a larger "
            f"budget_s or a quieter machine); the model keeps the library default ({spent})"
        )
    if is_library_default(plan):
        return (
            f"autotune: nothing faster than the library default (F.conv2d, NCHW) was found; "
            f"the model keeps it ({spent}{budget})"
        )
    if base and chosen:
        low, high, rounds = (measured.get(k, math.nan) for k in ("speedup_low", "speedup_high", "speedup_rounds"))
        if plan.chosen == "library_nchw" or math.isnan(low):
            interval = ""
        elif low > 1 and rounds >= 2:
            interval = f", rounds {low:.2f} to {high:.2f}"
        else:  # the rounds do not show the chosen plan faster: say so, not a speedup
            return (
                f"autotune: step {base:.1f} -> {chosen:.1f} ms with {plan.chosen}, not shown faster than the "
                f"library default ({_rounds_text(low, high, rounds)}: the machine was too noisy or the "
                f"difference too small; {load_text(machine_load())}) ({spent}{budget})"
            )
        return f"autotune: step {base:.1f} -> {chosen:.1f} ms ({base / chosen:.2f}x{interval}, {plan.chosen}) ({spent}{budget})"
    return f"autotune: planned ({plan.chosen}), not verified ({spent}{budget})"


def autotune_model(
    model: nn.Module,
    example_input: torch.Tensor,
    mode: str = "train",
    engines: Any = None,
    verify: bool = True,
    budget_s: float | None = None,
    progress: bool = True,
    **tune_options: Any,
) -> tuple[nn.Module, AutotuneReport]:
    """Tune ``model``'s convolutions and return a tuned copy with a report.

    Parameters
    ----------
    model, example_input, mode, engines, verify, budget_s, progress, **tune_options
        As for :func:`plan_for` (here the progress bar is on by default, and its last line is
        :attr:`AutotuneReport.summary`).

    Returns
    -------
    (tuned_model, report)
        ``tuned_model`` is a deep copy of ``model`` with :class:`TunedConv2d` layers (same
        parameters values, same state-dict keys); its outputs and gradients equal the
        original's within float32 tolerance. ``report`` is an :class:`AutotuneReport`.

    Example
    -------
    >>> tuned, report = autotune_model(model, torch.randn(8, 3, 32, 32), budget_s=60)  # doctest: +SKIP
    >>> report.layers[["shape", "share", "speedup", "status"]]  # doctest: +SKIP
    """
    started = time.perf_counter()
    plan, tuning = _plan(model, example_input, mode, engines, verify, budget_s, progress, **tune_options)
    tuned = apply_plan(copy.deepcopy(model), plan)
    seconds = time.perf_counter() - started
    time_s: dict[str, float] = {}
    if tuning is not None:
        time_s = dict(tuning.seconds)
        measuring = sum(time_s.get(p, 0.0) for p in ("compile", "validate", "time"))
        time_s["search_other"] = max(0.0, time_s["search"] - measuring)
        time_s["other"] = max(0.0, seconds - time_s["profile"] - time_s["search"] - time_s.get("check", 0.0))
    skipped = tuning.skipped if tuning is not None else []
    summary = _summary(plan, seconds, budget_s, skipped, tuning is None, tuning.step_ms if tuning is not None else None)
    if progress:
        print(summary)
    return tuned, AutotuneReport(
        plan,
        report_table(plan),
        dict(plan.estimates_ms),
        tuning.results if tuning is not None else {},
        seconds,
        pd.DataFrame(tuning.rows) if tuning is not None else pd.DataFrame(),
        time_s,
        skipped,
        budget_s,
        tuning is None,
        tuning.measured if tuning is not None else 0,
        summary,
        tuning.step_ms if tuning is not None else None,
    )
