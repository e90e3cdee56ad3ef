"""Runners: compile -> validate -> benchmark each configuration, here or across engines.

* :func:`measure` does one configuration: build the instance (compiling a generated
  kernel), validate it against ``F.conv2d`` in float64 on a small input (forward, and in
  train mode both gradients; a wrong result is rejected and never timed), then time it
  (warm-up, repetitions, median and variance kept).
* :class:`SequentialRunner` measures in this process.
* :class:`ParallelRunner` gives each engine of a cluster a slice of the configurations;
  each engine pins itself to its own cores (``os.sched_setaffinity``) so measurements do
  not disturb each other. Results come back in configuration order, so the outcome does
  not depend on how many engines measured.
* :class:`SimulationRunner` replays recorded measurements (from the cache or a table), so
  strategies and runners are tested without hardware.
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from rapydli.autotune.search import Config, Problem
from rapydli.errors import ConfigError, RankFailure

STATUSES = ("ok", "invalid", "error", "missing")


@dataclass
class Measurement:
    """The outcome of one configuration on one problem.

    ``status`` is ``"ok"`` (validated and timed), ``"invalid"`` (wrong result: never
    timed), ``"error"`` (failed to build or run) or ``"missing"`` (simulation had no record).
    """

    config: Config
    status: str
    median: float | None = None
    variance: float | None = None
    times: list[float] = field(default_factory=list)
    error: float | None = None
    message: str = ""
    engine: int = 0
    cached: bool = False

    @property
    def ok(self) -> bool:
        """True when the configuration was validated and timed."""
        return self.status == "ok"


Measurer = Callable[[Problem, Config], Measurement]


def _relative_error(got: Any, ref: Any) -> float:
    ref = ref.detach().double()
    got = got.detach()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def validate(problem: Problem, inst: Any) -> float:
    """Largest relative error of ``inst`` against float64 ``F.conv2d`` on a small input."""
    import torch
    import torch.nn.functional as F

    shape = problem.shape.validation_shape()
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(shape.n, shape.c, shape.h, shape.w, generator=gen, dtype=torch.float64)
    w = torch.randn(shape.k, shape.c, shape.r, shape.s, generator=gen, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.conv2d(xr, wr, None, shape.stride, shape.pad)
    x32, w32 = inst.to_layout(x.float()), inst.to_layout(w.float())
    errors = [_relative_error(inst.forward(x32, w32), ref)]
    if problem.mode == "train":
        gy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        ref.backward(gy)
        gx, gw = inst.backward(x32, w32, inst.to_layout(gy.float()))
        errors += [_relative_error(gx, xr.grad), _relative_error(gw, wr.grad)]
    return max(errors)


def _timed(problem: Problem, inst: Any) -> list[float]:
    import torch

    s = problem.shape
    gen = torch.Generator().manual_seed(0)
    x = inst.to_layout(torch.randn(s.n, s.c, s.h, s.w, generator=gen))
    w = inst.to_layout(torch.randn(s.k, s.c, s.r, s.s, generator=gen))
    gy = inst.to_layout(torch.randn(s.n, s.k, *s.out_hw, generator=gen))
    sync = torch.cuda.synchronize if problem.device.startswith("cuda") else (lambda: None)

    def step() -> None:
        inst.forward(x, w)
        if problem.mode == "train":
            inst.backward(x, w, gy)

    with torch.no_grad():
        for _ in range(problem.warmup):
            step()
        sync()
        times: list[float] = []
        while len(times) < problem.repetitions:
            start = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - start)
            if len(times) >= 3 and sum(times) > problem.time_budget:
                break
    return times


def measure(problem: Problem, config: Config) -> Measurement:
    """Build, validate and (when valid) time one configuration; never raises for a bad kernel."""
    from rapydli.autotune.candidates import get

    try:
        inst = get(config.candidate).instance(problem.shape, config.param_dict)
        error = validate(problem, inst)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run is a result, not a crash
        return Measurement(config, "error", message=f"{type(exc).__name__}: {exc}"[-2000:])
    if not error <= problem.tolerance:  # also catches NaN
        return Measurement(config, "invalid", error=error, message=f"relative error {error:.3g} > {problem.tolerance}")
    try:
        times = _timed(problem, inst)
    except Exception:  # noqa: BLE001 - reported with its traceback
        return Measurement(config, "error", error=error, message=traceback.format_exc()[-2000:])
    return Measurement(
        config, "ok", median=statistics.median(times),
        variance=statistics.pvariance(times) if len(times) > 1 else 0.0, times=times, error=error,
    )


class Replay:
    """A measurer that replays recorded measurements (picklable, so engines can use it too)."""

    def __init__(self, records: Mapping[tuple[str, Config], Measurement]) -> None:
        self.records = dict(records)

    def __call__(self, problem: Problem, config: Config) -> Measurement:
        found = self.records.get((problem.key, config))
        if found is None:
            return Measurement(config, "missing", message="no recorded measurement")
        return replace(found, cached=False)


class Runner:
    """Measures configurations of a problem; subclasses decide where."""

    def run(self, problem: Problem, configs: Sequence[Config]) -> list[Measurement]:
        """One measurement per configuration, in the order given."""
        raise NotImplementedError


class SequentialRunner(Runner):
    """Measure in this process, one configuration after the other."""

    def __init__(self, measurer: Measurer = measure, on_result: Callable[[Measurement], None] | None = None) -> None:
        self.measurer = measurer
        self.on_result = on_result

    def run(self, problem: Problem, configs: Sequence[Config]) -> list[Measurement]:
        results = []
        for config in configs:
            result = self.measurer(problem, config)
            if self.on_result:
                self.on_result(result)
            results.append(result)
        return results


class SimulationRunner(SequentialRunner):
    """Replay recorded measurements: from a :class:`~rapydli.autotune.cache.Cache` or a list.

    Parameters
    ----------
    records
        A ``Cache`` (with ``fingerprint``) or an iterable of ``(problem_key, Measurement)``.
    fingerprint
        The device whose cached measurements to replay (with a ``Cache``).
    """

    def __init__(self, records: Any, fingerprint: str | None = None) -> None:
        if hasattr(records, "records"):
            if fingerprint is None:
                raise ConfigError("SimulationRunner(cache, fingerprint=...) needs the device fingerprint to replay")
            pairs = records.records(fingerprint)
        else:
            pairs = list(records)
        super().__init__(Replay({(key, m.config): m for key, m in pairs}))


def _slot_cores(slot: int, slots: int) -> set[int]:
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // slots)
    start = (slot * per) % len(cores)
    return set(cores[start:start + per])


def measure_slice(problem: Problem, configs: Sequence[Config], slot: int, slots: int,
                  measurer: Measurer = measure) -> list[Measurement]:
    """Engine side of :class:`ParallelRunner`: pin to this slot's cores, measure, restore."""
    import torch

    previous = os.sched_getaffinity(0)
    threads = torch.get_num_threads()
    cores = _slot_cores(slot, slots)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    try:
        return [replace(measurer(problem, c), engine=slot) for c in configs]
    finally:
        os.sched_setaffinity(0, previous)
        torch.set_num_threads(threads)


