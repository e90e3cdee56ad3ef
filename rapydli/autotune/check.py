"""The whole-model check: time whole steps of a plan and of its library alternatives, keep the fastest.

Per-layer times miss what happens between convolutions (batch norm, residual adds, layout
changes), so :func:`verified` times whole-model steps of the per-layer plan, of the
all-NCHW and all-channels-last library plans, of the plan without per-pass splits and of
the plan with its small gains put back on the library, in interleaved rounds, and keeps
the fastest: a tuned model is never slower than the library, as measured.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Mapping

import torch
from torch import nn

from rapydli.autotune.conv import TuneResult
from rapydli.autotune.model import LayerChoice, Plan, apply_plan, in_layout
from rapydli.autotune.problem import ConvShape
from rapydli.spread import paired

LIBRARY_OF_LAYOUT = {"nchw": "torch_nchw", "nhwc": "torch_channels_last"}


def _library_choice(choice: LayerChoice, results: Mapping[ConvShape, TuneResult], layout: str) -> LayerChoice:
    """``choice``'s layer on ``layout``'s library candidate.

    Its time is the candidate's measured one: the median when it was timed, the one timed run
    when it was abandoned as slow, infinite when it was not measured (the search left it out).
    """
    library = LIBRARY_OF_LAYOUT[layout]
    m = results[choice.shape].best_of(lambda c: c.candidate == library)
    if m is None:
        runs = [r.median for r in results[choice.shape].measurements if r.config.candidate == library and r.median]
        time_ms = min(runs) * 1e3 if runs else math.inf
    else:
        assert m.median is not None  # best_of keeps timed measurements only
        time_ms = m.median * 1e3
    return LayerChoice(choice.shape, library, (), layout, time_ms, choice.default_ms)


def _library_plan(plan: Plan, results: Mapping[ConvShape, TuneResult], layout: str) -> Plan:
    """Every layer of ``plan`` on ``layout``'s library candidate."""
    layers = {name: _library_choice(choice, results, layout) for name, choice in plan.layers.items()}
    return Plan(layers, plan.mode, plan.fingerprint, dict(plan.estimates_ms))


def _whole_plan(plan: Plan, results: Mapping[ConvShape, TuneResult]) -> Plan:
    """``plan`` with every layer on the one configuration fastest over all its passes (no split)."""
    layers = {}
    for name, choice in plan.layers.items():
        m = results[choice.shape].best_of(in_layout(choice.layout))
        assert m is not None and m.median is not None  # the plan chose this layout from a timed measurement
        layers[name] = LayerChoice(
            choice.shape, m.config.candidate, m.config.params, choice.layout, m.median * 1e3, choice.default_ms
        )
    return Plan(layers, plan.mode, plan.fingerprint, dict(plan.estimates_ms))


MARGINS = (1.1, 1.25)  # planned/library time ratios below which the whole-model check also tries the library
# interleaved rounds of the whole-model check: with 5 the bottleneck stack's fastest of the planned and library
# plans flipped between two checks of one tuning (planned_1.25x vs library_nhwc: 84.7 vs 82.3 ms, then 79.3 vs 84.0)
CHECK_REPS = 10
CHECK_SLOWER = 1.5  # how much slower than the untuned step a plan's step is assumed to be when sizing the check


def _library_unless_faster(plan: Plan, results: Mapping[ConvShape, TuneResult], margin: float) -> Plan:
    """``plan`` with every layer not at least ``margin`` x faster than its layout's library candidate put back on it."""
    layers = {}
    for name, choice in plan.layers.items():
        library = _library_choice(choice, results, choice.layout)
        layers[name] = library if library.time_ms < margin * choice.time_ms else choice
    return Plan(layers, plan.mode, plan.fingerprint, dict(plan.estimates_ms))


def _one_step(model: nn.Module, x: torch.Tensor, mode: str) -> float:
    """Seconds of one step; on a GPU the kernels it queued are waited for before and after."""
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    if mode == "train":
        model.zero_grad(set_to_none=True)
        model(x).float().sum().backward()
    else:
        with torch.no_grad():
            model(x)
    sync()
    return time.perf_counter() - start


