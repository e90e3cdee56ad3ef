"""Recorded runs to a tracker after the fact: ``rapydli runs export --to mlflow|tensorboard|wandb RUN...``.

Each run goes through the same :class:`~rapydli.experiments.trackers.sync.RunSync` as live
logging, to completion. A sweep, batch or scaling study goes with its children (trials,
items, points, and their own children), each after its parent, so they land as the
tracker's family of runs: MLflow nested runs, one W&B group, TensorBoard folders inside the
parent's. Exporting is idempotent: a run already linked to a tracker run
(its ``tracker.<name>`` record, from live logging or an earlier export) updates that
tracker run, and MLflow keeps one copy of an identical metric point, TensorBoard's events
are rewritten, and W&B resumes the run of the same id; a run with no link yet gets a new
tracker run, and its link is recorded.

Examples
--------
>>> export_runs(open_store(), ["3f2a9c81d0b4"], "mlflow")  # doctest: +SKIP
[{'run_id': '3f2a9c81d0b4', 'id': 'a81c...', 'url': 'http://127.0.0.1:5000/#/experiments/1/runs/a81c...'}]
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from rapydli.experiments.trackers.base import Tracker
from rapydli.experiments.trackers.sync import RunSync
from rapydli.registry import TRACKERS

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.experiments.store.runstore import RunStore


def export_runs(store: RunStore, run_ids: Iterable[str], tracker: str) -> list[dict[str, Any]]:
    """Log each of ``run_ids`` (as stored now), each followed by its children, to ``tracker``; their links, with ``run_id`` added.

    A run is exported once however often it is named (directly, or as a child of a named run).

    Raises
    ------
    ConfigError
        ``tracker`` is not a registered tracker.
    TrackerUnavailable
        Its package is not installed.
    """
    kind: type[Tracker] = TRACKERS.load(TRACKERS.check(tracker))
    kind.require()
    done: list[dict[str, Any]] = []
    seen: set[str] = set()
    pending = list(run_ids)[::-1]  # a stack: each run, then its children, in the order named
    while pending:
        run_id = pending.pop()
        if run_id in seen:
            continue
        seen.add(run_id)
        sync = RunSync(store, run_id, kind())
        try:
            sync.push(final=True)
        finally:
            sync.tracker.close()
        done.append({"run_id": run_id, **(sync.link or {})})
        children, _ = store.list_runs(parent=run_id)
        pending.extend(child["id"] for child in children)  # newest first: popped oldest first
    return done
