"""REST handlers over the run store: runs and their families, one run, its metrics, tags and
note, artifacts, comparisons, sweeps and batches.

Every method is ``@tornado.web.authenticated``; ids and bodies are validated by
:mod:`rapydli.server.query` before the store is asked, so a bad one is a 400 and an
unknown one a 404, each with a message.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Any

import tornado.web
from tornado.ioloop import IOLoop

from rapydli.errors import ConfigError, NotFoundError
from rapydli.server.base import BaseHandler
from rapydli.server.query import (
    check_id,
    parse_annotations,
    parse_compare_ids,
    parse_family_query,
    parse_json_body,
    parse_run_query,
    parse_since,
)

MAX_CHILDREN = 500
#: Most metric rows per run a comparison returns (longer series are thinned evenly).
MAX_COMPARE_POINTS = 5000


def _summary(store: Any, run: dict[str, Any]) -> dict[str, Any]:
    run = dict(run)
    run["final"] = store.final_metrics(run["id"])
    return run


def _args(handler: tornado.web.RequestHandler) -> dict[str, str]:
    return {k: handler.get_argument(k) for k in handler.request.arguments}


class RunsHandler(BaseHandler):
    """A flat page of runs, newest first (``kind``, ``status``, ``limit``, ``offset``)."""

    @tornado.web.authenticated
    async def get(self) -> None:
        query = parse_run_query(_args(self))
        store = self.store()
        runs, total = store.list_runs(kind=query.kind, status=query.status, limit=query.limit, offset=query.offset)
        self.reply(
            {
                "runs": [_summary(store, run) for run in runs],
                "total": total,
                "limit": query.limit,
                "offset": query.offset,
            }
        )


class FamiliesHandler(BaseHandler):
    """One page of run families: top-level runs with their children (trials, items, points)."""

    @tornado.web.authenticated
    async def get(self) -> None:
        q = parse_family_query(_args(self))
        families, total = self.store().families(
            kind=q.kind,
            status=q.status,
            text=q.text,
            tag=q.tag,
            sort=q.sort,
            descending=q.descending,
            limit=q.limit,
            offset=q.offset,
            max_children=MAX_CHILDREN,
        )
        store = self.store()
        for family in families:
            for child in family["children"]:
                if child["kind"] == "trial":  # the sweep's word for its state (PRUNED, ...), and why it was pruned
                    child.update(_trial_state(store.records(child["id"]), child["status"]))
        self.reply({"families": families, "total": total, "limit": q.limit, "offset": q.offset})


class RunHandler(BaseHandler):
    """One run with final metrics, tags, note, artifacts, records, hosts, children,
    ``sources`` (its code: :func:`~rapydli.experiments.store.sources.run_sources`) and
    ``trackers`` (its tracker runs: :func:`~rapydli.experiments.trackers.sync.link_rows`);
    ``PATCH`` sets its tags and/or note."""

    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        from rapydli.experiments.store.sources import run_sources
        from rapydli.experiments.trackers.sync import link_rows

        store = self.store()
        run = _summary(store, store.get_run(check_id(run_id, "run id")))
        run["tags"] = store.tags(run_id)
        run["artifacts"] = store.artifacts(run_id)
        run["records"] = store.records(run_id)
        hosts = run["records"].get("hosts", {}).get("value")
        run["hosts"] = hosts if isinstance(hosts, list) and hosts else [run["host"]]
        run["trackers"] = link_rows(store, run_id)
        children, _ = store.list_runs(parent=run_id, limit=MAX_CHILDREN)
        run["children"] = [_summary(store, child) for child in children]
        params = run["params"] if isinstance(run["params"], dict) else {}
        run["sources"] = await IOLoop.current().run_in_executor(None, run_sources, params, run.get("cwd"))
        self.reply(run)

    @tornado.web.authenticated
    async def patch(self, run_id: str) -> None:
        check_id(run_id, "run id")
        change = parse_annotations(parse_json_body(self.request.body))
        store = self.store()
        store.get_run(run_id)  # 404 before any write
        if change.tags is not None:
            store.set_tags(run_id, change.tags)
        if change.set_note:
            store.set_note(run_id, change.note)
        self.reply({"id": run_id, "tags": store.tags(run_id), "note": store.get_run(run_id)["note"]})


class MetricsHandler(BaseHandler):
    """Metric rows after the ``since`` cursor (the last ``seq`` the client holds)."""

    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        since = parse_since(_args(self))
        store = self.store()
        run = store.get_run(check_id(run_id, "run id"))
        rows = store.metrics(run_id, since=since)
        cursor = rows[-1]["seq"] if rows else (since if since is not None else -1)
        self.reply({"run_id": run_id, "status": run["status"], "metrics": rows, "cursor": cursor})


def validate_index(text: str) -> int:
    """An artifact index from a URL: a non-negative integer."""
    if not text.isdigit():
        raise ConfigError(f"artifact index must be a non-negative integer; got {text!r}")
    return int(text)


class ArtifactHandler(BaseHandler):
    """Download artifact number ``index`` of a run (only files the store lists for that run)."""

    @tornado.web.authenticated
    async def get(self, run_id: str, index: str) -> None:
        store = self.store()
        store.get_run(check_id(run_id, "run id"))
        number = validate_index(index)
        artifacts = store.artifacts(run_id)
        if number >= len(artifacts):
            raise NotFoundError(f"run {run_id!r} has no artifact {number}: it has {len(artifacts)}")
        path = Path(artifacts[number]["path"])
        if not path.is_file():
            raise NotFoundError(f"artifact {path} of run {run_id!r} is no longer on disk")
        self.set_header("Content-Type", mimetypes.guess_type(path.name)[0] or "application/octet-stream")
        self.set_header("Content-Disposition", f'attachment; filename="{path.name}"')
        data = await IOLoop.current().run_in_executor(None, path.read_bytes)
        await self.finish(data)


def _thin(rows: list[dict[str, Any]], limit: int) -> list[dict[str, Any]]:
    if len(rows) <= limit:
        return rows
    stride = len(rows) / limit
    return [rows[int(i * stride)] for i in range(limit - 1)] + [rows[-1]]


class CompareHandler(BaseHandler):
    """``?ids=a,b``: the runs, the parameters that differ (as ``rapydli runs compare``), final
    metrics and every metric's curve (step, time, value) for overlaying."""

    @tornado.web.authenticated
    async def get(self) -> None:
        from rapydli.experiments.store.compare import compare_runs

        ids = parse_compare_ids(_args(self))
        store = self.store()
        result = compare_runs(store, ids)
        curves: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for run in result["runs"]:
            run["tags"] = store.tags(run["id"])
            by_name: dict[str, list[dict[str, Any]]] = {}
            for row in store.metrics(run["id"]):
                by_name.setdefault(row["name"], []).append(
                    {"step": row["step"], "time": row["time"] - run["started"], "value": row["value"]}
                )
            curves[run["id"]] = {name: _thin(rows, MAX_COMPARE_POINTS) for name, rows in by_name.items()}
        result["curves"] = curves
        self.reply(result)


