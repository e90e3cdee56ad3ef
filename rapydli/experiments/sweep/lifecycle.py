"""A sweep trial's one lifecycle: Optuna's states, and the run-store status each is recorded as.

A trial is ``RUNNING`` until the sweep tells Optuna how it ended: ``COMPLETE`` (it ran
every step and reported a finite value), ``PRUNED`` (the pruner stopped it; it stopped
on all its ranks within one step of the decision) or ``FAIL`` (it raised, reported no
finite value, or was stopped with the sweep before its last step). The sweep records
that state once, as the trial run's status in the store (:data:`STORE_STATUS`); the
sweep's table, ``rapydli runs``, the REST routes and the panels all read it from there or
from the sweep (:func:`state_of`), so they agree.

Examples
--------
>>> STORE_STATUS["PRUNED"], state_of("finished"), state_of("interrupted")
('pruned', 'COMPLETE', 'FAIL')
"""

from __future__ import annotations

from typing import Any, Literal

TrialState = Literal["RUNNING", "COMPLETE", "PRUNED", "FAIL"]

#: Every state, in lifecycle order.
STATES: tuple[TrialState, ...] = ("RUNNING", "COMPLETE", "PRUNED", "FAIL")

#: The run-store status of a trial run in each state.
STORE_STATUS: dict[str, str] = {"RUNNING": "running", "COMPLETE": "finished", "PRUNED": "pruned", "FAIL": "failed"}

_FROM_STATUS = {status: state for state, status in STORE_STATUS.items()}


def state_of(status: str) -> str:
    """The trial state a trial run's store ``status`` records (a run that ended any other way,
    ``interrupted`` in stores written before the sweep recorded states, is ``FAIL``)."""
    return _FROM_STATUS.get(status, "FAIL")


def optuna_state(state: str) -> Any:
    """Optuna's ``TrialState`` for a finished ``state`` (COMPLETE, PRUNED or FAIL)."""
    import optuna

    return {
        "COMPLETE": optuna.trial.TrialState.COMPLETE,
        "PRUNED": optuna.trial.TrialState.PRUNED,
        "FAIL": optuna.trial.TrialState.FAIL,
    }[state]
