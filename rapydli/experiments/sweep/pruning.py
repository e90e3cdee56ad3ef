"""Why Optuna's pruner stopped a trial: the step, the value it saw and what it compared that with.

Optuna's pruners answer only yes or no (``Trial.should_prune``). Right after a yes,
:func:`explain_prune` reads from the study what the pruner compared, the way the pruner
reads it (completed trials' intermediate values; the rung values
``SuccessiveHalvingPruner`` keeps in each trial's system attributes), and returns it as a
JSON-ready dict that the sweep stores with the trial (record ``prune``) and the panel
shows. Explainers are looked up by the pruner's class (or a base class) in
:data:`EXPLAINERS`; any other pruner is explained by the step and the value alone.

Examples
--------
>>> explain_prune(study, 3, pruner, "val_loss", 5, 2.31)["text"]  # doctest: +SKIP
'pruned at step 5 with val_loss 2.31: rung 0 keeps the best 1 of 3 trials (val_loss ≤ 0.518)'
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

#: SuccessiveHalvingPruner's system attribute holding a trial's value at rung ``r``.
RUNG_KEY = "completed_rung_{}"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _maximize(study: Any) -> bool:
    import optuna

    return bool(study.direction == optuna.study.StudyDirection.MAXIMIZE)


def _successive_halving(study: Any, trial: Any, pruner: Any, metric: str, step: int, value: float) -> dict[str, Any]:
    """The rung the trial reached, and the worst value that rung lets go on (its cut-off)."""
    rung = 0
    while RUNG_KEY.format(rung + 1) in trial.system_attrs:
        rung += 1
    key = RUNG_KEY.format(rung)
    if key not in trial.system_attrs:  # pruned before recording the rung: its value was NaN
        return {"rule": f"a {metric} that is not a number is pruned at once"}
    competing = sorted(float(t.system_attrs[key]) for t in study.get_trials(deepcopy=False) if key in t.system_attrs)
    keep = max(1, len(competing) // int(getattr(pruner, "_reduction_factor", 4)))
    cutoff = competing[-keep] if _maximize(study) else competing[keep - 1]
    sign = "≥" if _maximize(study) else "≤"
    return {
        "compared_to": _finite(cutoff),
        "rung": rung,
        "competing": len(competing),
        "rule": f"rung {rung} keeps the best {keep} of {len(competing)} trials ({metric} {sign} {_num(_finite(cutoff))})",
    }


def _percentile(study: Any, trial: Any, pruner: Any, metric: str, step: int, value: float) -> dict[str, Any]:
    """The trial's best value so far against the percentile of the completed trials at this step."""
    import numpy as np
    import optuna

    maximize = _maximize(study)
    mine = [v for v in trial.intermediate_values.values() if isinstance(v, (int, float))]
    best = (np.nanmax(mine) if maximize else np.nanmin(mine)) if mine and not all(map(math.isnan, mine)) else math.nan
    if math.isnan(best):
        return {"rule": f"a {metric} that is not a number is pruned at once"}
    completed = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    others = [t.intermediate_values[step] for t in completed if step in t.intermediate_values]
    percentile = float(getattr(pruner, "_percentile", 50.0))
    if not others:
        return {"best_so_far": _finite(best)}
    cut = float(np.nanpercentile(np.array(others, dtype=float), 100 - percentile if maximize else percentile))
    what = "the median" if percentile == 50.0 else f"the {percentile:g}th percentile"
    return {
        "best_so_far": _finite(best),
        "compared_to": _finite(cut),
        "competing": len(others),
        "rule": f"its best {metric} {_num(_finite(best))} is {'below' if maximize else 'above'} {what} "
        f"{_num(_finite(cut))} of {len(others)} completed trials at step {step}",
    }


#: Pruner class name -> ``f(study, frozen_trial, pruner, metric, step, value) -> details``.
EXPLAINERS: dict[str, Callable[..., dict[str, Any]]] = {
    "SuccessiveHalvingPruner": _successive_halving,
    "PercentilePruner": _percentile,  # MedianPruner is a PercentilePruner at 50
}


def explain_prune(study: Any, number: int, pruner: Any, metric: str, step: int, value: float) -> dict[str, Any]:
    """What the pruner saw when it pruned trial ``number`` at ``step``.

    Parameters
    ----------
    study, pruner
        The Optuna study and its pruner.
    number
        The pruned trial's number.
    metric, step, value
        The reported metric's name, and the step and value of the report that was pruned.

    Returns
    -------
    dict
        ``pruner`` (its class name), ``metric``, ``step``, ``value`` (None when not finite),
        ``compared_to`` (the bar it missed, when the pruner has one), ``rule`` (that
        comparison in words, or None) and ``text``: "pruned at step S with M V: rule".
    """
    frozen = next((t for t in study.get_trials(deepcopy=False) if t.number == number), None)
    details: dict[str, Any] = {}
    explain = next((EXPLAINERS[c.__name__] for c in type(pruner).__mro__ if c.__name__ in EXPLAINERS), None)
    if explain is not None and frozen is not None:
        details = explain(study, frozen, pruner, metric, step, value)
    decision = {
        "pruner": type(pruner).__name__,
        "metric": metric,
        "step": int(step),
        "value": _finite(value),
        "compared_to": None,
        "rule": None,
        **details,
    }
    shown = _num(decision["value"]) if decision["value"] is not None else str(value)
    decision["text"] = f"pruned at step {step} with {metric} {shown}" + (
        f": {decision['rule']}" if decision["rule"] else ""
    )
    return decision
