"""Tuning one convolution: :func:`tune_conv2d` -> :class:`TuneResult`.

Candidates (library variants and generated kernels) each contribute their pruned
parameter space; a strategy picks what to measure; a runner (sequential, or parallel
across a cluster's engines) measures it through the cache; the fastest valid
configuration wins.

Example
-------
>>> from rapydli.autotune import ConvShape, tune_conv2d
>>> result = tune_conv2d(ConvShape(4, 16, 14, 14, 32, 3, 3, pad=1), mode="inference")  # doctest: +SKIP
>>> result.best.config  # doctest: +SKIP
Config(candidate='torch_channels_last', params=())
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from rapydli.autotune import cbuild, strategies
from rapydli.autotune.cache import Cache, CachedRunner
from rapydli.autotune.candidates import PASSES, registry
from rapydli.autotune.device import DeviceInfo, query
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.runner import (
    TIMING,
    Measurement,
    ParallelRunner,
    Runner,
    SequentialRunner,
)
from rapydli.autotune.search import Config, Problem, SearchSpace
from rapydli.errors import ConfigError, RapydliError, RapydliWarning

__all__ = [
    "BudgetSpent",
    "ConvShape",
    "Split",
    "TuneResult",
    "build_space",
    "cache_fingerprint",
    "pick_best",
    "tune_conv2d",
]


class BudgetSpent(RapydliError):
    """:func:`tune_conv2d` measured nothing: its ``deadline`` or ``admit`` left every candidate ``"missing"``."""


@dataclass
class TuneResult:
    """The outcome of tuning one convolution.

    Attributes
    ----------
    best
        The winning measurement (``best.config`` is the candidate and its parameters).
    table
        Every measured configuration (see :func:`rapydli.autotune.analysis.table`).
    measurements
        The raw measurements, in the order measured.
    space
        The search space (with per-candidate counts: total, after hard, after soft).
    measured
        Configurations actually measured (0 when everything came from the cache).
    seconds
        Wall time of the tuning.
    """

    problem: Problem
    best: Measurement
    table: pd.DataFrame
    measurements: list[Measurement]
    space: SearchSpace
    device: DeviceInfo
    measured: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def best_verdict(self) -> str:
        """Whether :attr:`best` is measurably the fastest: one line naming it and its timed range.

        It is claimed the fastest only when its slowest timed run is faster than the runner-up's
        fastest (a valid configuration of another name); otherwise the line says the two
        overlap, so no difference is measurable on this machine. Measurements without
        their timed runs (one abandoned run) count as that one time.
        """
        ranked = sorted((m for m in self.measurements if m.ok and m.median is not None), key=lambda m: m.median)  # type: ignore[arg-type, return-value]
        best = ranked[0] if ranked else self.best
        span = _timed_span(best)
        text = f"{best.config} {_ms(best.median)} (timed {_ms(span[0])} to {_ms(span[1])})"
        if len(ranked) < 2:
            return f"best: {text}, the only configuration timed"
        runner_up = ranked[1]
        other = _timed_span(runner_up)
        if span[1] < other[0]:
            return f"best: {text}, faster in every timed run than the runner-up {runner_up.config} ({_ms(other[0])} to {_ms(other[1])})"
        return (
            f"fastest median: {text}; its timed runs overlap the runner-up {runner_up.config}'s "
            f"({_ms(other[0])} to {_ms(other[1])}): no difference measurable between them on this machine"
        )

    def best_of(self, predicate: Callable[[Config], bool]) -> Measurement | None:
        """The fastest valid measurement whose config satisfies ``predicate``."""
        return pick_best([m for m in self.measurements if predicate(m.config)])

    def best_split(self, predicate: Callable[[Config], bool]) -> Split | None:
        """The fastest configuration of each pass among those satisfying ``predicate``.

        In train mode a layer may run its forward, data gradient and weight gradient on
        different configurations (of one memory layout: pass it in ``predicate``); its time
        is the sum of the best pass times. Measurements without per-pass times (a cache
        from before they were kept) count as whole runs.
        """
        names = PASSES if self.problem.mode == "train" else PASSES[:1]
        timed = [m for m in self.measurements if m.ok and predicate(m.config) and all(p in m.passes for p in names)]
        if not timed:
            best = self.best_of(predicate)
            return None if best is None or best.median is None else Split({p: best for p in names}, best.median)
        chosen = {p: min(timed, key=lambda m: m.passes[p]) for p in names}  # ties: the earlier one
        return Split(chosen, sum(chosen[p].passes[p] for p in names))


@dataclass(frozen=True)
class Split:
    """The measurement chosen for each pass of a layer, and the layer's time (seconds)."""

    passes: dict[str, Measurement]
    seconds: float

    def config(self, name: str) -> Config:
        """The configuration running pass ``name`` (the forward's in inference mode)."""
        return self.passes.get(name, self.passes["forward"]).config


