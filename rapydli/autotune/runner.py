"""Runners: compile -> validate -> benchmark each configuration, here or across engines.

* :func:`measure` does one configuration: :func:`check` builds the instance (compiling a
  generated kernel) and validates it against ``F.conv2d`` in float64 on a small input
  (forward, and in train mode both gradients; a wrong result is rejected and never
  timed), then :func:`time_checked` times it (warm-up, repetitions, median and variance
  kept) with ``problem.threads`` threads, and times it again when other work disturbed
  the timing (:func:`disturbance`).
* :class:`SequentialRunner` measures in this process.
* :class:`ParallelRunner` spreads the work over a cluster's engines in two phases:
  every engine builds and validates configurations (one core each: compiling is
  single-threaded, so it divides), then the validated ones are timed, each timing engine
  pinned to its own ``problem.threads`` cores, with only as many engines per machine
  timing at once as its cores hold. Every timing uses the same thread count on cores
  nothing else runs on, and results come back in configuration order, so the outcome
  does not depend on how many engines measured.
* :class:`SimulationRunner` replays recorded measurements (from the cache or a table), so
  strategies and runners are tested without hardware.
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import socket
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any

from rapydli.autotune.search import Config, Problem
from rapydli.errors import ConfigError, RankFailure

STATUSES = ("ok", "invalid", "error", "missing", "validated", "slow")
PHASES = ("compile", "validate", "time")  # where a measurement's seconds went (Measurement.seconds)
TIMING = "cold64"  # how runs are timed (part of the cache key): each pass starts after a flush (see _flush_buffer)
FLUSH_MAX_BYTES = 64 << 20  # the largest flush: past the working set of the models tuned here


@dataclass
class Measurement:
    """The outcome of one configuration on one problem.

    ``status`` is ``"ok"`` (validated and timed), ``"invalid"`` (wrong result: never
    timed), ``"error"`` (failed to build or run), ``"missing"`` (simulation had no record)
    ``"validated"`` (passed :func:`check`, not timed yet: a runner's intermediate state)
    or ``"slow"`` (its first timed run was over ``problem.abandon_s``: abandoned, ``median``
    is that one run).
    ``times`` are whole runs (in train mode: forward + data gradient + weight gradient);
    ``passes`` holds the median seconds of each pass timed (``"forward"``, and in train mode
    ``"data_grad"`` and ``"weight_grad"``), so a layer can take each pass from another
    configuration. ``seconds`` holds the wall time spent on it per phase (see :data:`PHASES`;
    empty for a measurement read from the cache).
    ``retimed`` counts the times it was timed again because its timing looked disturbed by
    other work (see :func:`disturbance`); ``disturbed`` says how the timing kept is still
    disturbed after them ("" when it is not): such a timing supports no conclusion and is
    not cached.
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
    passes: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    retimed: int = 0
    disturbed: str = ""

    @property
    def ok(self) -> bool:
        """True when the configuration was validated and timed."""
        return self.status == "ok"


Measurer = Callable[[Problem, Config], Measurement]


def _relative_error(got: Any, ref: Any) -> float:
    ref = ref.detach().double()
    got = got.detach().cpu()
    return float((got.double() - ref).norm() / ref.norm().clamp_min(1e-30))


#: The relative error accepted on a GPU whose float32 convolutions or matrix products may run
#: in TF32 (inputs rounded to 11 significant bits, a relative 2^-11 = 4.9e-4 each; torch's
#: default for cuDNN convolutions), where ``Problem.tolerance`` (1e-4) would refuse the library itself.
TF32_TOLERANCE = 2e-3


def accepted_error(problem: Problem) -> float:
    """The largest relative error a configuration of ``problem`` may have to be ``"validated"``.

    ``problem.tolerance``; on a CUDA device where torch lets cuDNN or cuBLAS compute float32
    in TF32, at least :data:`TF32_TOLERANCE` (every candidate is held to what the library
    itself gives there).
    """
    import torch

    if problem.device.startswith("cuda") and (torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32):
        return max(problem.tolerance, TF32_TOLERANCE)
    return problem.tolerance


def validate(problem: Problem, inst: Any) -> float:
    """Largest relative error of ``inst`` on ``problem.device`` against float64 ``F.conv2d`` (on the CPU) on a small input."""
    import torch
    import torch.nn.functional as F

    shape = problem.shape.validation_shape()
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(shape.n, shape.c, shape.h, shape.w, generator=gen, dtype=torch.float64)
    w = torch.randn(shape.weight_shape, generator=gen, dtype=torch.float64)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = F.conv2d(xr, wr, None, shape.stride, shape.pad, shape.dilation, shape.groups)
    x32, w32 = inst.to_layout(x.float().to(problem.device)), inst.to_layout(w.float().to(problem.device))
    errors = [_relative_error(inst.forward(x32, w32), ref)]
    if problem.mode == "train":
        gy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
        ref.backward(gy)
        gy32 = inst.to_layout(gy.float().to(problem.device))
        errors += [
            _relative_error(inst.data_grad(x32, w32, gy32), xr.grad),
            _relative_error(inst.weight_grad(x32, w32, gy32), wr.grad),
        ]
    return max(errors)


@contextmanager
def pinned(cores: set[int] | None, threads: int | None) -> Iterator[None]:
    """Run the block on ``cores`` with ``threads`` torch threads (None leaves either as it is).

    Child processes (the C compiler) inherit the affinity; both are restored afterwards.
    """
    import torch

    previous_cores = os.sched_getaffinity(0)
    previous_threads = torch.get_num_threads()
    if cores is not None:
        os.sched_setaffinity(0, cores)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous_cores)
        torch.set_num_threads(previous_threads)


