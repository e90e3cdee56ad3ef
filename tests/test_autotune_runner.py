"""Runners, validation, cache, strategies and the parallel runner on real engines."""

from __future__ import annotations

import os
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F

from rapydli.autotune import candidates as cands
from rapydli.autotune import strategies
from rapydli.autotune.cache import Cache, CachedRunner
from rapydli.autotune.conv import pick_best, tune_conv2d
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.runner import (
    Measurement,
    ParallelRunner,
    Replay,
    SequentialRunner,
    SimulationRunner,
    check,
    measure,
    seats,
)
from rapydli.autotune.search import Config, Problem, SearchSpace
from rapydli.errors import RapydliWarning

SHAPE = ConvShape(2, 4, 9, 9, 6, 3, 3, stride=1, pad=1)


class _Spy(cands.Instance):
    """Computes a convolution with a deliberate mistake (unless ``wrong`` is False); records input shapes."""

    native_autograd = True
    calls: ClassVar[list[tuple[int, ...]]] = []

    def forward(self, x, w):
        _Spy.calls.append(tuple(x.shape))
        if self.params.get("boom"):
            raise RuntimeError("boom")
        y = F.conv2d(x, w, None, self.shape.stride, self.shape.pad)
        return y * 1.01 if self.params.get("wrong") else y

    def _grads(self, x, w, gy):
        return torch.ops.aten.convolution_backward(
            gy, x, w, None, [self.shape.stride] * 2, [self.shape.pad] * 2, [1, 1], False, [0, 0], 1, [True, True, False]
        )

    def data_grad(self, x, w, gy):
        return self._grads(x, w, gy)[0]

    def weight_grad(self, x, w, gy):
        return self._grads(x, w, gy)[1]


class _SpyCandidate(cands.Candidate):
    name = "spy"

    def instance(self, shape, params):
        return _Spy(shape, params)


@pytest.fixture
def spy():
    cands.register(_SpyCandidate())
    _Spy.calls = []
    yield _Spy
    cands.CANDIDATES.unregister("spy")


def test_wrong_kernel_is_rejected_and_never_timed(spy) -> None:
    problem = Problem(SHAPE, "inference", repetitions=3)
    bad = measure(problem, Config.of("spy", {"wrong": 1}))
    assert bad.status == "invalid" and bad.median is None and bad.times == []
    assert bad.error > problem.tolerance
    small = problem.shape.validation_shape()
    assert spy.calls == [(small.n, small.c, small.h, small.w)]  # validated on the small input only, not timed
    good = measure(problem, Config.of("spy", {"wrong": 0}))
    assert good.ok and len(good.times) >= 3 and good.median > 0 and good.variance >= 0
    assert (SHAPE.n, SHAPE.c, SHAPE.h, SHAPE.w) in spy.calls  # timed on the real shape


def test_failing_kernel_is_an_error_result_not_a_crash(spy) -> None:
    m = measure(Problem(SHAPE), Config.of("spy", {"boom": 1}))
    assert m.status == "error" and m.median is None and "boom" in m.message


def test_tuning_picks_a_valid_winner_and_skips_the_wrong_kernel(spy, tmp_path) -> None:
    result = tune_conv2d(
        SHAPE,
        mode="train",
        candidates=["spy", "torch_nchw"],
        cache=Cache(tmp_path / "a.db"),
        repetitions=2,
        constraints=None,
    )
    assert result.best.config.candidate == "torch_nchw" or result.best.config == Config.of("spy", {})
    assert set(result.table["status"]) == {"ok"}