def _timed_span(m: Measurement) -> tuple[float, float]:
    """The fastest and slowest timed run of ``m`` (its median alone when no runs were kept)."""
    times = m.times or [m.median or 0.0]
    return min(times), max(times)


def _ms(seconds: float | None) -> str:
    return "?" if seconds is None else f"{seconds * 1e3:.3g} ms"


def pick_best(measurements: Sequence[Measurement]) -> Measurement | None:
    """Fastest valid measurement; ties go to the earlier one (deterministic)."""
    valid = [(m.median, i, m) for i, m in enumerate(measurements) if m.ok and m.median is not None]
    return min(valid, key=lambda t: (t[0], t[1]))[2] if valid else None


def build_space(
    problem: Problem,
    device: DeviceInfo,
    candidates: Sequence[str] | None = None,
    preset: str = "default",
    constraints: Mapping[str, Sequence[Callable[..., bool]]] | None = None,
) -> SearchSpace:
    """Every candidate's pruned configurations for ``problem`` on ``device``.

    Candidates that cannot run (no compiler, wrong device, a shape they do not compute, no
    backward in train mode) are listed in ``skipped`` with the reason; a missing compiler
    also warns.
    """
    known = registry()
    names = list(candidates) if candidates is not None else list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ConfigError(f"candidates: unknown {unknown}; known: {sorted(known)}")
    space = SearchSpace(problem, [])
    for name in names:
        cand = known[name]
        reason = cand.unavailable(device) or cand.unsuited(problem.shape)
        if reason is None and problem.mode == "train" and not cand.has_backward:
            reason = f"{name} has no backward kernels yet: offered for inference only"
        if reason is not None:
            space.skipped[name] = reason
            if cand.kind == "generated" and "compiler" in reason:
                warnings.warn(reason, RapydliWarning, stacklevel=3)
            continue
        sub = cand.space(problem.shape, device, preset)
        for predicate in (constraints or {}).get(name, ()):
            sub.soft(predicate, "user constraint")
        space.counts[name] = sub.counts()
        configs = [Config.of(name, p) for p in sub.configs()]
        (space.always if cand.kind == "library" else space.configs).extend(configs)
    return space


def cache_fingerprint(info: DeviceInfo) -> str:
    """The cache key of a device: its fingerprint, the kernel templates and the timing method.

    An edited kernel, another machine or another way of timing is measured again.
    """
    return f"{info.fingerprint()}-k{cbuild.templates_digest()}-{TIMING}"