@cache
def _flush_buffer() -> Any:
    """A float32 tensor twice the size of the last-level cache, at most :data:`FLUSH_MAX_BYTES`.

    A larger one times passes as if from DRAM, which inside a model they are not: on this
    machine's VM (480 MiB of L3 reported) a 960 MiB flush cost 95 ms per pass and timed
    ResNet-18-shaped layers (batch 8, 32x32) 2-3x slower than they ran in the model, where a
    64 MiB flush (or 8 MiB) came within 10-30 % of it.
    """
    import torch

    from rapydli.autotune.device import cpu_info

    llc = max(cpu_info().caches.values(), default=32 << 20)
    return torch.zeros(min(2 * llc, FLUSH_MAX_BYTES) // 4)


def _timed(problem: Problem, inst: Any) -> dict[str, list[float]]:
    """Seconds of each pass (``forward``; in train mode also ``data_grad`` and ``weight_grad``) per run.

    On the CPU every timed pass starts with the caches flushed (a buffer twice the last
    level, at most :data:`FLUSH_MAX_BYTES`, is written): inside a model a layer's tensors
    come from farther than L2, after the other layers evicted them; timed hot, memory-bound
    passes (1x1 convolutions, weight gradients) looked up to 1.5x faster than they ran in
    the model.

    On a GPU one timed run is as many back-to-back calls as fill :data:`GPU_RUN_S` (after
    at least :data:`GPU_WARMUP` untimed ones: cuDNN's algorithm search, the clocks
    ramping up), divided by their number: a single call of a 0.1 ms kernel, timed between
    synchronizations, measures the launch and the synchronization as much as the kernel.
    """
    import torch

    s = problem.shape
    gen = torch.Generator().manual_seed(0)
    x = inst.to_layout(torch.randn(s.n, s.c, s.h, s.w, generator=gen).to(problem.device))
    w = inst.to_layout(torch.randn(s.weight_shape, generator=gen).to(problem.device))
    gy = inst.to_layout(torch.randn(s.n, s.k, *s.out_hw, generator=gen).to(problem.device))
    sync = torch.cuda.synchronize if problem.device.startswith("cuda") else (lambda: None)
    flush = None if problem.device.startswith("cuda") else _flush_buffer()
    passes: dict[str, Callable[[], Any]] = {"forward": lambda: inst.forward(x, w)}
    if problem.mode == "train":
        passes.update(data_grad=lambda: inst.data_grad(x, w, gy), weight_grad=lambda: inst.weight_grad(x, w, gy))

    gpu = problem.device.startswith("cuda")
    with torch.no_grad(), pinned(None, problem.threads):
        for _ in range(max(problem.warmup, GPU_WARMUP) if gpu else problem.warmup):
            for run in passes.values():
                run()
        sync()
        calls = {name: _calls_filling(run, sync) if gpu else 1 for name, run in passes.items()}
        times: dict[str, list[float]] = {name: [] for name in passes}
        while len(times["forward"]) < problem.repetitions:
            for name, run in passes.items():
                if flush is not None:
                    flush.add_(1.0)
                start = time.perf_counter()
                for _ in range(calls[name]):
                    run()
                sync()
                times[name].append((time.perf_counter() - start) / calls[name])
            if len(times["forward"]) == 1 and _abandoned(problem, times):
                break
            if len(times["forward"]) >= 3 and sum(map(sum, times.values())) > problem.time_budget:
                break
    return times


#: On a GPU: untimed calls before timing, and the least length of one timed run (seconds).
GPU_WARMUP, GPU_RUN_S, GPU_MAX_CALLS = 3, 2e-3, 200


def _calls_filling(run: Callable[[], Any], sync: Callable[[], Any]) -> int:
    """How many back-to-back calls of ``run`` take about :data:`GPU_RUN_S` (1 to :data:`GPU_MAX_CALLS`)."""
    start = time.perf_counter()
    run()
    sync()
    once = time.perf_counter() - start
    return max(1, min(GPU_MAX_CALLS, math.ceil(GPU_RUN_S / max(once, 1e-9))))


def _abandoned(problem: Problem, times: Mapping[str, list[float]]) -> bool:
    """Whether one timed run (all passes) already took longer than ``problem.abandon_s``."""
    return (
        problem.abandon_s is not None
        and problem.repetitions > 1
        and len(times["forward"]) == 1
        and sum(t[0] for t in times.values()) > problem.abandon_s
    )


def _instance(problem: Problem, config: Config) -> Any:
    from rapydli.autotune.candidates import get

    return get(config.candidate).instance(problem.shape, config.param_dict)


def check(problem: Problem, config: Config) -> Measurement:
    """Build (compile) and validate one configuration: ``"validated"``, ``"invalid"`` or ``"error"``.

    Nothing is timed; a kernel that fails to build or run is a result, never an exception.
    """
    seconds = {}
    started = time.perf_counter()
    try:
        inst = _instance(problem, config)
        seconds["compile"] = time.perf_counter() - started
        error = validate(problem, inst)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run is a result, not a crash
        seconds.setdefault("compile", time.perf_counter() - started)
        return Measurement(config, "error", message=f"{type(exc).__name__}: {exc}"[-2000:], seconds=seconds)
    seconds["validate"] = time.perf_counter() - started - seconds["compile"]
    tolerance = accepted_error(problem)
    if not error <= tolerance:  # also catches NaN
        return Measurement(
            config, "invalid", error=error, message=f"relative error {error:.3g} > {tolerance}", seconds=seconds
        )
    return Measurement(config, "validated", error=error, seconds=seconds)


def time_checked(problem: Problem, checked: Measurement) -> Measurement:
    """Time a ``"validated"`` measurement with ``problem.threads`` threads; other statuses pass through.

    A timing that looks disturbed by other work (:func:`disturbance`) is taken again, up to
    :data:`RETIMES` more times, and the first undisturbed one is kept; when every one is
    disturbed, the fastest is kept and ``disturbed`` says why.
    """
    if checked.status != "validated":
        return checked
    started = time.perf_counter()
    tries: list[tuple[dict[str, list[float]], str]] = []
    try:
        inst = _instance(problem, checked.config)
        while len(tries) <= RETIMES and (not tries or tries[-1][1]):
            per_pass = _timed(problem, inst)
            runs = [sum(run) for run in zip(*per_pass.values())]
            if len(runs) == 1 and _abandoned(problem, per_pass):
                tries.append((per_pass, ""))  # abandoned: slow whatever disturbed it
                break
            tries.append((per_pass, disturbance(problem, checked.config, runs)))
    except Exception:  # noqa: BLE001 - reported with its traceback
        return replace(checked, status="error", message=traceback.format_exc()[-2000:])
    per_pass, disturbed = (
        tries[-1]
        if not tries[-1][1]
        else min(tries, key=lambda t: statistics.median(sum(run) for run in zip(*t[0].values())))
    )
    seconds = {**checked.seconds, "time": time.perf_counter() - started}
    times = [sum(run) for run in zip(*per_pass.values())]
    common: dict[str, Any] = {"seconds": seconds, "times": times, "retimed": len(tries) - 1, "disturbed": disturbed}
    if len(times) == 1 and _abandoned(problem, per_pass):
        assert problem.abandon_s is not None  # _abandoned is False without a limit
        return replace(
            checked,
            status="slow",
            median=times[0],
            variance=0.0,
            **common,
            message=f"abandoned after one timed run: {times[0] * 1e3:.3g} ms > {problem.abandon_s * 1e3:.3g} ms",
            passes={name: t[0] for name, t in per_pass.items()},
        )
    return replace(
        checked,
        status="ok",
        median=statistics.median(times),
        **common,
        variance=statistics.pvariance(times) if len(times) > 1 else 0.0,
        passes={name: statistics.median(t) for name, t in per_pass.items()},
    )


#: Contention (another process took a core while a configuration was timed): a timing whose
#: slowest run took over CONTENDED_SPREAD times its fastest, or a library call over
#: ROOFLINE_FACTOR times the least time its arithmetic and memory traffic allow, is timed again,
#: up to RETIMES more times. The roofline's floor assumes the device's estimated peak, a
#: bandwidth of MEMORY_BYTES_PER_S per thread and CALL_OVERHEAD_S per pass (a tiny layer's
#: dispatch): library calls on this 2-core VM ran 4-9x their floor (a tiny layer, a grouped one,
#: AlexNet's first), and 84x with two threads spinning beside a CPU hog (notebook 06's layer).
CONTENDED_SPREAD, ROOFLINE_FACTOR, RETIMES = 1.5, 30.0, 2
MEMORY_BYTES_PER_S, CALL_OVERHEAD_S = 5e9, 50e-6


def roofline_s(problem: Problem, threads: int) -> float | None:
    """The least seconds one run of ``problem`` can take on this CPU with ``threads`` threads (None on a GPU
    or where the peak is unknown): its FLOPs at the estimated peak plus its tensors' bytes at
    :data:`MEMORY_BYTES_PER_S` per thread, plus :data:`CALL_OVERHEAD_S` per pass."""
    from rapydli.autotune.device import query

    if problem.device != "cpu":
        return None
    peak = query("cpu", threads).peak_gflops
    if not peak:
        return None
    s = problem.shape
    passes = 3 if problem.mode == "train" else 1
    flops = s.train_flops() if problem.mode == "train" else s.flops
    elements = s.n * s.c * s.h * s.w + math.prod(s.weight_shape) + s.n * s.k * math.prod(s.out_hw)
    return flops / (peak * 1e9) + passes * (4 * elements / (MEMORY_BYTES_PER_S * threads) + CALL_OVERHEAD_S)


def disturbance(problem: Problem, config: Config, runs: Sequence[float]) -> str:
    """How a timing's ``runs`` (seconds) look disturbed by other work, or "" when they do not.

    Unstable repeats (the slowest over :data:`CONTENDED_SPREAD` times the fastest), or a library
    call far above its roofline (:func:`roofline_s`; a generated kernel may be that slow on its own).
    """
    from rapydli.autotune.candidates import get

    if len(runs) >= 3 and min(runs) > 0 and max(runs) / min(runs) > CONTENDED_SPREAD:
        return f"its repeats span {min(runs) * 1e3:.3g} to {max(runs) * 1e3:.3g} ms"
    floor = (
        roofline_s(problem, problem.threads or _torch_threads()) if get(config.candidate).kind == "library" else None
    )
    median = statistics.median(runs) if runs else 0.0
    if floor and median > ROOFLINE_FACTOR * floor:
        return (
            f"{median * 1e3:.3g} ms is {median / floor:.0f}x the least its arithmetic and memory traffic allow "
            f"({floor * 1e3:.3g} ms)"
        )
    return ""


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def measure(problem: Problem, config: Config) -> Measurement:
    """Build, validate and (when valid) time one configuration; never raises for a bad kernel."""
    return time_checked(problem, check(problem, config))


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


def engine_place() -> tuple[str, list[int]]:
    """Engine side of :class:`ParallelRunner`: this engine's machine and the cores it may use."""
    return socket.gethostname(), sorted(os.sched_getaffinity(0))


def check_batch(
    problem: Problem, configs: Sequence[Config], core: int, engine: int, measurer: Measurer = check
) -> list[Measurement]:
    """Engine side, phase 1: build and validate ``configs`` on one core with one thread."""
    with pinned({core}, 1):
        return [replace(measurer(problem, c), engine=engine) for c in configs]


def time_batch(problem: Problem, checked: Sequence[Measurement], cores: set[int], engine: int) -> list[Measurement]:
    """Engine side, phase 2: time validated measurements on ``cores`` with ``problem.threads`` threads."""
    with pinned(cores, problem.threads):
        return [replace(time_checked(problem, m), engine=engine) for m in checked]


def _slot_views(engines: Any) -> list[Any]:
    """One DirectView per engine: ranks of a rapydli Cluster, or engine ids of an ipyparallel Client."""
    if hasattr(engines, "view"):
        count = len(engines.view(targets=None).targets)
        return [engines.view(targets=[rank]) for rank in range(count)]
    if hasattr(engines, "direct_view") and hasattr(engines, "ids"):  # an ipyparallel Client
        return [engines.direct_view([engine]) for engine in sorted(engines.ids)]
    raise ConfigError("engines must be a rapydli Cluster (with .view(targets=)) or an ipyparallel Client")


@dataclass(frozen=True)
class Seat:
    """Where one engine works: its core for building/validating, and its cores for timing.

    ``time_cores`` is None for an engine that does not time because the other engines
    on its machine already hold all of that machine's cores.
    """

    index: int
    host: str
    check_core: int
    time_cores: frozenset[int] | None


def seats(places: Sequence[tuple[str, Sequence[int]]], threads: int) -> list[Seat]:
    """Seats for engines at ``places`` (``(host, cores)`` each, in engine order) timing with ``threads``.

    On each machine, engines build and validate on distinct cores (round robin), and the
    first ``cores // threads`` engines time, each on its own ``threads`` cores (at least
    one engine per machine times, on all its cores when it has fewer than ``threads``).

    Example
    -------
    >>> [s.time_cores for s in seats([("a", [0, 1]), ("a", [0, 1])], threads=2)]
    [frozenset({0, 1}), None]
    >>> [s.time_cores for s in seats([("a", [0, 1]), ("a", [0, 1])], threads=1)]
    [frozenset({0}), frozenset({1})]
    """
    if threads < 1:
        raise ConfigError(f"threads must be >= 1, got {threads}")
    by_host: dict[str, list[int]] = {}
    for index, (host, _) in enumerate(places):
        by_host.setdefault(host, []).append(index)
    out: dict[int, Seat] = {}
    for host, indices in by_host.items():
        cores = sorted({core for i in indices for core in places[i][1]})
        slots = max(1, len(cores) // threads)
        for j, index in enumerate(indices):
            time_cores = frozenset(cores[j * threads : (j + 1) * threads] or cores) if j < slots else None
            out[index] = Seat(index, host, cores[j % len(cores)], time_cores)
    return [out[i] for i in range(len(places))]


class ParallelRunner(Runner):
    """Spread configurations over a cluster's engines: all build and validate, then the seated ones time.

    Work is handed out in small batches as engines become free (one round trip per batch),
    so a slow kernel on one engine does not leave the others idle. See :func:`seats` for
    which engine times on which cores; the timing phase starts once every configuration
    is built and validated, so no compile runs beside a timing.

    Parameters
    ----------
    engines
        A :class:`rapydli.cluster.Cluster` (anything with ``.view(targets=None)`` returning an
        ipyparallel ``DirectView``) or an ``ipyparallel.Client``.
    measurer
        What each engine runs per configuration in the first phase: :func:`check` (build and
        validate; ``"validated"`` results are then timed), or a measurer giving final
        results (a :class:`Replay`).
    timeout
        Seconds to wait for each phase before raising :class:`RankFailure`.
    """

    def __init__(self, engines: Any, measurer: Measurer = check, timeout: float | None = None) -> None:
        self.engines = engines
        self.measurer = measurer
        self.timeout = timeout
        self._views: list[Any] | None = None
        self._places: list[tuple[str, list[int]]] = []

    def _seats(self, threads: int) -> tuple[list[Any], list[Seat]]:
        if self._views is None:  # engines do not move: ask once where they are
            views = _slot_views(self.engines)
            handles = [view.apply_async(engine_place) for view in views]
            try:
                self._places = [
                    (host, list(cores)) for ((host, cores),) in (h.get(timeout=self.timeout) for h in handles)
                ]
            except Exception as exc:
                raise RankFailure(f"autotune: could not reach the engines: {type(exc).__name__}: {exc}", {}) from exc
            self._views = views
        return self._views, seats(self._places, threads)

    def _spread(
        self, workers: Sequence[Seat], items: Sequence[Any], submit: Callable[[Seat, list[Any]], Any]
    ) -> list[Measurement]:
        """Results of ``items`` (in no particular order): batches handed to whichever worker is free."""
        size = max(1, math.ceil(len(items) / (4 * len(workers))))
        batches = [list(items[i : i + size]) for i in range(0, len(items), size)]
        free = list(workers)
        running: dict[Any, Seat] = {}  # future of a batch -> the worker running it
        results: list[Measurement] = []
        failures: dict[int, str] = {}
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while batches or running:
            while free and batches and not failures:
                seat = free.pop(0)
                running[submit(seat, batches.pop(0))] = seat
            if not running:
                break
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            done, _ = concurrent.futures.wait(running, timeout=left, return_when=concurrent.futures.FIRST_COMPLETED)
            if not done:
                failures.update({seat.index: f"no result within {self.timeout} s" for seat in running.values()})
                break
            for future in done:
                seat = running.pop(future)
                try:
                    (part,) = future.result()  # one engine per view -> one result
                except Exception as exc:  # noqa: BLE001 - collected per engine, raised once below
                    failures[seat.index] = f"{type(exc).__name__}: {exc}"
                    continue
                results.extend(part)
                free.append(seat)
        if failures:
            detail = "; ".join(f"engine {k}: {v[:300]}" for k, v in sorted(failures.items()))
            raise RankFailure(f"autotune measurement failed on engine(s) {sorted(failures)}: {detail}", failures)
        return results

    def run(self, problem: Problem, configs: Sequence[Config]) -> list[Measurement]:
        import torch

        configs = list(configs)
        if not configs:
            return []
        threads = problem.threads or torch.get_num_threads()
        problem = replace(problem, threads=threads)
        views, all_seats = self._seats(threads)
        checked = self._spread(
            all_seats,
            configs,
            lambda seat, part: views[seat.index].apply_async(
                check_batch, problem, part, seat.check_core, seat.index, self.measurer
            ),
        )
        timers = [seat for seat in all_seats if seat.time_cores is not None]
        todo = [m for m in checked if m.status == "validated"]
        timed = (
            self._spread(
                timers,
                todo,
                lambda seat, part: views[seat.index].apply_async(
                    time_batch, problem, part, set(seat.time_cores or ()), seat.index
                ),
            )
            if todo
            else []
        )  # timers all have cores
        results = {m.config: m for m in [*checked, *timed]}
        return [results[c] for c in configs]
