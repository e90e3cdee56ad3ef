"""Tuning a model's convolution shapes within a time budget, the costliest first.

1. **Profile.** The library default (``F.conv2d`` NCHW) of every unique shape is measured
   (no compiles) and the model's step is timed once; each shape's share is its layers'
   default time over the step.
2. **Rank and search.** Shapes are tuned in order of that time (count x default time).
   With a budget, each shape gets the remaining search time in proportion to its weight
   among the shapes still to tune (time a shape leaves unused flows to the next), no new
   measurement starts after its slice, and a shape whose slice is shorter than a typical
   evaluation is skipped; the search leaves room for the whole-model check. The
   default strategy is then ``model_based``, seeded with the winners and measurements of
   the shapes tuned before (same kernel size and stride).
3. Every measurement goes to the cache as it is taken: an interrupted tuning resumes
   where it stopped, and identical shapes are tuned once.

The budget is kept up to one evaluation (compile, validate, time of one configuration;
a chunk of them per engine with a cluster) plus two rounds of the whole-model check (its
warm-up and first timed round run even past the deadline: the check is what makes a tuned
model never slower than the library).
"""

from __future__ import annotations

import copy
import functools
import math
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rapydli.autotune.cache import Cache
from rapydli.autotune.candidates import registry
from rapydli.autotune.check import model_step_ms
from rapydli.autotune.conv import TuneResult, tune_conv2d
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.progress import TuningProgress
from rapydli.autotune.runner import PHASES, Measurement
from rapydli.errors import ConfigError

DEFAULT = "torch_nchw"  # what an untuned nn.Conv2d runs
CHECK_PLANS = 6  # whole-model plans the check may time (planned, 2 library, whole, 2 margins)
CHECK_ROUNDS = 3  # rounds reserved for the check (one warm-up, two timed; it takes more while time is left)
PARALLEL_BATCH = 4  # configurations the model-based search hands a cluster at once (the cache's chunk)
FIRST_EVALUATION_S = 1.0  # assumed cost of one evaluation before any was seen


@dataclass
class LayerTuning:
    """What :func:`tune_layers` measured.

    Attributes
    ----------
    results
        Shape -> :class:`TuneResult` (library variants only for a shape the budget skipped).
    rows
        One dict per unique shape, in rank order: ``rank``, ``layers`` (count), ``names``,
        ``shape``, ``share`` (of the model step), ``default_ms`` and ``tuned_ms`` (per layer),
        ``speedup``, ``evaluated`` (generated configurations measured now), ``cached``
        (read from the cache), ``status`` (``"tuned"`` or ``"skipped: budget"``).
    seconds
        Wall seconds per phase: ``profile`` (the model step), ``compile``, ``validate``,
        ``time`` (the measurements' own phases, summed over engines), ``search`` (all of
        the measuring, wall).
    skipped
        Layer names whose shape the budget left on the library variants.
    step_ms
        The untuned model's step (forward, + backward in train mode).
    """

    results: dict[ConvShape, TuneResult]
    rows: list[dict[str, Any]]
    seconds: dict[str, float] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    step_ms: float = 0.0
    measured: int = 0


def check_estimate_s(step_ms: float, profile_s: float) -> float:
    """Seconds reserved for the whole-model check: its first rounds of ``step_ms`` steps (x1.5 for slower
    plans) plus the profile's ``profile_s`` (first steps of new layouts and kernels cost what the profile's did).

    The check times as many rounds (up to :data:`~rapydli.autotune.check.CHECK_REPS`) as the time left at the
    budget's end holds.
    """
    return CHECK_PLANS * CHECK_ROUNDS * step_ms * 1.5 / 1e3 + profile_s


def _default_ms(result: TuneResult) -> float | None:
    split = result.best_split(lambda c: c.candidate == DEFAULT)  # summed as the tuned time is
    return split.seconds * 1e3 if split is not None else None


def _tuned_ms(result: TuneResult) -> float | None:
    split = result.best_split(lambda c: True)
    return split.seconds * 1e3 if split is not None else None


def _winners(result: TuneResult) -> list[Any]:
    """The generated configurations a layer's passes chose (priors for the next shapes)."""
    split = result.best_split(lambda c: registry()[c.candidate].kind != "library")
    return [] if split is None else list(dict.fromkeys(m.config for m in split.passes.values()))


def tune_layers(model: nn.Module, example_input: torch.Tensor, found: Sequence[tuple[str, ConvShape]], mode: str,
                engines: Any, budget_s: float | None, started: float, progress: TuningProgress,
                **tune_options: Any) -> LayerTuning:
    """Profile, rank and tune the unique shapes of ``found`` (see the module docstring).

    ``started`` is the ``time.monotonic()`` the budget counts from; ``tune_options`` go to
    :func:`~rapydli.autotune.tune_conv2d` (``strategy`` defaults to ``model_based`` with a
    budget, ``exhaustive`` without).
    """
    if budget_s is not None and not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ConfigError(f"budget_s must be a positive number of seconds or None, got {budget_s!r}")
    options = dict(tune_options)
    cache = options.pop("cache", True)
    with tempfile.TemporaryDirectory(prefix="rapydli-autotune-") as tmp:
        if cache is False:  # measurements must go somewhere for a resumable, budgeted search: a scratch cache
            cache = Cache(f"{tmp}/scratch.db")
        return _tune_layers(model, example_input, found, mode, engines, budget_s, started, progress, cache, options)


