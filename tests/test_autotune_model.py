"""autotune_model / plan_for / apply_plan: tuned models compute what the original computes."""

from __future__ import annotations

import copy
import pickle
from dataclasses import replace

import pytest
import torch
from torch import nn

from rapydli.autotune.cache import Cache
from rapydli.autotune.candidates import get
from rapydli.autotune.check import MARGINS
from rapydli.autotune.model import (
    Plan,
    TunedConv2d,
    apply_plan,
    autotune_model,
    conv_layers,
    plan_for,
)
from rapydli.autotune.search import Config
from rapydli.errors import ConfigError

TUNE = {
    "preset": "tiny",
    "repetitions": 1,
    "candidates": ["torch_nchw", "torch_channels_last", "im2col_gemm", "c_direct"],
}


def small_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, stride=2, padding=1, bias=False),
        nn.ReLU(),
        nn.Conv2d(8, 4, 1),
        nn.ReLU(),
        nn.Conv2d(4, 4, 3, padding=1, padding_mode="reflect"),  # reflect padding: left as it is
        nn.Conv2d(4, 4, 3, padding=1),  # same shape as nothing else
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def outputs_and_grads(model: nn.Module, x: torch.Tensor):
    model.train()
    model.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    out = model(x)
    out.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), x.grad, grads


def assert_same(model_a: nn.Module, model_b: nn.Module, x: torch.Tensor) -> None:
    out_a, gx_a, g_a = outputs_and_grads(model_a, x)
    out_b, gx_b, g_b = outputs_and_grads(model_b, x)
    torch.testing.assert_close(out_b, out_a, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gx_b, gx_a, rtol=1e-4, atol=1e-5)
    assert g_a.keys() == g_b.keys()
    for name in g_a:
        torch.testing.assert_close(g_b[name], g_a[name], rtol=1e-4, atol=1e-4, msg=name)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    model = small_net()
    x = torch.randn(4, 3, 12, 12)
    tuned_model, report = autotune_model(
        model, x, mode="train", cache=Cache(tmp_path_factory.mktemp("c") / "m.db"), **TUNE
    )
    return model, x, tuned_model, report


def test_hooks_find_every_conv_in_order_with_its_input_shape() -> None:
    layers = conv_layers(small_net(), torch.randn(2, 3, 12, 12))
    assert [name for name, _, _ in layers] == ["0", "3", "5", "7", "8"]
    shapes = {name: shape for name, _, shape in layers}
    assert shapes["3"].h == 12 and shapes["3"].stride == 2 and shapes["5"].h == 6
    assert shapes["7"] is None  # reflect padding is not tunable


def test_autotune_model_keeps_outputs_and_gradients(tuned) -> None:
    model, x, tuned_model, report = tuned
    wrapped = {name for name, m in tuned_model.named_modules() if isinstance(m, TunedConv2d)}
    # a layer planned on the library default stays the plain nn.Conv2d: no wrapper cost
    assert wrapped == {name for name, choice in report.plan.layers.items() if not choice.is_library_default}
    assert len(report.plan.layers) == 4 and all(
        type(tuned_model.get_submodule(n)) is nn.Conv2d for n in set(report.plan.layers) - wrapped
    )
    assert not any(isinstance(m, TunedConv2d) for m in model.modules())  # the original is untouched
    assert model.state_dict().keys() == tuned_model.state_dict().keys()
    assert_same(model, tuned_model, x)
    assert list(report.table["layer"]) == ["0", "3", "5", "8"]
    required = {
        "planned",
        "all_nchw",
        "all_nhwc",
        "default",
        "measured_planned",
        "measured_library_nchw",
        "measured_library_nhwc",
    }
    # the check also times the whole-model plan and, when it differs, the plan with the small gains put back on the library
    assert required <= set(report.estimates_ms) and set(report.estimates_ms) - required <= {
        "measured_planned_whole",
        *(f"measured_planned_{margin:g}x" for margin in MARGINS),  # which of them differ depends on the timings
        "speedup_low",
        "speedup_high",
        "speedup_rounds",
    }
    # the whole-model plan kept is the fastest measured one
    measured = {k: v for k, v in report.estimates_ms.items() if k.startswith("measured_")}
    assert (
        report.estimates_ms["speedup_rounds"] >= 2
    )  # the speedup's interval: the library's step over the chosen one's
    assert report.plan.chosen == min(measured, key=measured.get).removeprefix("measured_")
    assert (
        report.estimates_ms["planned"] <= min(report.estimates_ms["all_nchw"], report.estimates_ms["all_nhwc"]) + 1e-9
    )


def test_plan_pickles_and_applies_identically(tuned) -> None:
    model, x, tuned_model, report = tuned
    plan = pickle.loads(pickle.dumps(report.plan))
    assert isinstance(plan, Plan) and plan.layers == report.plan.layers
    again = apply_plan(copy.deepcopy(model), plan)
    assert [type(m).__name__ for m in again.modules()] == [type(m).__name__ for m in tuned_model.modules()]
    assert_same(model, again, x)
    restored = pickle.loads(pickle.dumps(tuned_model))  # TunedConv2d pickles (instances rebuilt lazily)
    assert_same(model, restored, x)


def test_generated_kernels_inside_a_model_train_like_the_original(tuned) -> None:
    model, x, _, report = tuned
    forced = {}
    for i, (name, choice) in enumerate(report.plan.layers.items()):
        layout = i % 2  # alternate layouts so layout changes between layers are exercised
        params = (("cb", 64), ("kb", 2), ("layout", layout), ("order", 0), ("unroll", 1), ("vec", 4), ("wb", 2))
        forced[name] = replace(
            choice,
            candidate="c_direct",
            params=params,
            layout="nhwc" if layout else "nchw",
            data_grad=None,
            weight_grad=None,
        )
    plan = Plan(forced, "train", report.plan.fingerprint)
    generated = apply_plan(copy.deepcopy(model), plan)
    assert_same(model, generated, x)
    # another batch size than the tuned one still works (shape is read at run time)
    assert_same(model, generated, torch.randn(3, 3, 12, 12))


