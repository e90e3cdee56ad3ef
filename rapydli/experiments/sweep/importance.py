"""Parameter importance of a recorded sweep, computed by Optuna's own evaluator.

The sweep's Optuna study lives only while ``rd.sweep`` runs; what stays is the run store:
each trial's sampled parameters, state and final metric. :func:`param_importance`
rebuilds a study from the completed trials (Optuna's ``create_trial``) and asks
:func:`optuna.importance.get_param_importances` with a seeded fANOVA evaluator, so the
answer is the same on every call.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

#: Fewest completed trials before importance is computed (fANOVA on fewer says little).
MIN_TRIALS = 5


def param_importance(
    trials: Sequence[Mapping[str, Any]], direction: str = "minimize", min_trials: int = MIN_TRIALS
) -> tuple[dict[str, float] | None, str]:
    """Importance of each varied parameter, and a sentence saying what it rests on.

    Parameters
    ----------
    trials
        Dicts with ``params`` (the sampled values), ``state`` (``COMPLETE`` counts) and
        ``value`` (the final metric, a finite number).
    direction
        ``minimize`` or ``maximize``.
    min_trials
        Fewest completed trials needed; below it the result is ``None``.

    Returns
    -------
    (dict or None, str)
        ``{param: importance}`` summing to 1, most important first (``None`` when there
        are too few completed trials or fewer than two varied parameters), and the reason.
    """
    done = [
        t
        for t in trials
        if t.get("state") == "COMPLETE" and isinstance(t.get("value"), (int, float)) and math.isfinite(t["value"])
    ]
    if len(done) < min_trials:
        return None, f"parameter importance needs {min_trials} completed trials; this sweep has {len(done)}"
    import optuna
    from optuna.distributions import CategoricalDistribution, FloatDistribution

    names = sorted({k for t in done for k in t["params"]})
    distributions: dict[str, Any] = {}
    for name in names:
        values = [t["params"].get(name) for t in done]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            low, high = float(min(values)), float(max(values))
            if low < high:
                distributions[name] = FloatDistribution(low, high)
        elif len({repr(v) for v in values}) > 1:
            distributions[name] = CategoricalDistribution(sorted({str(v) for v in values}))
    if len(distributions) < 2:
        return None, "parameter importance needs at least two parameters that vary across completed trials"
    study = optuna.create_study(direction="maximize" if direction == "maximize" else "minimize")
    for t in done:
        params = {
            name: (float(t["params"][name]) if isinstance(dist, FloatDistribution) else str(t["params"][name]))
            for name, dist in distributions.items()
            if name in t["params"]
        }
        if len(params) != len(distributions):
            continue
        study.add_trial(optuna.trial.create_trial(params=params, distributions=distributions, value=float(t["value"])))
    evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
    importances = optuna.importance.get_param_importances(study, evaluator=evaluator)
    return {k: float(v) for k, v in importances.items()}, f"fANOVA (Optuna) over {len(study.trials)} completed trials"
