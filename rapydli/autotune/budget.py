"""Tuning a model's convolution shapes within a time budget, the costliest first.

1. **Profile.** The model's step is timed (the fastest of a few, after a warm-up step), which sizes the
   whole-model check: its time is reserved from the budget up front (see
   :func:`check_estimate_s`). Then the library default (``F.conv2d`` NCHW) of every unique
   shape is measured (no compiles); each shape's share is its layers' default time over the
   step.
2. **Rank and search.** Shapes are tuned in order of that time (count x default time).
   With a budget, each shape gets the remaining search time in proportion to its weight
   among the shapes still to tune (time a shape leaves unused flows to the next), and a
   shape whose slice is shorter than a typical evaluation is skipped. The default strategy
   is then ``model_based``, seeded with the winners and measurements of the shapes tuned
   before (same kernel size, stride, dilation and grouping).
3. Every measurement goes to the cache as it is taken: an interrupted tuning resumes
   where it stopped, and identical shapes are tuned once.

**The budget bounds the whole call.** No measurement starts unless the longest one of its
kind so far (library variant or generated kernel; a first guess before any) would end before
the search's deadline, the budget less the check's reserve; no shape starts its profile past
it either (shapes not profiled stay as they are). The check times its plans in rounds and
starts none it does not expect to end within the budget, and a plan that keeps every layer on
the library default is not checked at all (it is the untuned model). What can still pass the
budget: the profile's first two model steps when they alone are longer, and a measurement longer
than every one of its kind before it (a slow compile), by that excess; :data:`OVERRUN_S`
states what the tests allow for it on a shared 2-core machine.
"""

from __future__ import annotations

import copy
import functools
import math
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from rapydli.autotune.cache import Cache
from rapydli.autotune.candidates import registry
from rapydli.autotune.check import CHECK_SLOWER, model_step_ms
from rapydli.autotune.conv import BudgetSpent, TuneResult, cache_fingerprint, tune_conv2d
from rapydli.autotune.device import query
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.progress import TuningProgress
from rapydli.autotune.runner import PHASES, Measurement
from rapydli.autotune.search import Config, Problem
from rapydli.errors import ConfigError

DEFAULT = "torch_nchw"  # what an untuned nn.Conv2d runs
CHECK_PLANS = 6  # whole-model plans the check may time (planned, 2 library, whole, 2 margins)
CHECK_ROUNDS = 3  # rounds reserved for the check (one warm-up, two timed; it takes more while time is left)
PARALLEL_BATCH = 4  # configurations the model-based search hands a cluster at once (the cache's chunk)
PROFILE_STEPS = 3  # timed steps of the untuned model (the fastest counts)
FIRST_EVALUATION_S = 2.0  # the longest a generated evaluation (a compile) is assumed to take before any was seen
OVERRUN_S = 5.0  # what a budgeted tuning may pass its budget by here (a slow compile; see the module docstring)