def tune_conv2d(
    shape: ConvShape,
    device: str = "cpu",
    mode: str = "train",
    engines: Any = None,
    *,
    strategy: str = "exhaustive",
    options: Mapping[str, Any] | None = None,
    candidates: Sequence[str] | None = None,
    preset: str = "default",
    constraints: Mapping[str, Sequence[Callable[..., bool]]] | None = None,
    cache: Cache | bool = True,
    runner: Runner | None = None,
    repetitions: int = 5,
    warmup: int = 1,
    threads: int | None = None,
    deadline: float | None = None,
    on_result: Callable[[Measurement], None] | None = None,
    admit: Callable[[Sequence[Config]], bool] | None = None,
) -> TuneResult:
    """Tune one convolution and return the fastest valid configuration.

    Parameters
    ----------
    shape
        The convolution (:class:`ConvShape`).
    device
        ``"cpu"`` or ``"cuda"``.
    mode
        ``"train"``: time forward + data gradient + weight gradient; ``"inference"``: forward.
    engines
        A cluster (``rapydli.cluster.Cluster`` or anything with ``.view(targets=)``): measure in
        parallel across its engines; None measures here.
    strategy, options
        A registered strategy (``"exhaustive"``, ``"random"`` or ``"model_based"``) and its
        options (``{"budget": 8, "seed": 0}`` for random; see
        :mod:`rapydli.autotune.strategies.model_based`).
    candidates
        Candidate names to consider (default: all registered).
    preset
        Domain preset of generated kernels (``"tiny"``, ``"small"``, ``"default"``, ``"full"``).
    constraints
        Extra soft constraints per candidate name: predicates over its parameters.
    cache
        True (the default cache under ``$RAPYDLI_HOME``), a :class:`Cache`, or False.
    runner
        Use this runner instead of the sequential/parallel one (a ``SimulationRunner`` in tests).
    repetitions, warmup
        Timed and untimed runs per configuration.
    threads
        Threads of each timed run (default: this process's torch thread count, the one a
        tuned model runs with here). With ``engines``, each timing engine is pinned to its
        own ``threads`` cores and a machine times only as many configurations at once as
        its cores hold, so the result does not depend on the number of engines; building
        and validating (compiles included) divide over all engines. Part of the cache key.
    deadline
        A ``time.monotonic()`` value after which nothing new is measured (what was not is
        ``"missing"``; the cache still answers). Needs a cache: every measurement is stored
        as soon as it is taken (one configuration at a time here, a few per engine with
        ``engines``), so an interrupted tuning resumes where it stopped.
    on_result
        Called with every measurement taken (not those read from the cache).
    admit
        Called before each configuration (a chunk of them per engine with ``engines``) is
        measured: it is only when this returns True, otherwise it and the rest are
        ``"missing"`` as past a ``deadline`` (a budget that expects it to end too late).
        Needs a cache, as ``deadline`` does.

    Returns
    -------
    TuneResult
    """
    from rapydli.autotune.analysis import table

    if not isinstance(shape, ConvShape):
        raise ConfigError(f"shape must be a ConvShape, got {type(shape).__name__}")
    started = time.perf_counter()
    if device == "cpu":
        import torch

        threads = threads or torch.get_num_threads()
    info = query(device, threads)
    problem = Problem(shape, mode, device, warmup=warmup, repetitions=repetitions, threads=threads)
    space = build_space(problem, info, candidates, preset, constraints)
    if runner is None:
        runner = SequentialRunner() if engines is None else ParallelRunner(engines)
    counted: Runner = runner
    if cache is not False:
        chunk = 1 if isinstance(runner, SequentialRunner) else 4
        counted = CachedRunner(
            runner, Cache() if cache is True else cache, cache_fingerprint(info), chunk, deadline, on_result, admit
        )
    elif deadline is not None or on_result is not None or admit is not None:
        raise ConfigError("deadline, admit and on_result need the cache (cache=True or a Cache), not cache=False")
    measurements = strategies.get(strategy)(space, counted, options)
    best = pick_best(measurements)
    if best is None and all(m.status == "missing" for m in measurements):
        raise BudgetSpent(f"nothing was measured for {shape}: the tuning budget was spent before its first candidate")
    if best is None:
        raise RapydliError(
            f"no candidate produced a valid result for {shape}: "
            + "; ".join(f"{m.config}: {m.status} {m.message[:200]}" for m in measurements)
        )
    measured = counted.measured if isinstance(counted, CachedRunner) else len(measurements)
    return TuneResult(
        problem,
        best,
        table(problem, measurements, info),
        measurements,
        space,
        info,
        measured=measured,
        seconds=time.perf_counter() - started,
    )