def test_cache_skips_measured_work(tmp_path) -> None:
    cache = Cache(tmp_path / "tune.db")
    kwargs = {
        "candidates": ["torch_nchw", "torch_channels_last", "c_direct"],
        "preset": "tiny",
        "cache": cache,
        "repetitions": 1,
        "mode": "train",
    }
    first = tune_conv2d(SHAPE, **kwargs)
    assert first.measured == len(first.measurements) > 3
    calls: list[Config] = []

    def counting(problem, config):
        calls.append(config)
        return measure(problem, config)

    second = tune_conv2d(SHAPE, runner=SequentialRunner(counting), **kwargs)
    assert second.measured == 0 and calls == []
    assert second.best.config == first.best.config
    assert second.table["cached"].all()
    # an edited kernel template is measured again
    from rapydli.autotune import cbuild

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cbuild, "templates_digest", lambda: "edited")
        assert tune_conv2d(SHAPE, **kwargs).measured == len(first.measurements)
    # another mode is another problem: measured again
    third = tune_conv2d(SHAPE, **{**kwargs, "mode": "inference"})
    assert third.measured == len(third.measurements)
    # each pass is timed (train: forward and both gradients) and its time comes back from the cache
    for fresh, cached in zip(first.measurements, second.measurements):
        if fresh.ok:
            assert set(fresh.passes) == set(cands.PASSES) and all(t > 0 for t in fresh.passes.values())
            assert cached.passes == fresh.passes
    assert all(set(m.passes) == {"forward"} for m in third.measurements if m.ok)


def test_a_cache_from_before_per_pass_times_is_migrated(tmp_path) -> None:
    import sqlite3

    path = tmp_path / "old.db"
    with sqlite3.connect(path) as db:  # the schema without the passes column
        db.execute(
            "CREATE TABLE measurements (fingerprint TEXT NOT NULL, problem TEXT NOT NULL, "
            "candidate TEXT NOT NULL, params TEXT NOT NULL, status TEXT NOT NULL, median REAL, variance REAL, "
            "times TEXT NOT NULL, error REAL, message TEXT NOT NULL, created REAL NOT NULL, "
            "PRIMARY KEY (fingerprint, problem, candidate, params))"
        )
        db.execute("INSERT INTO measurements VALUES ('fp', 'p', 'torch_nchw', '{}', 'ok', 0.5, 0, '[0.5]', 0, '', 0)")
    cache = Cache(path)
    old = cache.get("fp", "p", Config.of("torch_nchw"))
    assert old.median == 0.5 and old.passes == {}
    cache.put("fp", "p", Measurement(Config.of("gemm_1x1"), "ok", 0.3, 0.0, [0.3], passes={"forward": 0.3}))
    assert cache.get("fp", "p", Config.of("gemm_1x1")).passes == {"forward": 0.3}


def test_best_split_takes_each_pass_from_its_fastest_configuration() -> None:
    from rapydli.autotune.conv import TuneResult

    def ok(candidate, fwd, dx, dw):
        passes = {"forward": fwd, "data_grad": dx, "weight_grad": dw}
        return Measurement(Config.of(candidate), "ok", fwd + dx + dw, 0.0, [fwd + dx + dw], passes=passes)

    ms = [
        ok("a", 1.0, 5.0, 2.0),
        ok("b", 3.0, 1.0, 3.0),
        ok("c", 2.0, 2.0, 1.0),
        Measurement(Config.of("d"), "invalid", error=1.0),
    ]
    result = TuneResult(Problem(SHAPE, "train"), ms[2], None, ms, None, None)
    split = result.best_split(lambda c: True)
    assert {p: m.config.candidate for p, m in split.passes.items()} == {
        "forward": "a",
        "data_grad": "b",
        "weight_grad": "c",
    }
    assert split.seconds == pytest.approx(3.0) and result.best.median == 5.0  # the best whole configuration: 5.0
    assert result.best_split(lambda c: c.candidate == "b").seconds == pytest.approx(7.0)
    assert result.best_split(lambda c: c.candidate == "d") is None
    # measurements without per-pass times (an old cache) count as whole runs
    whole = [Measurement(Config.of("a"), "ok", 4.0, 0.0, [4.0]), Measurement(Config.of("b"), "ok", 3.0, 0.0, [3.0])]
    split = TuneResult(Problem(SHAPE, "train"), whole[1], None, whole, None, None).best_split(lambda c: True)
    assert split.seconds == 3.0 and {m.config.candidate for m in split.passes.values()} == {"b"}
    # inference: the forward alone
    inference = TuneResult(Problem(SHAPE, "inference"), ms[0], None, ms, None, None).best_split(lambda c: True)
    assert set(inference.passes) == {"forward"} and inference.config("weight_grad") == Config.of("a")


