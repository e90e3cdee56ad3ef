"""Bring a tracker's copy of a run up to date with the run store: the one path live logging and export share.

The run store is the truth: :class:`RunSync` reads a run's parameters, metric rows (from
a cursor on), tags, records and artifacts and hands them to one :class:`~.base.Tracker`.
Live logging (:mod:`.follow`) calls :meth:`RunSync.push` every second from its thread;
``rapydli runs export`` calls it once for a recorded run. The tracker run's link (its id
and address) is recorded in the store as the run's ``tracker.<name>`` record, so a later
sync of the same run (a restart, a second export) resumes that tracker run instead of
making another one.

What a tracker receives, from the store:

* parameters: the run's recorded parameters, flattened (``config.lr``, ``model_fn``);
* tags: ``rapydli.run_id``, ``rapydli.kind``, ``rapydli.status``, ``rapydli.host``,
  ``rapydli.git_commit``, the run's hosts by rank (``rapydli.rank1.host``), its restarts
  (``rapydli.restarts``, ``rapydli.resumed_from_step``, and ``rapydli.restart1``... with
  the step, ranks and cause of each; set as soon as the store records one) and its own tags;
* metrics: every metric row at its step; a per-rank timing (``step_time_s@rank1`` in the
  store) as the system metric ``system/rank1/step_time_s``; scalar records at the last step;
* artifacts: the loss figure, the source of code defined in the notebook, the final
  checkpoint's location, and the store's artifact files (notebooks, reports).
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapydli.experiments.trackers.base import Artifact, Point, Tracker

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.experiments.store.runstore import RunStore

#: Metric rows handed to a tracker per call (a long run's export goes in slices of this size).
BATCH_ROWS = 5000
#: Longest parameter value passed on (longer ones are cut, with ``...``).
MAX_PARAM = 500

_RANK_METRIC = re.compile(r"^(?P<name>.+)@rank(?P<rank>\d+)$")
# Tracker runs are opened one at a time in a process: two trials of one sweep (or a trial and
# its sweep) must not both create the sweep's tracker run.
_opening = threading.RLock()


def link_name(tracker: str) -> str:
    """The store record that holds a run's link to its ``tracker`` run (``tracker.mlflow``)."""
    return f"tracker.{tracker}"


def links(store: RunStore, run_id: str) -> dict[str, dict[str, Any]]:
    """The run's tracker links by tracker name (``{"mlflow": {"id": ..., "url": ...}}``)."""
    return {
        name.removeprefix("tracker."): rec["value"]
        for name, rec in store.records(run_id).items()
        if name.startswith("tracker.")
    }


def link_rows(store: RunStore, run_id: str) -> list[dict[str, str | None]]:
    """The run's tracker runs as the panel and ``rapydli runs show`` give them, by tracker name.

    Each row has ``tracker``, ``id`` (the tracker's run id), ``url`` (an ``http(s)`` address:
    MLflow's run page, an online W&B run; else None) and ``path`` (where it is on disk:
    TensorBoard's log dir, an offline W&B run's folder; else None).
    """
    rows: list[dict[str, str | None]] = []
    for name, link in sorted(links(store, run_id).items()):
        url = (
            link.get("url")
            if isinstance(link.get("url"), str) and link["url"].startswith(("http://", "https://"))
            else None
        )
        path = link.get("logdir") or (link.get("dir") if url is None else None)
        rows.append({"tracker": name, "id": str(link.get("id", "")), "url": url, "path": str(path) if path else None})
    return rows


def metric_key(name: str) -> str:
    """The tracker's key of a stored metric: ``step_time_s@rank1`` is ``system/rank1/step_time_s``."""
    match = _RANK_METRIC.match(name)
    return f"system/rank{match['rank']}/{match['name']}" if match else name