def test_layers_can_take_each_pass_from_another_configuration(tuned) -> None:
    model, x, _, report = tuned
    c_nhwc = Config.of(
        "c_direct", {"cb": 64, "kb": 2, "layout": 1, "order": 0, "pack": 1, "unroll": 1, "vec": 4, "wb": 2}
    )
    forced = {}
    for name, choice in report.plan.layers.items():
        one_by_one = choice.shape.r == 1 and choice.shape.pad == 0
        forced[name] = replace(
            choice,
            candidate="torch_channels_last",
            params=(),
            layout="nhwc",
            data_grad=c_nhwc,
            weight_grad=Config.of("gemm_1x1") if one_by_one else None,
        )
    plan = Plan(forced, "train", report.plan.fingerprint)
    split = apply_plan(copy.deepcopy(model), plan)
    assert "data_grad=c_direct" in repr(split)
    assert_same(model, split, x)
    # the tuned plan's layer time is the sum of the fastest passes of the layout it chose
    for choice in report.plan.layers.values():
        result = report.results[choice.shape]
        # no single configuration of that layout is faster pass by pass (a run's median total is
        # not the sum of its pass medians, so compare sums of pass medians)
        same_layout = [
            m
            for m in result.measurements
            if m.ok and get(m.config.candidate).layout(m.config.param_dict) == choice.layout
        ]
        assert choice.time_ms <= min(sum(m.passes.values()) for m in same_layout) * 1e3 + 1e-9
        passes = [result.best_of(lambda c, cfg=cfg: c == cfg).passes[p] for p, cfg in choice.configs.items()]
        assert choice.time_ms == pytest.approx(sum(passes) * 1e3)


def test_plan_for_returns_a_plan_and_apply_plan_rejects_foreign_layers(tuned, tmp_path) -> None:
    model, x, _, _ = tuned
    plan = plan_for(model, x, "inference", cache=Cache(tmp_path / "inf.db"), **TUNE)
    assert plan.mode == "inference" and set(plan.layers) == {"0", "3", "5", "8"}
    with pytest.raises(ConfigError, match="does not have"):
        apply_plan(nn.Module(), plan)
    with pytest.raises(ConfigError, match="not an nn.Conv2d"):
        apply_plan(nn.Sequential(nn.Linear(2, 2)), plan)
    with pytest.raises(ConfigError, match="mode must be"):
        plan_for(model, x, "fast")


def _result(shape, times_ms: dict[str, float]):
    from rapydli.autotune.conv import TuneResult
    from rapydli.autotune.runner import Measurement
    from rapydli.autotune.search import Config, Problem

    ms = [Measurement(Config.of(c), "ok", t / 1e3, 0.0, [t / 1e3]) for c, t in times_ms.items()]
    return TuneResult(Problem(shape), min(ms, key=lambda m: m.median), None, ms, None, None)


def test_layout_plan_accounts_for_conversion_cost() -> None:
    from rapydli.autotune.model import _choose_layouts
    from rapydli.autotune.problem import ConvShape

    a, b, c = (ConvShape(1, 2, 4, 4, 2, 1, 1, stride=1, pad=p) for p in (0, 1, 2))
    results = {
        a: _result(a, {"torch_nchw": 1.0, "torch_channels_last": 5.0}),
        b: _result(b, {"torch_nchw": 5.0, "torch_channels_last": 1.0}),  # worth converting
        c: _result(c, {"torch_nchw": 1.0, "torch_channels_last": 0.9999}),  # not worth converting back
    }
    layouts, estimates = _choose_layouts([("a", a), ("b", b), ("c", c)], results, "train", "nchw")
    assert layouts == {"a": "nchw", "b": "nhwc", "c": "nhwc"}
    assert estimates["planned"] < min(estimates["all_nchw"], estimates["all_nhwc"])
    layouts, _ = _choose_layouts([("a", a), ("c", c)], results, "train", "nchw")
    assert layouts == {"a": "nchw", "c": "nchw"}  # 0.0001 ms gain < the conversion it would need


def test_layers_with_small_planned_gains_can_go_back_to_the_library() -> None:
    from rapydli.autotune.check import _library_unless_faster
    from rapydli.autotune.model import LayerChoice, Plan
    from rapydli.autotune.problem import ConvShape

    big, small = ConvShape(1, 2, 4, 4, 2, 3, 3, stride=1, pad=1), ConvShape(1, 2, 4, 4, 2, 1, 1)
    results = {
        big: _result(big, {"torch_channels_last": 3.0, "c_direct": 2.0}),  # 1.5x
        small: _result(small, {"torch_channels_last": 1.05, "c_direct": 1.0}),
    }  # 1.05x
    layers = {"a": LayerChoice(big, "c_direct", (), "nhwc", 2.0), "b": LayerChoice(small, "c_direct", (), "nhwc", 1.0)}
    plan = Plan(layers, "train", "fp")
    mixed = _library_unless_faster(plan, results, 1.1)
    assert mixed.layers["a"] == plan.layers["a"]
    back = mixed.layers["b"]
    assert (back.candidate, back.layout, back.time_ms) == ("torch_channels_last", "nhwc", 1.05)
    assert _library_unless_faster(plan, results, 1.6).layers["a"].candidate == "torch_channels_last"
    assert _library_unless_faster(plan, results, 1.01).layers == plan.layers