def _trial_state(records: dict[str, Any], status: str) -> dict[str, Any]:
    """A trial's ``state`` as its sweep told Optuna (RUNNING, COMPLETE, PRUNED, FAIL: read from its
    run status, :mod:`rapydli.experiments.sweep.lifecycle`) and ``prune``: the pruner's decision
    (step, value, the bar it missed, ``text``) or None."""
    from rapydli.experiments.sweep.lifecycle import state_of

    prune = records.get("prune")
    return {"state": state_of(status), "prune": prune["value"] if prune else None}


def _trial(store: Any, trial: dict[str, Any], metric: str | None) -> dict[str, Any]:
    """A trial with ``sampled`` (the parameters the sampler chose), ``state`` and ``prune``
    (:func:`_trial_state`), ``value`` (its final metric) and ``intermediate`` (the
    ``[step, value]`` the pruner saw)."""
    trial = _summary(store, trial)
    params = trial["params"] if isinstance(trial["params"], dict) else {}
    trial["sampled"] = params["params"] if isinstance(params.get("params"), dict) else params
    trial.update(_trial_state(store.records(trial["id"]), trial["status"]))
    trial["value"] = trial["final"].get(metric) if metric else None
    trial["intermediate"] = (
        [[r["step"], r["value"]] for r in store.metrics(trial["id"]) if r["name"] == metric] if metric else []
    )
    return trial


class SweepHandler(BaseHandler):
    """A sweep and its trials table (oldest first): parameters, state, value, intermediate
    values, duration; parameter importance once enough trials completed."""

    @tornado.web.authenticated
    async def get(self, sweep_id: str) -> None:
        from rapydli.experiments.sweep.importance import param_importance

        store = self.store()
        sweep = store.get_run(check_id(sweep_id, "sweep id"))
        if sweep["kind"] != "sweep":
            raise NotFoundError(f"run {sweep_id!r} is a {sweep['kind']} run, not a sweep")
        children, _ = store.list_runs(parent=sweep_id, limit=MAX_CHILDREN)
        params = sweep["params"] if isinstance(sweep["params"], dict) else {}
        metric, direction = params.get("metric"), params.get("direction") or "minimize"
        trials = [_trial(store, child, metric) for child in reversed(children)]
        importance, basis = param_importance(
            [{"params": t["sampled"], "state": t["state"], "value": t["value"]} for t in trials], direction
        )
        self.reply(
            {
                "sweep": _summary(store, sweep),
                "metric": metric,
                "direction": direction,
                "trials": trials,
                "importance": importance,
                "importance_basis": basis,
            }
        )


class BatchHandler(BaseHandler):
    """A batch and its items: parameters, status, recorded scalars, failing cell, output notebook."""

    @tornado.web.authenticated
    async def get(self, batch_id: str) -> None:
        store = self.store()
        batch = store.get_run(check_id(batch_id, "batch id"))
        if batch["kind"] != "batch" or batch["parent"] is not None:
            raise NotFoundError(
                f"run {batch_id!r} is not a batch (a {batch['kind']} run{' inside another' if batch['parent'] else ''})"
            )
        children, _ = store.list_runs(parent=batch_id, limit=MAX_CHILDREN)
        items = []
        for child in reversed(children):
            item = _summary(store, child)
            params = item["params"] if isinstance(item["params"], dict) else {}
            item["parameters"] = params.get("parameters", {})
            notebooks = [a["path"] for a in store.artifacts(child["id"]) if a["kind"] == "notebook"]
            item["notebook"] = notebooks[0] if notebooks else None
            item["failing_cell"] = (item["error"] or "").split("\n", 1)[0] if item["status"] == "failed" else None
            items.append(item)
        artifacts = store.artifacts(batch_id)
        self.reply({"batch": _summary(store, batch), "items": items, "artifacts": artifacts})


_ID = r"([^/]+)"
ROUTES: list[tuple[str, type[BaseHandler]]] = [
    ("runs", RunsHandler),
    ("families", FamiliesHandler),
    ("compare", CompareHandler),
    (f"runs/{_ID}", RunHandler),
    (f"runs/{_ID}/metrics", MetricsHandler),
    (f"runs/{_ID}/artifacts/{_ID}", ArtifactHandler),
    (f"sweeps/{_ID}", SweepHandler),
    (f"batches/{_ID}", BatchHandler),
]
