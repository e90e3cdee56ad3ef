"""Tornado handlers of the REST API (``/rapydli/api/...``).

Every method is ``@tornado.web.authenticated``; mutating methods get jupyter_server's
XSRF check (``APIHandler``). :class:`BaseHandler` maps :class:`~rapydli.errors.RapydliError`
subclasses to status codes in one place and answers every error as ``{"error": ...}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado.ioloop import IOLoop

from rapydli import __version__
from rapydli.errors import (
    ClusterError,
    ConfigError,
    NotFoundError,
    RapydliError,
    StoreError,
)
from rapydli.server.manager import ClusterManager
from rapydli.server.query import (
    check_id,
    parse_cluster_request,
    parse_json_body,
    parse_run_query,
    parse_since,
)

log = logging.getLogger(__name__)

API_VERSION = 1
MAX_CHILDREN = 500
#: RapydliError subclass -> HTTP status (the first match in this order wins).
STATUS_OF: tuple[tuple[type[RapydliError], int], ...] = (
    (ConfigError, 400),
    (NotFoundError, 404),
    (ClusterError, 409),
    (StoreError, 503),
    (RapydliError, 500),
)


def status_for(exc: BaseException) -> int | None:
    """The HTTP status for a RapydliError, or None for any other exception."""
    for cls, status in STATUS_OF:
        if isinstance(exc, cls):
            return status
    return None


class BaseHandler(APIHandler):
    """JSON in, JSON out; RapydliErrors become 4xx/5xx ``{"error": message}`` answers."""

    @property
    def manager(self) -> ClusterManager:
        return self.settings["rapydli_clusters"]

    def store(self) -> Any:
        from rapydli.experiments.store import require_store

        return require_store()

    def body(self) -> dict[str, Any]:
        return parse_json_body(self.request.body)

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(data, default=str))

    def log_exception(self, typ: Any, value: Any, tb: Any) -> None:
        status = status_for(value) if value is not None else None
        if status is not None and status < 500:
            log.info("%s %s -> %d: %s", self.request.method, self.request.path, status, value)
            return
        super().log_exception(typ, value, tb)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None, None))[1]
        mapped = status_for(exc) if exc is not None else None
        if mapped is not None:
            status_code = mapped
            message = str(exc)
        elif isinstance(exc, tornado.web.HTTPError):
            message = exc.log_message or exc.reason or self._reason
        else:
            message = self._reason
        self.set_status(status_code)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"error": message, "status": status_code}))


class VersionHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply({"version": __version__, "api": API_VERSION})


class LaunchersHandler(BaseHandler):
    """The launchers a cluster can be started with, and each one's allowed options."""

    @tornado.web.authenticated
    async def get(self) -> None:
        from rapydli.cluster.launchers import LAUNCHERS

        self.reply(
            {
                "launchers": [
                    {
                        "name": spec.name,
                        "description": spec.description,
                        "options": {key: {"type": opt.kind.__name__, "help": opt.help} for key, opt in spec.options.items()},
                    }
                    for spec in LAUNCHERS.values()
                ]
            }
        )


class ClustersHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        clusters = await IOLoop.current().run_in_executor(None, self.manager.list)
        self.reply({"clusters": clusters})

    @tornado.web.authenticated
    async def post(self) -> None:
        request = parse_cluster_request(self.body())
        self.reply(self.manager.start(request.n, request.launcher, request.options), status=202)


class ClusterHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self, cluster_id: str) -> None:
        entry = self.manager.get(check_id(cluster_id, "cluster id"))
        self.reply(await IOLoop.current().run_in_executor(None, entry.describe))

    @tornado.web.authenticated
    async def delete(self, cluster_id: str) -> None:
        check_id(cluster_id, "cluster id")
        self.manager.get(cluster_id)  # 404 before going to a thread
        self.reply(await IOLoop.current().run_in_executor(None, self.manager.stop, cluster_id))


