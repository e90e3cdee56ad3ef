"""rapydli.experiments.sweep.pruning: what Optuna's pruner compared, read back right after it pruned.

Real Optuna studies and pruners, driven by the ask-and-tell calls a sweep makes
(``report``, ``should_prune``, ``tell``); no cluster is needed for the pruner's side.
"""

from __future__ import annotations

import math

import optuna
import pytest

from rapydli.experiments.sweep.pruning import explain_prune

optuna.logging.set_verbosity(optuna.logging.WARNING)


def run_trial(study: optuna.Study, reports: list[tuple[int, float]]) -> tuple[optuna.Trial, int | None]:
    """Report ``reports`` until the pruner says stop; tell the outcome; return the trial and the step it was pruned at."""
    trial = study.ask()
    for step, value in reports:
        trial.report(value, step)
        if trial.should_prune():
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return trial, step
    study.tell(trial, reports[-1][1])
    return trial, None


@pytest.mark.parametrize("direction, good, bad", [("minimize", 1.0, 3.0), ("maximize", 0.9, 0.2)])
def test_successive_halving_names_the_rung_and_its_cutoff(direction: str, good: float, bad: float) -> None:
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1, reduction_factor=2)
    study = optuna.create_study(direction=direction, pruner=pruner)
    run_trial(study, [(5, good), (10, good)])
    run_trial(
        study, [(5, good * 0.99 if direction == "maximize" else good * 1.01), (10, good)]
    )  # may be pruned: no matter
    trial, step = run_trial(study, [(5, bad), (10, bad)])
    assert step == 5
    decision = explain_prune(study, trial.number, pruner, "val_loss", 5, bad)
    values = sorted(t.system_attrs["completed_rung_0"] for t in study.trials)  # what the pruner compared at rung 0
    keep = len(values) // 2
    cutoff = values[-keep] if direction == "maximize" else values[keep - 1]
    assert decision["step"] == 5 and decision["value"] == bad and decision["rung"] == 0
    assert decision["compared_to"] == pytest.approx(cutoff) and decision["competing"] == 3
    sign = "≥" if direction == "maximize" else "≤"
    assert (
        decision["text"]
        == f"pruned at step 5 with val_loss {bad:.4g}: rung 0 keeps the best 1 of 3 trials (val_loss {sign} {cutoff:.4g})"
    )
    # and the bar is one the pruned value misses
    assert (bad < cutoff) if direction == "maximize" else (bad > cutoff)


def test_a_value_that_is_not_a_number_is_said_so() -> None:
    pruner = optuna.pruners.SuccessiveHalvingPruner(min_resource=1)
    study = optuna.create_study(pruner=pruner)
    trial, step = run_trial(study, [(5, math.nan)])
    assert step == 5
    decision = explain_prune(study, trial.number, pruner, "val_loss", 5, math.nan)
    assert decision["value"] is None and decision["compared_to"] is None
    assert decision["text"] == "pruned at step 5 with val_loss nan: a val_loss that is not a number is pruned at once"


def test_median_pruner_compares_the_best_so_far_with_the_median_at_that_step() -> None:
    pruner = optuna.pruners.MedianPruner(n_startup_trials=2)
    study = optuna.create_study(pruner=pruner)
    run_trial(study, [(5, 1.0), (10, 0.5)])
    run_trial(study, [(5, 2.0), (10, 1.0)])
    trial, step = run_trial(study, [(5, 1.2), (10, 1.1)])  # at step 10: best so far 1.1 > median 0.75
    assert step == 10
    decision = explain_prune(study, trial.number, pruner, "val_loss", 10, 1.1)
    assert decision["pruner"] == "MedianPruner" and decision["best_so_far"] == pytest.approx(1.1)
    assert decision["compared_to"] == pytest.approx(0.75) and decision["competing"] == 2
    assert (
        decision["text"]
        == "pruned at step 10 with val_loss 1.1: its best val_loss 1.1 is above the median 0.75 of 2 completed trials at step 10"
    )


def test_another_pruner_is_explained_by_its_step_and_value() -> None:
    pruner = optuna.pruners.ThresholdPruner(upper=1.0)
    study = optuna.create_study(pruner=pruner)
    trial, step = run_trial(study, [(3, 0.5), (4, 2.5)])
    assert step == 4
    decision = explain_prune(study, trial.number, pruner, "loss", 4, 2.5)
    assert decision == {
        "pruner": "ThresholdPruner",
        "metric": "loss",
        "step": 4,
        "value": 2.5,
        "compared_to": None,
        "rule": None,
        "text": "pruned at step 4 with loss 2.5",
    }