def _tune_layers(model: nn.Module, x: torch.Tensor, found: Sequence[tuple[str, ConvShape]], mode: str, engines: Any,
                 budget_s: float | None, started: float, progress: TuningProgress, cache: Cache | bool,
                 options: dict[str, Any]) -> LayerTuning:
    names: dict[ConvShape, list[str]] = {}
    for name, shape in found:
        names.setdefault(shape, []).append(name)
    seconds = {phase: 0.0 for phase in PHASES}
    evaluations: list[float] = []
    taken: dict[ConvShape, int] = {}

    def on_result(m: Measurement, shape: ConvShape | None = None) -> None:
        for phase, s in m.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + s
        if shape is not None and registry()[m.config.candidate].kind != "library":
            taken[shape] = taken.get(shape, 0) + 1
            evaluations.append(sum(m.seconds.values()))
        progress.measured(m.status)

    # 1. profile: the model's step, the library variants of every shape
    progress.describe("autotune: profiling")
    t0 = time.perf_counter()
    step_ms = model_step_ms(copy.deepcopy(model), x, mode, reps=1, deadline=started)  # one warm-up, one timed step
    profile_s = time.perf_counter() - t0
    common = {k: v for k, v in options.items() if k in ("repetitions", "warmup", "threads", "preset")}
    search_started = time.perf_counter()
    results = {shape: tune_conv2d(shape, "cpu", mode, engines, strategy="exhaustive",
                                  candidates=[DEFAULT], cache=cache, on_result=on_result,
                                  **common) for shape in names}
    weight = {shape: len(names[shape]) * (_default_ms(r) or 0.0) for shape, r in results.items()}
    ranked = sorted(names, key=lambda s: -weight[s])

    # 2. search, costliest shape first
    deadline = None if budget_s is None else started + budget_s - check_estimate_s(step_ms, profile_s)
    strategy = options.pop("strategy", "model_based" if budget_s is not None else "exhaustive")
    user_opts = dict(options.pop("options", None) or {})
    rows, skipped = [], []
    for rank, shape in enumerate(ranked, start=1):
        slice_end = None
        if deadline is not None:
            now = time.monotonic()
            left = sum(weight[s] for s in ranked[rank - 1:]) or 1.0
            slice_end = min(deadline, now + (deadline - now) * (weight[shape] or 1.0 / len(ranked)) / left)
            typical = sorted(evaluations)[len(evaluations) // 2] if evaluations else FIRST_EVALUATION_S
            if slice_end - now < typical:
                slice_end = None  # not even one evaluation fits: leave the shape on the library
        if deadline is None or slice_end is not None:
            progress.describe(f"autotune: {shape.key.split(':', 1)[1]}")
            transfer = _transfer(shape, results, ranked[:rank - 1]) if strategy == "model_based" else {}
            if strategy == "model_based" and engines is not None:
                transfer["batch"] = PARALLEL_BATCH
            strategy_opts = {**transfer, **user_opts}
            results[shape] = tune_conv2d(shape, "cpu", mode, engines, strategy=strategy, options=strategy_opts,
                                         cache=cache, deadline=slice_end,
                                         on_result=functools.partial(on_result, shape=shape), **options)
        evaluated = sum(1 for m in results[shape].measurements
                        if registry()[m.config.candidate].kind != "library" and m.status != "missing")
        status = "tuned" if evaluated or deadline is None else "skipped: budget"
        if not evaluated and deadline is not None:
            skipped.extend(names[shape])
        default_ms, tuned_ms = _default_ms(results[shape]), _tuned_ms(results[shape])
        speedup = default_ms / tuned_ms if default_ms and tuned_ms else None
        row = {"rank": rank, "layers": len(names[shape]), "names": ", ".join(names[shape]),
               "shape": shape.key.split(":", 1)[1], "share": weight[shape] / step_ms if step_ms else 0.0,
               "default_ms": default_ms or math.nan, "tuned_ms": tuned_ms or math.nan, "speedup": speedup,
               "evaluated": evaluated, "measured_now": taken.get(shape, 0), "status": status}
        rows.append(row)
        progress.layer_done(len(names[shape]), speedup, row)
    seconds = {"profile": profile_s, **seconds, "search": time.perf_counter() - search_started}
    measured = sum(taken.values())
    return LayerTuning(results, rows, seconds, skipped, step_ms, measured)


def _transfer(shape: ConvShape, results: Mapping[ConvShape, TuneResult], done: Sequence[ConvShape]) -> dict[str, Any]:
    """``priors`` and ``history`` for the model-based strategy from shapes of the same kernel and stride tuned before."""
    similar = [s for s in done if (s.r, s.s, s.stride) == (shape.r, shape.s, shape.stride)]
    priors = [c for s in similar for c in _winners(results[s])]
    history = []
    for s in similar:
        library = [m.median for m in results[s].measurements
                   if m.ok and m.median and registry()[m.config.candidate].kind == "library"]
        if library:
            history += [(m.config, m.median / min(library)) for m in results[s].measurements
                        if m.status in ("ok", "slow") and m.median and registry()[m.config.candidate].kind != "library"]
    return {"priors": list(dict.fromkeys(priors)), "history": history}