def test_best_is_claimed_only_when_its_timed_runs_beat_the_runner_ups() -> None:
    from rapydli.autotune.conv import TuneResult

    def ok(candidate, times):
        return Measurement(Config.of(candidate), "ok", sorted(times)[len(times) // 2], 0.0, times)

    apart = [
        ok("slow", [0.004, 0.005, 0.006]),
        ok("fast", [0.001, 0.0011, 0.0012]),
        Measurement(Config.of("bad"), "invalid", error=1.0),
    ]
    verdict = TuneResult(Problem(SHAPE, "train"), apart[1], None, apart, None, None).best_verdict()
    assert verdict.startswith(
        "best: fast 1.1 ms (timed 1 ms to 1.2 ms), faster in every timed run than the runner-up slow"
    )
    # a median 20x lower whose range reaches into the runner-up's: no winner claimed
    overlap = [ok("wide", [0.0005, 0.001, 0.02]), ok("steady", [0.0019, 0.002, 0.0021])]
    verdict = TuneResult(Problem(SHAPE, "train"), overlap[0], None, overlap, None, None).best_verdict()
    assert (
        verdict.startswith("fastest median: wide 1 ms")
        and "no difference measurable" in verdict
        and "best" not in verdict
    )
    alone = [ok("only", [0.001])]
    assert (
        TuneResult(Problem(SHAPE, "train"), alone[0], None, alone, None, None)
        .best_verdict()
        .endswith("the only configuration timed")
    )


def _records(problem: Problem, n: int = 12) -> list[tuple[str, Measurement]]:
    times = [0.9, 0.5, 0.7, 0.2, 0.8, 0.35, 0.6, 0.25, 0.4, 0.3, 0.45, 0.55][:n]
    out = [(problem.key, Measurement(Config.of("c_direct", {"kb": i}), "ok", t, 0.0, [t])) for i, t in enumerate(times)]
    out.append((problem.key, Measurement(Config.of("c_direct", {"kb": 99}), "invalid", error=1.0)))
    out.append((problem.key, Measurement(Config.of("torch_nchw"), "ok", 0.3, 0.0, [0.3])))
    return out


def _space(problem: Problem, records) -> SearchSpace:
    configs = [m.config for _, m in records if m.config.candidate == "c_direct"]
    return SearchSpace(problem, configs, always=[Config.of("torch_nchw")])


def test_strategies_on_the_simulation_runner() -> None:
    problem = Problem(SHAPE)
    records = _records(problem)
    space = _space(problem, records)
    runner = SimulationRunner(records)
    exhaustive = strategies.get("exhaustive")(space, runner, {})
    assert len(exhaustive) == 14
    assert pick_best(exhaustive).config == Config.of("c_direct", {"kb": 3})  # 0.2 s
    sampled = strategies.get("random")(space, runner, {"budget": 4, "seed": 1})
    assert len(sampled) == 5 and sampled[0].config == Config.of("torch_nchw")  # always + budget
    again = strategies.get("random")(space, runner, {"budget": 4, "seed": 1})
    assert [m.config for m in again] == [m.config for m in sampled]
    best = pick_best(sampled)
    assert best.median == min(m.median for m in sampled if m.ok)
    with pytest.raises(Exception, match="strategy must be one of"):
        strategies.get("annealing")


def test_simulation_replays_the_cache(tmp_path) -> None:
    problem = Problem(SHAPE)
    cache = Cache(tmp_path / "sim.db")
    for key, m in _records(problem):
        cache.put("fp-test", key, m)
    runner = SimulationRunner(cache, fingerprint="fp-test")
    space = _space(problem, _records(problem))
    result = strategies.get("exhaustive")(space, runner, {})
    assert pick_best(result).config == Config.of("c_direct", {"kb": 3})
    missing = runner.run(problem, [Config.of("c_direct", {"kb": 1234})])
    assert missing[0].status == "missing"
    cached = CachedRunner(runner, cache, "fp-test")
    cached.run(problem, space.configs)
    assert cached.measured == 0


def test_without_a_compiler_generated_candidates_are_skipped_with_a_warning(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler-rapydli")
    with pytest.warns(RapydliWarning, match="no C compiler"):
        result = tune_conv2d(
            SHAPE,
            preset="tiny",
            repetitions=1,
            cache=Cache(tmp_path / "nocc.db"),
            candidates=["torch_nchw", "c_direct"],
        )
    assert "c_direct" in result.space.skipped
    assert set(result.table["candidate"]) == {"torch_nchw"}


@pytest.fixture(scope="module")
def engines():
    from rapydli.cluster import Cluster

    cluster = Cluster(n=2)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.engines
@pytest.mark.mpi
def test_parallel_and_sequential_runners_pick_the_same_winner(engines) -> None:
    problem = Problem(SHAPE)
    records = _records(problem)
    space = _space(problem, records)
    replay = Replay({(k, m.config): m for k, m in records})
    sequential = strategies.get("exhaustive")(space, SequentialRunner(replay), {})
    parallel = strategies.get("exhaustive")(space, ParallelRunner(engines, replay, timeout=60), {})
    assert [m.config for m in parallel] == [m.config for m in sequential]
    assert [m.median for m in parallel] == [m.median for m in sequential]
    assert pick_best(parallel).config == pick_best(sequential).config
    assert {m.engine for m in parallel} == {0, 1}  # both engines measured a slice
    one = ParallelRunner(_OneEngine(engines), replay, timeout=60).run(problem, space.configs)
    assert pick_best(one).config == pick_best(sequential).config  # independent of the engine count


class _OneEngine:
    """A view on only the first engine of a cluster."""

    def __init__(self, cluster) -> None:
        self.cluster = cluster

    def view(self, targets=None):
        return self.cluster.view(targets=[0] if targets is None else targets)


@pytest.mark.engines
@pytest.mark.mpi
def test_parallel_runner_measures_real_kernels_on_engines(engines, tmp_path) -> None:
    result = tune_conv2d(
        SHAPE,
        engines=engines,
        candidates=["torch_nchw", "torch_channels_last", "c_direct"],
        preset="tiny",
        repetitions=1,
        cache=Cache(tmp_path / "par.db"),
        threads=1,
    )
    assert result.best.ok
    assert set(result.table["engine"]) == {0, 1}  # one thread per timing: both engines time, each on its core
    assert result.measured == len(result.measurements)
    assert result.device.threads == 1


def _check_where(problem, config):
    """A first-phase measurer that says which process and cores built and validated ``config``."""
    m = check(problem, config)
    return Measurement(m.config, m.status, error=m.error, message=f"{os.getpid()} {sorted(os.sched_getaffinity(0))}")


@pytest.mark.engines
@pytest.mark.mpi
def test_all_engines_build_but_timings_never_share_cores(engines) -> None:
    problem = Problem(SHAPE, "inference", repetitions=1, threads=len(os.sched_getaffinity(0)))
    configs = [
        Config.of("torch_nchw"),
        Config.of("torch_channels_last"),
        Config.of("im2col_gemm"),
        *(
            Config.of("c_direct", p)
            for p in (
                {"layout": 0, "kb": 2, "wb": 2, "cb": 64, "vec": 4, "unroll": 1, "order": 0},
                {"layout": 1, "kb": 2, "wb": 2, "cb": 64, "vec": 4, "unroll": 1, "order": 0},
            )
        ),
    ]
    results = ParallelRunner(engines, _check_where, timeout=120).run(problem, configs)
    assert [m.config for m in results] == configs and all(m.ok for m in results)
    assert len({m.message.split()[0] for m in results}) == 2  # both engines built and validated (one core each)
    assert all(len(m.message.split(" ", 1)[1].split(",")) == 1 for m in results)
    assert {m.engine for m in results} == {0}  # all cores per timing: one engine times, the other waits


def test_seats_give_each_timing_its_own_cores() -> None:
    two_on_two = [("a", [0, 1]), ("a", [0, 1])]
    assert [(s.check_core, s.time_cores) for s in seats(two_on_two, 2)] == [(0, frozenset({0, 1})), (1, None)]
    assert [s.time_cores for s in seats(two_on_two, 1)] == [frozenset({0}), frozenset({1})]
    two_hosts = [("a", [0, 1]), ("b", [0, 1]), ("a", [0, 1]), ("b", [0, 1])]
    assert [s.time_cores for s in seats(two_hosts, 2)] == [frozenset({0, 1}), frozenset({0, 1}), None, None]
    assert [s.time_cores for s in seats([("a", [0, 1])], 4)] == [frozenset({0, 1})]  # fewer cores than threads
    with pytest.raises(Exception, match="threads must be >= 1"):
        seats(two_on_two, 0)


# ---------------------------------------------------------------- timings disturbed by other work


def _timings(monkeypatch, *runs: list[float]) -> list[int]:
    """Make the runner's timings return ``runs`` in turn (forward pass only): contention cannot be
    produced on demand, so the timer is replaced; the instance is still built and validated."""
    from rapydli.autotune import runner

    calls: list[int] = []

    def timed(problem, inst):
        calls.append(1)
        return {"forward": list(runs[len(calls) - 1])}

    monkeypatch.setattr(runner, "_timed", timed)
    return calls


def test_a_timing_with_disturbed_repeats_is_taken_again_and_the_steady_one_kept(monkeypatch, tmp_path) -> None:
    problem = Problem(SHAPE, "inference", repetitions=3)
    calls = _timings(monkeypatch, [1e-3, 1e-3, 3e-3], [1.1e-3, 1.0e-3, 1.05e-3])
    m = measure(problem, Config.of("torch_nchw"))
    assert len(calls) == 2 and m.retimed == 1 and not m.disturbed
    assert m.times == [1.1e-3, 1.0e-3, 1.05e-3] and m.median == 1.05e-3
    cache = Cache(tmp_path / "c.db")
    cache.put("fp", problem.key, m)
    assert cache.get("fp", problem.key, m.config) is not None  # a steady timing is kept


def test_a_timing_disturbed_every_time_says_so_keeps_the_fastest_and_is_not_cached(monkeypatch, tmp_path) -> None:
    from rapydli.autotune.runner import RETIMES

    problem = Problem(SHAPE, "inference", repetitions=3)
    calls = _timings(monkeypatch, [2e-3, 2e-3, 9e-3], [1e-3, 1e-3, 4e-3], [3e-3, 3e-3, 7e-3])
    m = measure(problem, Config.of("torch_nchw"))
    assert len(calls) == 1 + RETIMES and m.retimed == RETIMES
    assert m.times == [1e-3, 1e-3, 4e-3] and "repeats span 1 to 4 ms" in m.disturbed
    cache = Cache(tmp_path / "c.db")
    cache.put("fp", problem.key, m)
    assert cache.get("fp", problem.key, m.config) is None  # a quieter run measures it again


def test_a_library_call_far_above_its_roofline_is_disturbed_a_generated_kernel_is_not(monkeypatch) -> None:
    from rapydli.autotune.conv import build_space
    from rapydli.autotune.device import query
    from rapydli.autotune.runner import ROOFLINE_FACTOR, roofline_s

    problem = Problem(SHAPE, "inference", repetitions=3, threads=1)
    floor = roofline_s(problem, 1)
    assert floor is not None and floor > 0
    steady_but_slow = [2 * ROOFLINE_FACTOR * floor] * 3  # e.g. two threads spinning over two busy cores
    _timings(monkeypatch, steady_but_slow, steady_but_slow, steady_but_slow)
    library = measure(problem, Config.of("torch_nchw"))
    assert library.retimed == 2 and "the least its arithmetic and memory traffic allow" in library.disturbed
    _timings(monkeypatch, steady_but_slow)
    config = build_space(problem, query("cpu", 1), candidates=["c_direct"], preset="tiny").configs[0]
    generated = measure(problem, config)
    assert generated.ok and generated.retimed == 0 and not generated.disturbed