def flat_params(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """Recorded parameters as flat text: ``{"config": {"lr": 0.1}}`` is ``{"config.lr": "0.1"}``; sources left out."""
    flat: dict[str, str] = {}
    for key, value in params.items():
        if key == "sources" and not prefix:
            continue  # kept as artifacts
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flat_params(value, name + "."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
        flat[name] = text if len(text) <= MAX_PARAM else text[: MAX_PARAM - 3] + "..."
    return flat


class RunSync:
    """One tracker's copy of one stored run, brought up to date by :meth:`push`.

    Parameters
    ----------
    store
        The run store holding the run.
    run_id
        The RaPyDLI run.
    tracker
        A fresh :class:`~.base.Tracker` (opened on the first push).
    """

    def __init__(self, store: RunStore, run_id: str, tracker: Tracker) -> None:
        self.store, self.run_id, self.tracker = store, run_id, tracker
        self.link: dict[str, Any] | None = None
        self.cursor = -1  # the last metric row (seq) handed on
        self.finished = False
        self.last_step = 0
        self.restarts = 0  # restarts the tracker's tags show

    def push(self, final: bool = False) -> None:
        """Hand on what the store gained since the last push; an ended run (or ``final``) also gets its artifacts and status."""
        run = self.store.get_run(self.run_id)
        if self.link is None:
            self._open(run)
        rows = self.store.metrics(self.run_id, since=self.cursor)
        for start in range(0, len(rows), BATCH_ROWS):
            batch = rows[start : start + BATCH_ROWS]
            points = [
                Point(r["step"], metric_key(r["name"]), r["value"], r["time"]) for r in batch if r["value"] is not None
            ]
            if points:
                self.tracker.log_metrics(points)
            self.cursor = batch[-1]["seq"]
            self.last_step = max(self.last_step, *(r["step"] for r in batch))
        restarts = (
            len(self.store.records(self.run_id).get("restarts", {}).get("value") or []) if run["kind"] == "train" else 0
        )
        if restarts != self.restarts:  # a restart reaches the tracker as it resumes
            self.restarts = restarts
            self.tracker.set_tags(run_tags(self.store, run))
        if (final or run["status"] != "running") and not self.finished:
            self._finish(run)

    def _open(self, run: dict[str, Any]) -> None:
        name = link_name(self.tracker.name)
        with _opening:
            earlier = self.store.records(self.run_id).get(name, {}).get("value")
            parent = _parent_link(self.store, run["parent"], type(self.tracker)) if run["parent"] else None
            self.link = self.tracker.open(run, earlier, parent)
            if self.link != earlier:
                self.store.add_record(self.run_id, name, "json", self.link)
        self.tracker.log_params(flat_params(run["params"]))
        self.tracker.set_tags(run_tags(self.store, run))

    def _finish(self, run: dict[str, Any]) -> None:
        self.tracker.set_tags(run_tags(self.store, run))
        scalars = [
            Point(self.last_step, name, float(rec["value"]), run["ended"] or run["heartbeat"])
            for name, rec in self.store.records(self.run_id).items()
            if rec["type"] == "scalar" and isinstance(rec["value"], (int, float)) and not isinstance(rec["value"], bool)
        ]
        if scalars:
            self.tracker.log_metrics(scalars)
        self.tracker.log_artifacts(run_artifacts(self.store, run))
        if run["status"] != "running":  # a run left open for a restart stays running in the tracker too
            self.tracker.finish(run["status"], run["ended"] or run["heartbeat"])
            self.finished = True


def _parent_link(store: RunStore, parent_id: str, kind: type[Tracker]) -> dict[str, Any] | None:
    """The link of the parent's tracker run, made (with the parent's parameters and tags) if it has none yet."""
    from rapydli.errors import NotFoundError

    with _opening:
        try:
            store.get_run(parent_id)
        except NotFoundError:
            return None
        earlier = store.records(parent_id).get(link_name(kind.name), {}).get("value")
        if earlier is not None:
            return dict(earlier)
        sync = RunSync(store, parent_id, kind())
        try:
            sync.push()
        finally:
            sync.tracker.close()
        return sync.link


def run_tags(store: RunStore, run: Mapping[str, Any]) -> dict[str, str]:
    """The tags a tracker run carries (see the module docstring)."""
    tags = {
        "rapydli.run_id": run["id"],
        "rapydli.kind": run["kind"],
        "rapydli.status": run["status"],
        "rapydli.host": run["host"],
        "rapydli.world_size": str(run["world_size"]),
    }
    if run.get("git_commit"):
        tags["rapydli.git_commit"] = run["git_commit"]
    if run.get("note"):
        tags["rapydli.note"] = run["note"][:5000]
    records = store.records(run["id"])
    hosts = records.get("rank_hosts", {}).get("value") or []
    if not hosts and len(records.get("hosts", {}).get("value") or []) == 1:  # one host: every rank's
        hosts = records["hosts"]["value"] * int(run["world_size"])
    for rank, host in enumerate(hosts):
        tags[f"rapydli.rank{rank}.host"] = str(host)
    tags.update(restart_tags(records.get("restarts", {}).get("value") or []))
    for tag in store.tags(run["id"]):
        tags[tag] = ""
    return tags


def restart_tags(restarts: list[dict[str, Any]]) -> dict[str, str]:
    """Tags of a run's ``restarts`` record: how many, the step the last resumed from, and each one in words.

    >>> restart_tags([{"cause": "rank 1 died", "ranks": [1], "resumed_from_step": 20, "workers": 2}])
    {'rapydli.restarts': '1', 'rapydli.resumed_from_step': '20', 'rapydli.restart1': 'resumed from step 20 on 2 ranks after: rank 1 died'}
    """
    if not restarts:
        return {}
    tags = {"rapydli.restarts": str(len(restarts))}
    resumed = [r["resumed_from_step"] for r in restarts if r.get("resumed_from_step") is not None]
    if resumed:
        tags["rapydli.resumed_from_step"] = str(resumed[-1])
    for number, restart in enumerate(restarts, 1):
        if restart.get("error"):
            text = f"could not restart after: {restart.get('cause')}: {restart['error']}"
        else:
            took = f" ({restart['recovery_s']:g} s later)" if restart.get("recovery_s") is not None else ""
            text = f"resumed from step {restart.get('resumed_from_step')} on {restart.get('workers')} ranks{took} after: {restart.get('cause')}"
        tags[f"rapydli.restart{number}"] = text[:5000]
    return tags


def run_artifacts(store: RunStore, run: Mapping[str, Any]) -> list[Artifact]:
    """The run's figure, recorded sources, checkpoint location and stored files."""
    artifacts: list[Artifact] = []
    rows = store.metrics(run["id"])
    history = [{"kind": "train", "step": r["step"], "loss": r["value"]} for r in rows if r["name"] == "loss"]
    history += [{"kind": "eval", "step": r["step"], "val_loss": r["value"]} for r in rows if r["name"] == "val_loss"]
    if history:
        import pandas as pd

        from rapydli.experiments.figures import loss_figure

        artifacts.append(
            Artifact("figures/loss.html", "figure", figure=loss_figure(pd.DataFrame(history), title=run["name"]))
        )
    for name, source in (run["params"].get("sources") or {}).items():
        artifacts.append(Artifact(f"source/{name}.py", "source", text=str(source)))
    config = run["params"].get("config") or {}
    if isinstance(config, Mapping) and config.get("checkpoint_dir"):
        artifacts.append(Artifact("checkpoint/location.txt", "checkpoint", text=str(config["checkpoint_dir"]) + "\n"))
    for stored in store.artifacts(run["id"]):
        if Path(stored["path"]).is_file():
            artifacts.append(
                Artifact(f"{stored['kind']}/{Path(stored['path']).name}", stored["kind"], path=stored["path"])
            )
    return artifacts