@dataclass
class LayerTuning:
    """What :func:`tune_layers` measured.

    Attributes
    ----------
    results
        Shape -> :class:`TuneResult` (library variants only for a shape the budget skipped;
        absent for a shape the budget left unprofiled).
    rows
        One dict per unique shape, in rank order: ``rank``, ``layers`` (count), ``names``,
        ``shape``, ``share`` (of the model step), ``default_ms`` and ``tuned_ms`` (per layer),
        ``speedup`` (only where the range of the repetitions supports it: ``speedup_low``
        and ``speedup_high`` both above or both below 1, or the tuned choice is the default
        itself; else None), ``speedup_low``/``speedup_high`` (the range the timed
        repetitions allow), ``evaluated`` (generated configurations measured now), ``cached``
        (read from the cache), ``status`` (``"tuned"`` or ``"skipped: budget"``) and ``flag``
        (a share of the step above 1, which is impossible: the layer was timed slower than
        the whole step, a measurement disturbed by other work; the ``share`` is then NaN;
        or a timing still disturbed after being taken again: the ``speedup`` is then None).
    seconds
        Wall seconds per phase: ``profile`` (the model step), ``compile``, ``validate``,
        ``time`` (the measurements' own phases, summed over engines), ``search`` (all of
        the measuring, wall).
    skipped
        Layer names whose shape the budget left on the library variants.
    step_ms
        The untuned model's step (forward, + backward in train mode).
    measured
        Generated configurations measured (not read from the cache).
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
    return CHECK_PLANS * CHECK_ROUNDS * step_ms * CHECK_SLOWER / 1e3 + profile_s


class Expected:
    """Seconds one measurement is expected to take, by kind (``"library"``, ``"generated"``), from those seen.

    Before any was seen, :meth:`typical` is 0 (a shape's slice is not refused on a guess) and
    :meth:`longest` the first guess given (the budget's deadline is kept on one).

    Example
    -------
    >>> e = Expected({"library": 0.2, "generated": 2.0})
    >>> e.typical("generated"), e.longest("generated")
    (0.0, 2.0)
    >>> e.add("generated", 1.0); e.add("generated", 3.0); e.add("generated", 1.5)
    >>> e.typical("generated"), e.longest("generated"), e.longest("library")
    (1.5, 3.0, 0.2)
    """

    def __init__(self, first: Mapping[str, float]) -> None:
        self.first = dict(first)
        self.seen: dict[str, list[float]] = {kind: [] for kind in first}

    def add(self, kind: str, seconds: float) -> None:
        """Record one measurement of ``kind`` that took ``seconds``."""
        self.seen[kind].append(seconds)

    def typical(self, kind: str) -> float:
        """The median of those seen (0 before any)."""
        seen = sorted(self.seen[kind])
        return seen[len(seen) // 2] if seen else 0.0

    def longest(self, kind: str) -> float:
        """The longest seen (the first guess before any)."""
        return max(self.seen[kind], default=self.first[kind])


def _kind(config: Config) -> str:
    return "library" if registry()[config.candidate].kind == "library" else "generated"


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


def tune_layers(
    model: nn.Module,
    example_input: torch.Tensor,
    found: Sequence[tuple[str, ConvShape]],
    mode: str,
    engines: Any,
    budget_s: float | None,
    started: float,
    progress: TuningProgress,
    **tune_options: Any,
) -> LayerTuning:
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
        elif cache is True:
            cache = Cache()
        return _tune_layers(model, example_input, found, mode, engines, budget_s, started, progress, cache, options)


def _tune_layers(
    model: nn.Module,
    x: torch.Tensor,
    found: Sequence[tuple[str, ConvShape]],
    mode: str,
    engines: Any,
    budget_s: float | None,
    started: float,
    progress: TuningProgress,
    cache: Cache,
    options: dict[str, Any],
) -> LayerTuning:
    names: dict[ConvShape, list[str]] = {}
    for name, shape in found:
        names.setdefault(shape, []).append(name)
    seconds = {phase: 0.0 for phase in PHASES}
    taken: dict[ConvShape, int] = {}

    # 1. profile: the model's step (it sizes the check's reserve), then the library default of every shape
    progress.describe("autotune: profiling")
    t0 = time.perf_counter()
    # one warm-up step, then the fastest of up to three (a shared machine stalls a step now and then), those
    # after the first within a tenth of the budget
    step_ms = model_step_ms(
        copy.deepcopy(model),
        x,
        mode,
        reps=PROFILE_STEPS,
        deadline=None if budget_s is None else started + budget_s / 10,
    )
    profile_s = time.perf_counter() - t0
    repetitions = int(options.get("repetitions", 5)) + int(options.get("warmup", 1))
    expected = Expected({"library": repetitions * step_ms / 1e3, "generated": FIRST_EVALUATION_S})

    def on_result(m: Measurement, shape: ConvShape | None = None) -> None:
        for phase, s in m.seconds.items():
            seconds[phase] = seconds.get(phase, 0.0) + s
        expected.add(_kind(m.config), sum(m.seconds.values()))
        if shape is not None and _kind(m.config) == "generated":
            taken[shape] = taken.get(shape, 0) + 1
        progress.measured(m.status)

    deadline = None if budget_s is None else started + budget_s - check_estimate_s(step_ms, profile_s)

    def admit(slice_end: float | None) -> Callable[[Sequence[Config]], bool]:
        """A chunk starts when a typical one ends within ``slice_end`` and the longest one before the deadline."""

        def fits(chunk: Sequence[Config]) -> bool:
            if deadline is None:
                return True
            now, kinds = time.monotonic(), {_kind(c) for c in chunk}  # a cluster measures a chunk side by side
            typical_end = now + max(expected.typical(k) for k in kinds)
            return typical_end <= (slice_end or deadline) and now + max(expected.longest(k) for k in kinds) <= deadline

        return fits

    common = {k: v for k, v in options.items() if k in ("repetitions", "warmup", "threads", "preset")}
    threads = options.get("threads") or torch.get_num_threads()
    device = "cuda" if x.is_cuda else "cpu"  # layers are tuned where the example input (and the model) live
    fingerprint = cache_fingerprint(query(device, threads))
    search_started = time.perf_counter()
    results: dict[ConvShape, TuneResult] = {}
    for shape in names:
        stored = cache.get(fingerprint, Problem(shape, mode).key, Config.of(DEFAULT))
        if stored is None and not admit(None)([Config.of(DEFAULT)]):
            break  # the budget holds no more profiles: the shapes left stay as they are
        results[shape] = tune_conv2d(
            shape,
            device,
            mode,
            engines,
            strategy="exhaustive",
            candidates=[DEFAULT],
            cache=cache,
            on_result=on_result,
            **common,
        )
    weight = {shape: len(names[shape]) * (_default_ms(r) or 0.0) for shape, r in results.items()}
    ranked = sorted(results, key=lambda s: -weight[s])

    # 2. search, costliest shape first
    strategy = options.pop("strategy", "model_based" if budget_s is not None else "exhaustive")
    user_opts = dict(options.pop("options", None) or {})
    rows, skipped = [], []
    for rank, shape in enumerate(ranked, start=1):
        slice_end = None
        if deadline is not None:
            now = time.monotonic()
            left = sum(weight[s] for s in ranked[rank - 1 :]) or 1.0
            slice_end = min(deadline, now + (deadline - now) * (weight[shape] or 1.0 / len(ranked)) / left)
            if slice_end - now < expected.typical("generated"):
                slice_end = None  # not even one evaluation fits: leave the shape on the library
        if deadline is None or slice_end is not None:
            progress.describe(f"autotune: {shape.text}")
            transfer = _transfer(shape, results, ranked[: rank - 1]) if strategy == "model_based" else {}
            if strategy == "model_based" and engines is not None:
                transfer["batch"] = PARALLEL_BATCH
            strategy_opts = {**transfer, **user_opts}
            try:
                results[shape] = tune_conv2d(
                    shape,
                    device,
                    mode,
                    engines,
                    strategy=strategy,
                    options=strategy_opts,
                    cache=cache,
                    admit=admit(slice_end),
                    on_result=functools.partial(on_result, shape=shape),
                    **options,
                )
            except (
                BudgetSpent
            ):  # a busy machine ran the earlier slices late: the shape keeps its profile, on the library
                slice_end = None
        rows.append(
            _row(
                rank,
                shape,
                names[shape],
                results[shape],
                weight[shape],
                step_ms,
                taken.get(shape, 0),
                budgeted=deadline is not None,
                attempted=deadline is None or slice_end is not None,
            )
        )
        if rows[-1]["status"] != "tuned":
            skipped.extend(names[shape])
        progress.layer_done(len(names[shape]), rows[-1]["speedup"], rows[-1])
    for rank, shape in enumerate((s for s in names if s not in results), start=len(ranked) + 1):
        rows.append(
            {
                "rank": rank,
                "layers": len(names[shape]),
                "names": ", ".join(names[shape]),
                "shape": shape.text,
                "share": math.nan,
                "default_ms": math.nan,
                "tuned_ms": math.nan,
                "speedup": None,
                "speedup_low": math.nan,
                "speedup_high": math.nan,
                "evaluated": 0,
                "measured_now": 0,
                "status": "skipped: budget",
                "flag": "",
            }  # every column a tuned shape's row has: a table of skipped shapes only reads like any other
        )
        skipped.extend(names[shape])
        progress.layer_done(len(names[shape]), None, rows[-1])
    seconds = {"profile": profile_s, **seconds, "search": time.perf_counter() - search_started}
    return LayerTuning(results, rows, seconds, skipped, step_ms, sum(taken.values()))


def _split_range(split: Any) -> tuple[float, float]:
    """``(low, high)`` ms of a layer's time: its median scaled by how far its measurements' timed
    repetitions ran from their medians (fastest and slowest)."""
    low = high = 1.0
    for m in split.passes.values():
        if m.median and m.times:
            low, high = min(low, min(m.times) / m.median), max(high, max(m.times) / m.median)
    return split.seconds * 1e3 * low, split.seconds * 1e3 * high


def _speedup(result: TuneResult) -> tuple[float | None, float, float]:
    """The tuned layer's speedup over the library default, when the repetitions' ranges support one
    (else None), and the range ``(low, high)`` they allow."""
    default, tuned = result.best_split(lambda c: c.candidate == DEFAULT), result.best_split(lambda c: True)
    if default is None or tuned is None or not default.seconds or not tuned.seconds:
        return None, math.nan, math.nan
    if {m.config for m in tuned.passes.values()} == {m.config for m in default.passes.values()}:
        return 1.0, 1.0, 1.0  # the default itself: no claim
    (d_low, d_high), (t_low, t_high) = _split_range(default), _split_range(tuned)
    low, high = d_low / t_high, d_high / t_low
    return (default.seconds / tuned.seconds if low > 1 or high < 1 else None), low, high


def _disturbed(result: TuneResult) -> list[str]:
    """How the measurements the default's and the tuned layer's times are made of were still disturbed
    by other work after being timed again (see :func:`~rapydli.autotune.runner.disturbance`)."""
    splits = [result.best_split(lambda c: c.candidate == DEFAULT), result.best_split(lambda c: True)]
    measured = {id(m): m for split in splits if split is not None for m in split.passes.values()}
    return [
        f"{m.config.candidate} ({m.disturbed}, timed {m.retimed + 1} times)" for m in measured.values() if m.disturbed
    ]


def _row(
    rank: int,
    shape: ConvShape,
    names: list[str],
    result: TuneResult,
    weight: float,
    step_ms: float,
    measured_now: int,
    budgeted: bool,
    attempted: bool = True,
) -> dict[str, Any]:
    """The table row of one tuned (or budget-skipped) shape (see :class:`LayerTuning`).

    With a budget, a shape is ``"skipped: budget"`` when no generated configuration was evaluated
    because its slice of the budget was too short (not ``attempted``) or the budget refused
    them (``"missing"``); one with no generated candidate to try (only the library's) was tuned.
    """
    from rapydli.spread import load_text, machine_load

    evaluated = sum(1 for m in result.measurements if _kind(m.config) == "generated" and m.status != "missing")
    refused = any(m.status == "missing" for m in result.measurements)
    default_ms, tuned_ms = _default_ms(result), _tuned_ms(result)
    share, flag = (weight / step_ms if step_ms else 0.0), ""
    if share > 1:  # the layers of this shape timed slower than the whole step they are part of
        flag = (
            f"share {share:.2f} > 1 is a measurement artefact: these layers were timed at {weight:.3g} ms, the whole step "
            f"at {step_ms:.3g} ms ({load_text(machine_load())}); tune on a quieter machine or with fewer threads"
        )
        share = math.nan
    speedup, low, high = _speedup(result)
    disturbed = _disturbed(result)
    if disturbed:  # timed again, and still disturbed by other work: no claim
        speedup = None
        flag = "; ".join(
            filter(
                None,
                [
                    flag,
                    (
                        f"other work disturbed the timing of {', '.join(disturbed)} "
                        f"({load_text(machine_load())}): no speedup is claimed; tune on a quieter "
                        "machine or with fewer threads"
                    ),
                ],
            )
        )
    return {
        "rank": rank,
        "layers": len(names),
        "names": ", ".join(names),
        "shape": shape.text,
        "share": share,
        "default_ms": default_ms or math.nan,
        "tuned_ms": tuned_ms or math.nan,
        "speedup": speedup,
        "speedup_low": low,
        "speedup_high": high,
        "evaluated": evaluated,
        "measured_now": measured_now,
        "status": "skipped: budget" if budgeted and not evaluated and (not attempted or refused) else "tuned",
        "flag": flag,
    }


def _transfer(shape: ConvShape, results: Mapping[ConvShape, TuneResult], done: Sequence[ConvShape]) -> dict[str, Any]:
    """``priors`` and ``history`` for the model-based strategy from shapes of the same kernel, stride and dilation,
    grouped or not as ``shape``, tuned before."""
    kind = (shape.r, shape.s, shape.stride, shape.dilation, shape.groups != 1)
    similar = [s for s in done if (s.r, s.s, s.stride, s.dilation, s.groups != 1) == kind]
    priors = [c for s in similar for c in _winners(results[s])]
    history = []
    for s in similar:
        library = [
            m.median
            for m in results[s].measurements
            if m.ok and m.median and registry()[m.config.candidate].kind == "library"
        ]
        if library:
            history += [
                (m.config, m.median / min(library))
                for m in results[s].measurements
                if m.status in ("ok", "slow") and m.median and registry()[m.config.candidate].kind != "library"
            ]
    return {"priors": list(dict.fromkeys(priors)), "history": history}
