"""Budgeted model tuning: ranking, the model-based strategy, early abandonment, resuming, warm plans, any model."""

from __future__ import annotations

import copy
import math
import sqlite3
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

from rapydli.autotune.budget import OVERRUN_S
from rapydli.autotune.cache import Cache
from rapydli.autotune.conv import build_space, tune_conv2d
from rapydli.autotune.device import query
from rapydli.autotune.model import LayerChoice, Plan, TunedConv2d, apply_plan, autotune_model, conv_layers, layout_of
from rapydli.autotune.plans import plan_from_json, plan_to_json
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.runner import Measurement, SimulationRunner, measure
from rapydli.autotune.search import Config, Problem
from rapydli.autotune.strategies import get
from rapydli.errors import ConfigError
from rapydli.trainer.config import TrainConfig
from rapydli.zoo.models import resnet18_like

TINY = {"preset": "tiny", "repetitions": 2}


def every_kind_of_conv() -> nn.Module:
    """7x7 stride-2 stem, bias and bias-free, 1x1, stride 2, grouped, depthwise, dilated."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),  # with bias
        nn.Conv2d(8, 16, 1, stride=2, bias=False),  # 1x1, stride 2
        nn.Conv2d(16, 16, 3, padding=1, groups=4),  # grouped
        nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False),  # depthwise
        nn.Conv2d(16, 16, 3, padding=2, dilation=2),  # dilated
        nn.Conv2d(16, 8, 3, stride=2, padding=1, bias=False),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def outputs_and_grads(model: nn.Module, x: torch.Tensor):
    model.train()
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in model.named_parameters()}


def assert_same(a: nn.Module, b: nn.Module, x: torch.Tensor, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    out_a, gx_a, g_a = outputs_and_grads(a, x)
    out_b, gx_b, g_b = outputs_and_grads(b, x)
    torch.testing.assert_close(out_b, out_a, rtol=rtol, atol=atol)
    torch.testing.assert_close(gx_b, gx_a, rtol=rtol, atol=atol)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], rtol=rtol, atol=max(atol, 1e-4), msg=name)


def assert_same_in_norm(a: nn.Module, b: nn.Module, x: torch.Tensor, tol: float = 1e-3) -> None:
    """Outputs, input gradient and every parameter gradient equal within ``tol`` of their norm.

    20 convolutions, each followed by batch norm in train mode, compound float32 rounding (another summation
    order per kernel): element by element a value near zero differs by 20 %, while against a float64 copy
    both models are 1e-5 (outputs) to 1e-4 (gradients) off in norm.
    """
    out_a, gx_a, g_a = outputs_and_grads(a, x)
    out_b, gx_b, g_b = outputs_and_grads(b, x)
    assert g_a.keys() == g_b.keys()
    for name, (p, q) in {
        "output": (out_a, out_b),
        "input grad": (gx_a, gx_b),
        **{k: (g_a[k], g_b[k]) for k in g_a},
    }.items():
        assert float((q - p).norm() / p.norm().clamp_min(1e-12)) < tol, name


# ---------------------------------------------------------------- the strategy, on replayed measurements


def _synthetic(space, best: Config) -> list[tuple[str, Measurement]]:
    """Times that grow with the distance (parameter values unlike ``best``'s); library at 1 ms."""
    records = []
    for config in [*space.always, *space.configs]:
        if config in space.always:
            t = 1e-3
        else:
            mine, target = config.param_dict, best.param_dict
            t = 0.5e-3 * (1 + 0.15 * sum(mine.get(k) != v for k, v in target.items()))
        records.append((space.problem.key, Measurement(config, "ok", t, 0.0, [t], passes={"forward": t})))
    return records


def test_model_based_search_finds_the_best_in_few_evaluations() -> None:
    problem = Problem(ConvShape(8, 64, 8, 8, 64, 3, 3, pad=1), "inference")
    space = build_space(problem, query("cpu", 2), ["torch_nchw", "torch_channels_last", "c_direct"], "full")
    assert len(space.configs) > 300
    best = space.configs[len(space.configs) * 2 // 3]
    runner = SimulationRunner(_synthetic(space, best))
    found = get("model_based")(space, runner, {"seed": 1, "patience": 10})
    generated = [m for m in found if m.config.candidate == "c_direct"]
    assert min(found, key=lambda m: m.median).config == best
    assert len(generated) <= len(space.configs) // 5  # far fewer than the exhaustive search
    # priors (what earlier layers chose) are measured first
    again = get("model_based")(space, runner, {"priors": [best], "budget": 3})
    assert next(m.config for m in again if m.config.candidate == "c_direct") == best
    assert sum(m.config.candidate == "c_direct" for m in again) == 3
    with pytest.raises(ConfigError, match="margin"):
        get("model_based")(space, runner, {"margin": 0.5})


def test_a_configuration_slower_than_the_margin_is_abandoned_after_one_timed_run() -> None:
    problem = Problem(ConvShape(2, 4, 8, 8, 4, 3, 3, pad=1), "train", repetitions=5, threads=1)
    full = measure(problem, Config.of("torch_nchw"))
    assert full.status == "ok" and len(full.times) == 5
    assert set(full.seconds) == {"compile", "validate", "time"}
    slow = measure(replace(problem, abandon_s=1e-9), Config.of("torch_nchw"))
    assert slow.status == "slow" and len(slow.times) == 1 and "abandoned" in slow.message
    assert not slow.ok  # never chosen


# ---------------------------------------------------------------- resuming and warm starts


def test_an_interrupted_tuning_resumes_from_the_cache(tmp_path) -> None:
    shape = ConvShape(2, 4, 6, 6, 4, 3, 3, pad=1)
    cache = Cache(tmp_path / "a.db")
    seen: list[Measurement] = []

    def interrupt_after_three(m: Measurement) -> None:
        seen.append(m)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        tune_conv2d(shape, mode="inference", cache=cache, on_result=interrupt_after_three, threads=1, **TINY)
    resumed = tune_conv2d(shape, mode="inference", cache=cache, threads=1, **TINY)
    fresh = tune_conv2d(shape, mode="inference", cache=Cache(tmp_path / "b.db"), threads=1, **TINY)
    assert resumed.measured == fresh.measured - 3  # each measurement was stored as it was taken
    assert {m.config for m in resumed.measurements} == {m.config for m in fresh.measurements}


def test_an_interrupted_model_tuning_resumes_and_a_finished_one_is_applied_from_the_cache(tmp_path) -> None:
    model, x = every_kind_of_conv(), torch.randn(2, 3, 16, 16)
    options = {**TINY, "progress": False, "threads": 1, "verify": False}  # the whole-model check is tested below
    _, full = autotune_model(model, x, cache=Cache(tmp_path / "full.db"), **options)
    cache = Cache(tmp_path / "cut.db")

    def stop(row: dict) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        autotune_model(model, x, cache=cache, on_layer=stop, **options)
    _, resumed = autotune_model(model, x, cache=cache, **options)
    assert 0 < resumed.measured < full.measured
    started = time.perf_counter()
    tuned, warm = autotune_model(model, x, cache=cache, **options)
    assert warm.from_cache and warm.measured == 0 and warm.plan.layers == resumed.plan.layers
    assert "read from the cache" in warm.summary
    assert time.perf_counter() - started < 30  # no tuning (generous: a shared machine); the bench reports the figure
    assert_same(model, tuned, x)


def test_plans_round_trip_through_json(tmp_path) -> None:
    model, x = every_kind_of_conv(), torch.randn(2, 3, 16, 16)
    _, report = autotune_model(model, x, cache=Cache(tmp_path / "c.db"), progress=False, verify=False, **TINY)
    plan = plan_from_json(plan_to_json(report.plan))
    assert isinstance(plan, Plan) and plan.layers == report.plan.layers and plan.chosen == report.plan.chosen


# ---------------------------------------------------------------- budget, report, any model


@pytest.fixture
def one_thread():
    """Steps at one torch thread: on a shared 2-core machine two OpenMP threads wait on each other for seconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_budget_holds_and_the_report_says_where_the_time_went(tmp_path, capsys, one_thread) -> None:
    torch.manual_seed(0)
    model, x = resnet18_like(width=8), torch.randn(4, 3, 32, 32)  # batch 2: batch norm over 2 values at 1x1 puts even
    budget = 8.0  # the untuned float32 model 3e-3 off a float64 copy
    # the default preset would take minutes exhaustively; the budget stops it
    started = time.perf_counter()
    tuned, report = autotune_model(
        model, x, budget_s=budget, cache=Cache(tmp_path / "b.db"), preset="default", repetitions=3, threads=1
    )
    # the budget bounds the whole call, whole-model check included; the stated slack (rapydli.autotune.budget) is a
    # hang bound: a compile slower than every one before it
    assert time.perf_counter() - started <= budget + OVERRUN_S
    assert {"profile", "compile", "validate", "time", "search", "check", "other"} <= set(report.time_s)
    rows = report.layers
    assert list(rows["share"]) == sorted(rows["share"], reverse=True)  # costliest first
    assert set(rows["status"]) <= {"tuned", "skipped: budget"}
    skipped = rows[rows["status"] == "skipped: budget"]
    assert sorted(report.skipped) == sorted(n for names in skipped["names"] for n in names.split(", "))
    printed = capsys.readouterr().out.strip().splitlines()
    assert printed[-1] == report.summary and report.summary.startswith("autotune: ")
    assert_same_in_norm(model, tuned, x)


def test_a_tuning_that_finds_nothing_better_says_so_in_one_line_within_the_budget(tmp_path, one_thread) -> None:
    model, x = every_kind_of_conv(), torch.randn(2, 3, 16, 16)
    started = time.perf_counter()
    tuned, report = autotune_model(
        model, x, budget_s=4, candidates=["torch_nchw"], cache=Cache(tmp_path / "n.db"), progress=False, **TINY
    )
    assert time.perf_counter() - started <= 4 + OVERRUN_S  # a hang bound (see rapydli.autotune.budget)
    assert "nothing faster" in report.summary and "\n" not in report.summary
    assert report.time_s["check"] == 0.0  # the library default is the untuned model: no whole-model check
    assert_same(model, tuned, x)


def test_a_budget_too_small_for_the_profile_leaves_the_model_as_it_is(tmp_path, one_thread) -> None:
    torch.manual_seed(0)
    model, x = resnet18_like(width=8), torch.randn(2, 3, 32, 32)
    started = time.perf_counter()
    tuned, report = autotune_model(model, x, budget_s=0.1, cache=Cache(tmp_path / "s.db"), progress=False, **TINY)
    assert time.perf_counter() - started <= 0.1 + OVERRUN_S
    assert len(report.skipped) == 20 and set(report.layers["status"]) == {"skipped: budget"}
    # the table has the columns a tuned one has (notebook 06 shows these on a machine too busy to tune anything)
    assert {"speedup", "speedup_low", "speedup_high", "evaluated", "status", "flag"} <= set(report.layers.columns)
    # nothing was tried, so nothing was found either way: the summary says that, not "nothing faster"
    assert "the budget left no time to tune any layer (the untuned step took" in report.summary
    assert (
        "cores" in report.summary
        and "keeps the library default" in report.summary
        and "nothing faster" not in report.summary
    )
    assert_same_in_norm(model, tuned, x)


def test_any_model_every_kind_of_convolution_is_tuned_and_training_is_unchanged(tmp_path, one_thread) -> None:
    model, x = every_kind_of_conv(), torch.randn(2, 3, 16, 16)
    tuned, report = autotune_model(model, x, budget_s=20, cache=Cache(tmp_path / "m.db"), progress=False, **TINY)
    convs = {name: m for name, m in tuned.named_modules() if isinstance(m, nn.Conv2d)}
    assert {name for name, m in convs.items() if isinstance(m, TunedConv2d)} == {
        name for name, choice in report.plan.layers.items() if not choice.is_library_default
    }  # the library default is left plain
    assert len(convs) == 7 and set(report.plan.layers) == set(convs)
    shapes = {name: choice.shape for name, choice in report.plan.layers.items()}
    assert (shapes["6"].groups, shapes["7"].groups, shapes["8"].dilation) == (4, 16, 2)
    assert_same(model, tuned, x)
    # each kind on every candidate that computes it (generated C kernels in both layouts where they take it)
    for name, shape in shapes.items():
        space = build_space(Problem(shape, "train"), query("cpu", 1), None, "tiny")
        configs = {(c.candidate, layout_of(c)): c for c in reversed([*space.always, *space.configs])}
        assert {c for c, _ in configs} >= {"torch_nchw", "torch_channels_last", "im2col_gemm", "c_direct"}
        assert ("c_direct", "nchw") in configs and (("c_direct", "nhwc") in configs) == (shape.groups == 1)
        for config in configs.values():  # one of each candidate and layout: the candidates' own tests cover the rest
            choice = replace(
                report.plan.layers[name],
                candidate=config.candidate,
                params=config.params,
                layout=layout_of(config),
                data_grad=None,
                weight_grad=None,
            )
            forced = apply_plan(copy.deepcopy(model), Plan({name: choice}, "train", report.plan.fingerprint))
            assert_same(model, forced, x)


def test_layers_of_one_shape_are_tuned_once(tmp_path) -> None:
    def stack(layers: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            *[m for _ in range(layers) for m in (nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1))],
        )

    x, measured, rows = torch.randn(2, 3, 8, 8), {}, {}
    for layers in (1, 2, 3):
        cache = Cache(tmp_path / f"{layers}.db")
        _, report = autotune_model(stack(layers), x, cache=cache, progress=False, verify=False, threads=1, **TINY)
        with sqlite3.connect(cache.path) as db:  # every measurement taken, library variants included
            stored = db.execute("SELECT COUNT(*) FROM measurements").fetchone()[0]
        measured[layers] = (report.measured, stored)
        rows[layers] = list(report.layers["layers"])
        assert len(report.plan.layers) == layers + 1
    assert measured[1][0] > 0 and measured[1] == measured[2] == measured[3]  # the repeated layer costs one tuning
    assert sorted(rows[3]) == [1, 3]


def test_resnet18_shaped_model_trains_like_the_untuned_one_on_every_kernel(tmp_path, one_thread) -> None:
    torch.manual_seed(0)
    model, x = resnet18_like(width=8), torch.randn(4, 3, 32, 32)
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 20
    tuned, report = autotune_model(model, x, budget_s=10, cache=Cache(tmp_path / "r.db"), progress=False, **TINY)
    assert_same_in_norm(model, tuned, x)
    # every layer (7x7 stride-2 stem, 1x1 inputs with padding, stride-2 1x1 projections) on generated C kernels too
    forced = {}
    for i, (name, _, shape) in enumerate(conv_layers(model, x)):
        assert shape is not None
        params = (
            ("algo", 0),
            ("cb", 64),
            ("kb", 2),
            ("layout", i % 2),
            ("order", 0),
            ("pack", 0),
            ("tb", 4),
            ("unroll", 1),
            ("vec", 4),
            ("wb", 2),
        )
        forced[name] = LayerChoice(shape, "c_direct", params, "nhwc" if i % 2 else "nchw", 1.0)
    generated = apply_plan(copy.deepcopy(model), Plan(forced, "train", report.plan.fingerprint))
    assert sum(isinstance(m, TunedConv2d) for m in generated.modules()) == 20
    assert_same_in_norm(model, generated, x)


def test_train_config_autotune_budget() -> None:
    assert TrainConfig().autotune_budget_s == 60.0
    assert TrainConfig(autotune_budget_s=None).autotune_budget_s is None
    with pytest.raises(ConfigError, match="autotune_budget_s"):
        TrainConfig(autotune_budget_s=0)
    with pytest.raises(ConfigError, match="budget_s must be a positive number"):
        autotune_model(every_kind_of_conv(), torch.randn(1, 3, 16, 16), budget_s=-1, progress=False)


# ---------------------------------------------------------------- measurements carry their spread


def _result(shape: ConvShape, default: list[float], tuned: list[float]):
    from rapydli.autotune.conv import TuneResult

    def measured(candidate: str, times: list[float]) -> Measurement:
        median = sorted(times)[len(times) // 2]
        return Measurement(Config.of(candidate), "ok", median=median, times=times, passes={"forward": median})

    measurements = [measured("torch_nchw", default), measured("torch_channels_last", tuned)]
    return TuneResult(Problem(shape, "inference"), measurements[1], None, measurements, None, None)  # type: ignore[arg-type]


def test_a_layer_speedup_is_reported_only_where_its_range_excludes_1_and_a_share_above_1_is_flagged() -> None:
    from rapydli.autotune.budget import _row

    shape = ConvShape(2, 3, 16, 16, 8, 3, 3, pad=1)
    clear = _row(1, shape, ["c1"], _result(shape, [0.010, 0.011, 0.012], [0.005, 0.0052, 0.0055]), 11.0, 20.0, 2, False)
    assert clear["speedup"] == pytest.approx(0.011 / 0.0052) and clear["speedup_low"] > 1 and not clear["flag"]
    noisy = _row(1, shape, ["c1"], _result(shape, [0.010, 0.011, 0.030], [0.004, 0.0105, 0.012]), 11.0, 20.0, 2, False)
    assert (
        noisy["speedup"] is None and noisy["speedup_low"] < 1 < noisy["speedup_high"]
    )  # no claim the repeats contradict
    # the library default timed at 96 ms for a step of 43 ms: not a share of 2.2, a disturbed measurement
    artefact = _row(
        1, shape, ["c1"], _result(shape, [0.096, 0.097, 0.098], [0.0014, 0.0014, 0.0015]), 96.0, 43.0, 2, False
    )
    assert math.isnan(artefact["share"]) and "share 2.23 > 1 is a measurement artefact" in artefact["flag"]
    assert "cores" in artefact["flag"]
    # a library default still disturbed after being timed again: its clear-looking range claims nothing
    disturbed = _result(shape, [0.010, 0.011, 0.012], [0.005, 0.0052, 0.0055])
    disturbed.measurements[0].disturbed, disturbed.measurements[0].retimed = "its repeats span 10 to 30 ms", 2
    row = _row(1, shape, ["c1"], disturbed, 11.0, 20.0, 2, False)
    assert row["speedup"] is None and "other work disturbed the timing of torch_nchw" in row["flag"]
    assert "timed 3 times" in row["flag"] and "cores" in row["flag"]


def test_autotune_beside_a_cpu_hog_claims_no_speedup_its_repetitions_contradict(tmp_path, one_thread) -> None:
    import subprocess
    import sys

    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        model, x = every_kind_of_conv(), torch.randn(2, 3, 16, 16)
        _, report = autotune_model(model, x, budget_s=20, cache=Cache(tmp_path / "hog.db"), progress=False, **TINY)
    finally:
        hog.kill()
        hog.wait()
    for row in report.layers.to_dict("records"):
        assert not row["share"] > 1, row  # never a result ...
        if isinstance(row.get("flag"), str) and row["flag"]:  # ... but named, with the load
            assert math.isnan(row["share"]) and "cores" in row["flag"]
        if row["speedup"] is not None and not math.isnan(row["speedup"]) and row["speedup"] != 1.0:
            assert row["speedup_low"] > 1 or row["speedup_high"] < 1, row


def test_the_summary_claims_a_whole_model_speedup_only_where_every_round_shows_one() -> None:
    from rapydli.autotune.model import _summary

    def plan(low: float, high: float, rounds: int) -> Plan:
        layers = {"c1": LayerChoice(ConvShape(2, 3, 8, 8, 4, 3, 3, pad=1), "torch_channels_last", (), "nhwc", 1.0)}
        return Plan(
            layers,
            "train",
            "cpu-x",
            {
                "measured_library_nchw": 10.0,
                "measured_planned": 8.0,
                "speedup_low": low,
                "speedup_high": high,
                "speedup_rounds": rounds,
            },
        )

    clear = _summary(plan(1.2, 1.3, 5), 3.0, None, [], False)
    assert "step 10.0 -> 8.0 ms (1.25x, rounds 1.20 to 1.30, planned)" in clear
    noisy = _summary(plan(0.9, 1.4, 5), 3.0, None, [], False)
    assert "not shown faster than the library default (the rounds span 0.90x to 1.40x" in noisy and "1.25x" not in noisy
    assert "load" in noisy and "cores" in noisy
    assert "one timed round" in _summary(plan(1.25, 1.25, 1), 3.0, None, [], False)


def test_a_shape_whose_slice_the_budget_refuses_entirely_stays_on_the_library_and_the_rest_are_tuned(
    tmp_path, one_thread, monkeypatch
) -> None:
    """On a busy machine the earlier slices can run late enough that a shape's search measures nothing: it is skipped, not an error."""
    from rapydli.autotune import budget

    real, refused = budget.tune_conv2d, []

    def refuse_the_first_search(shape, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("admit") is not None and not refused:
            refused.append(shape)
            kwargs["admit"] = lambda chunk: False  # as a deadline already past would, with nothing of it in the cache
            kwargs["cache"] = Cache(tmp_path / "empty.db")
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(budget, "tune_conv2d", refuse_the_first_search)
    torch.manual_seed(0)
    model, x = resnet18_like(width=8), torch.randn(4, 3, 32, 32)  # batch 4: see the test of the budget above
    tuned, report = autotune_model(model, x, budget_s=60.0, cache=Cache(tmp_path / "r.db"), progress=False, **TINY)
    rows = report.layers.set_index("shape")
    assert refused and rows.loc[refused[0].text, "status"] == "skipped: budget"
    assert (rows["status"] == "tuned").sum() == len(rows) - 1  # every other shape was searched
    assert_same_in_norm(model, tuned, x)