class ClusterRestartHandler(BaseHandler):
    @tornado.web.authenticated
    async def post(self, cluster_id: str) -> None:
        self.reply(self.manager.restart(check_id(cluster_id, "cluster id")), status=202)


def _summary(store: Any, run: dict[str, Any]) -> dict[str, Any]:
    run = dict(run)
    run["final"] = store.final_metrics(run["id"])
    return run


class RunsHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        query = parse_run_query({k: self.get_argument(k) for k in self.request.arguments})
        store = self.store()
        runs, total = store.list_runs(kind=query.kind, status=query.status, limit=query.limit, offset=query.offset)
        self.reply({"runs": [_summary(store, run) for run in runs], "total": total, "limit": query.limit, "offset": query.offset})


class RunHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        store = self.store()
        run = _summary(store, store.get_run(check_id(run_id, "run id")))
        run["artifacts"] = store.artifacts(run_id)
        run["records"] = store.records(run_id)
        children, _ = store.list_runs(parent=run_id, limit=MAX_CHILDREN)
        run["children"] = [_summary(store, child) for child in children]
        self.reply(run)


class MetricsHandler(BaseHandler):
    """Metric rows after the ``since`` cursor (the last ``seq`` the client holds)."""

    @tornado.web.authenticated
    async def get(self, run_id: str) -> None:
        since = parse_since({k: self.get_argument(k) for k in self.request.arguments})
        store = self.store()
        run = store.get_run(check_id(run_id, "run id"))
        rows = store.metrics(run_id, since=since)
        cursor = rows[-1]["seq"] if rows else (since if since is not None else -1)
        self.reply({"run_id": run_id, "status": run["status"], "metrics": rows, "cursor": cursor})


def _trial(store: Any, trial: dict[str, Any]) -> dict[str, Any]:
    """A trial with ``sampled`` (the parameters the sampler chose) and ``state`` (pruned, ...)."""
    trial = _summary(store, trial)
    params = trial["params"] if isinstance(trial["params"], dict) else {}
    trial["sampled"] = params["params"] if isinstance(params.get("params"), dict) else params
    state = store.records(trial["id"]).get("trial_state")
    trial["state"] = state["value"] if state else trial["status"]
    return trial


class SweepHandler(BaseHandler):
    """A sweep and its trials table: parameters, state and final metrics of each trial."""

    @tornado.web.authenticated
    async def get(self, sweep_id: str) -> None:
        store = self.store()
        sweep = store.get_run(check_id(sweep_id, "sweep id"))
        if sweep["kind"] != "sweep":
            raise NotFoundError(f"run {sweep_id!r} is a {sweep['kind']} run, not a sweep")
        trials, _ = store.list_runs(parent=sweep_id, limit=MAX_CHILDREN)
        params = sweep["params"] if isinstance(sweep["params"], dict) else {}
        self.reply(
            {
                "sweep": _summary(store, sweep),
                "metric": params.get("metric"),
                "direction": params.get("direction"),
                "trials": [_trial(store, trial) for trial in reversed(trials)],
            }
        )


_ID = r"([^/]+)"
ROUTES: list[tuple[str, type[BaseHandler]]] = [
    ("version", VersionHandler),
    ("launchers", LaunchersHandler),
    ("clusters", ClustersHandler),
    (f"clusters/{_ID}", ClusterHandler),
    (f"clusters/{_ID}/restart", ClusterRestartHandler),
    ("runs", RunsHandler),
    (f"runs/{_ID}", RunHandler),
    (f"runs/{_ID}/metrics", MetricsHandler),
    (f"sweeps/{_ID}", SweepHandler),
]


def setup_route_handlers(web_app: tornado.web.Application, manager: ClusterManager) -> None:
    """Add the ``/rapydli/api/`` routes to ``web_app``; handlers reach ``manager`` through its settings."""
    base = url_path_join(web_app.settings["base_url"], "rapydli", "api")
    web_app.settings["rapydli_clusters"] = manager
    web_app.add_handlers(".*$", [(url_path_join(base, path) + "/?$", handler) for path, handler in ROUTES])