def step_rounds(
    models: Mapping[str, nn.Module], x: torch.Tensor, mode: str, reps: int = 3, deadline: float | None = None
) -> dict[str, list[float]]:
    """Ms of one forward (+ backward in train mode) of each model in each of ``reps`` interleaved rounds.

    Interleaving (A, B, C, A, B, C, ...) after two warm-up rounds keeps a drifting machine load
    from favouring whichever model happens to be timed last, and pairs the models round by
    round (:func:`rapydli.spread.paired`). With a ``deadline`` (``time.monotonic()``) there
    is one warm-up round, and no round after the first timed one starts unless a round as long
    as the last one ends before it.
    """
    for model in models.values():
        model.train(mode == "train")
    for _ in range(2 if deadline is None else 1):  # warm-up: oneDNN primitives, allocator, kernel loading
        for model in models.values():
            _one_step(model, x, mode)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(reps):
        if round_ and deadline is not None and time.monotonic() + sum(t[-1] for t in times.values()) / 1e3 > deadline:
            break
        for name, model in models.items():
            times[name].append(_one_step(model, x, mode) * 1e3)
    return times


def compare_steps(
    models: Mapping[str, nn.Module], x: torch.Tensor, mode: str, reps: int = 3, deadline: float | None = None
) -> dict[str, float]:
    """Fastest ms of one forward (+ backward in train mode) of each model over interleaved rounds
    (:func:`step_rounds`): the least disturbed step on a shared machine."""
    return {name: min(t) for name, t in step_rounds(models, x, mode, reps, deadline).items()}


def model_step_ms(model: nn.Module, x: torch.Tensor, mode: str, reps: int = 3, deadline: float | None = None) -> float:
    """Fastest ms of one forward (+ backward in train mode) of ``model`` on ``x`` (see :func:`compare_steps`)."""
    return compare_steps({"model": model}, x, mode, reps, deadline)["model"]


def verified(
    model: nn.Module,
    x: torch.Tensor,
    plan: Plan,
    results: Mapping[ConvShape, TuneResult],
    reps: int = CHECK_REPS,
    deadline: float | None = None,
    step_ms: float | None = None,
) -> Plan:
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

    With a ``deadline`` the per-layer plan and the two library plans are always timed (a
    warm-up round and one timed round: what makes a tuned model never slower than the
    library); the other plans only when, at ``step_ms`` per step (x :data:`CHECK_SLOWER`),
    their two rounds fit before it too.
    """
    options = {
        "planned": plan,
        "library_nchw": _library_plan(plan, results, "nchw"),
        "library_nhwc": _library_plan(plan, results, "nhwc"),
    }
    extra: dict[str, Plan] = {}
    whole = _whole_plan(plan, results)
    if whole.layers != plan.layers:
        extra["planned_whole"] = whole
    for margin in MARGINS:
        mixed = _library_unless_faster(plan, results, margin)
        if all(mixed.layers != other.layers for other in [*options.values(), *extra.values()]):
            extra[f"planned_{margin:g}x"] = mixed
    if deadline is not None:  # two rounds (warm-up, one timed) of every plan must fit, or the extra ones are left out
        step_s = (step_ms if step_ms is not None else 0.0) * CHECK_SLOWER / 1e3
        if step_ms is None or time.monotonic() + 2 * (len(options) + len(extra)) * step_s > deadline:
            extra = {}
    options.update(extra)
    twins = {name: next(n for n, o in options.items() if o.layers == p.layers) for name, p in options.items()}
    timed = {name: apply_plan(copy.deepcopy(model), p) for name, p in options.items() if twins[name] == name}
    rounds = step_rounds(timed, x, plan.mode, reps=reps, deadline=deadline)
    measured = {name: min(rounds[twins[name]]) for name in options}  # a plan equal to an earlier one is timed once
    chosen = min(measured, key=lambda name: measured[name])
    best = options[chosen]
    # the library default's step over the chosen plan's, round by round: the speedup's interval
    ratio = paired(rounds[twins["library_nchw"]], rounds[twins[chosen]])
    best.estimates_ms = {
        **plan.estimates_ms,
        **{f"measured_{k}": v for k, v in measured.items()},
        "speedup_low": ratio.low,
        "speedup_high": ratio.high,
        "speedup_rounds": float(ratio.n),
    }
    best.chosen = chosen
    return best
