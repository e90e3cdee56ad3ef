"""``rd.runs()`` and ``rd.run(id)``: the run store as pandas tables (exported from
:mod:`rapydli.experiments.store.runstore`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rapydli.experiments.store import runstore as store_mod

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


def setup_text(setup_s: Mapping[str, float]) -> str:
    """A run's ``setup_s`` record as one line, phases in the order they ran.

    >>> setup_text({"engines ready": 1.25, "model and data": 0.5})
    'set-up 1.8 s before the first step: engines ready 1.2 s, model and data 0.5 s'
    """
    phases = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in setup_s.items())
    return f"set-up {sum(setup_s.values()):.1f} s before the first step: {phases}"


def _iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + "Z"


@dataclass
class RunRecord:
    """One recorded run as returned by :func:`run`.

    Attributes
    ----------
    info
        Everything :meth:`RunStore.get_run` returns (id, kind, status, times, host, versions...).
    params
        The parameters it ran with.
    metrics
        DataFrame with columns step, name, value, time (one row per logged value).
    artifacts
        DataFrame with columns path, kind, time.
    records
        Values recorded with :func:`rapydli.record`, by name (tables as lists of row dicts,
        figures as plotly JSON dicts).
    """

    info: dict[str, Any]
    params: dict[str, Any]
    metrics: pd.DataFrame
    artifacts: pd.DataFrame
    records: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.info["id"]

    @property
    def status(self) -> str:
        return self.info["status"]

    def history(self) -> pd.DataFrame:
        """Metrics pivoted to one row per step and one column per metric name."""
        if self.metrics.empty:
            return self.metrics
        return self.metrics.pivot_table(index="step", columns="name", values="value", aggfunc="last")

    def __repr__(self) -> str:
        return (
            f"RunRecord(id={self.id!r}, kind={self.info['kind']!r}, name={self.info['name']!r}, "
            f"status={self.status!r}, params={self.params!r}, metrics={len(self.metrics)} rows, "
            f"artifacts={len(self.artifacts)}, records={sorted(self.records)})"
        )


RUN_COLUMNS = [
    "id",
    "kind",
    "name",
    "status",
    "parent",
    "started",
    "ended",
    "duration",
    "world_size",
    "seed",
    "host",
    "params",
    "error",
]


def runs(kind: str | None = None, status: str | None = None) -> pd.DataFrame:
    """All recorded runs, newest first, as a DataFrame.

    Parameters
    ----------
    kind
        Only runs of this kind (train, sweep, trial, scaling, batch, tune).
    status
        Only runs with this status (running, finished, failed, interrupted).

    Returns
    -------
    pandas.DataFrame
        Columns id, kind, name, status, parent, started, ended (UTC timestamps), duration
        (seconds), world_size, seed, host, params (dict), error.

    Examples
    --------
    >>> import rapydli as rd
    >>> rd.runs(kind="train", status="finished").head()  # doctest: +SKIP
    """
    import pandas as pd

    rows, _ = store_mod.require_store().list_runs(kind=kind, status=status)
    frame = pd.DataFrame(rows, columns=RUN_COLUMNS) if rows else pd.DataFrame(columns=RUN_COLUMNS)
    for column in ("started", "ended"):
        frame[column] = pd.to_datetime(frame[column], unit="s", utc=True)
    return frame[RUN_COLUMNS]


def run(run_id: str) -> RunRecord:
    """One recorded run: parameters, metrics (DataFrame), artifacts and recorded values.

    ``run_id`` may be a unique prefix of the id. Raises :class:`NotFoundError` for an unknown id.

    Examples
    --------
    >>> r = rd.run("3f2a9c")  # doctest: +SKIP
    >>> r.params["lr"], r.history()["loss"].iloc[-1]  # doctest: +SKIP
    """
    import pandas as pd

    store = store_mod.require_store()
    info = store.get_run(store.resolve(run_id))
    metrics = pd.DataFrame(store.metrics(info["id"]), columns=["seq", "step", "name", "value", "time"])
    artifacts = pd.DataFrame(store.artifacts(info["id"]), columns=["path", "kind", "time"])
    records = {name: rec["value"] for name, rec in store.records(info["id"]).items()}
    return RunRecord(
        info=info, params=info["params"], metrics=metrics.drop(columns="seq"), artifacts=artifacts, records=records
    )


def iso_times(run_dict: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a run dict with started/ended/heartbeat as ISO-8601 UTC text (for JSON output)."""
    out = dict(run_dict)
    for key in ("started", "ended", "heartbeat"):
        if key in out:
            out[key] = _iso(out[key])
    return out