def _slot_views(engines: Any) -> list[Any]:
    """One DirectView per engine: ranks of a rapydli Cluster, or engine ids of an ipyparallel Client."""
    if hasattr(engines, "view"):
        count = len(engines.view(targets=None).targets)
        return [engines.view(targets=[rank]) for rank in range(count)]
    if hasattr(engines, "direct_view") and hasattr(engines, "ids"):  # an ipyparallel Client
        return [engines.direct_view([engine]) for engine in sorted(engines.ids)]
    raise ConfigError("engines must be a rapydli Cluster (with .view(targets=)) or an ipyparallel Client")


class ParallelRunner(Runner):
    """Spread configurations over a cluster's engines; each measures a slice, pinned to its cores.

    Parameters
    ----------
    engines
        A :class:`rapydli.cluster.Cluster` (anything with ``.view(targets=None)`` returning an
        ipyparallel ``DirectView``) or an ``ipyparallel.Client``.
    measurer
        What each engine runs per configuration (:func:`measure`, or a :class:`Replay`).
    timeout
        Seconds to wait for all engines before raising :class:`RankFailure`.
    """

    def __init__(self, engines: Any, measurer: Measurer = measure, timeout: float | None = None) -> None:
        self.engines = engines
        self.measurer = measurer
        self.timeout = timeout

    def run(self, problem: Problem, configs: Sequence[Config]) -> list[Measurement]:
        configs = list(configs)
        views = _slot_views(self.engines)
        slots = len(views)
        pending = {}
        for slot, view in enumerate(views):
            part = configs[slot::slots]
            if part:
                pending[slot] = (slot, view.apply_async(measure_slice, problem, part, slot, slots, self.measurer))
        results: dict[Config, Measurement] = {}
        failures: dict[int, str] = {}
        for slot, (target, handle) in pending.items():
            try:
                (part,) = handle.get(timeout=self.timeout)  # one engine per view -> one result
                for m in part:
                    results[m.config] = m
            except Exception as exc:  # noqa: BLE001 - collected per engine, raised once below
                failures[target] = f"{type(exc).__name__}: {exc}"
        if failures:
            detail = "; ".join(f"engine {k}: {v[:300]}" for k, v in sorted(failures.items()))
            raise RankFailure(f"autotune measurement failed on engine(s) {sorted(failures)}: {detail}", failures)
        return [results[c] for c in configs]
