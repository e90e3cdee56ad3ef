"""Tornado handlers of the REST API (``/rapydli/api/...``).

Every method is ``@tornado.web.authenticated``; mutating methods get jupyter_server's
XSRF check (``APIHandler``). :class:`BaseHandler` maps :class:`~rapydli.errors.RapydliError`
subclasses to status codes in one place and answers every error as ``{"error": ...}``.
"""

from __future__ import annotations

import tornado.web
from jupyter_server.utils import url_path_join
from tornado.ioloop import IOLoop

from rapydli.server.base import BaseHandler
from rapydli.server.manager import ClusterManager
from rapydli.server.query import check_id, parse_cluster_request
from rapydli.server.run_handlers import ROUTES as RUN_ROUTES
from rapydli.version import __version__

API_VERSION = 1


class VersionHandler(BaseHandler):
    @tornado.web.authenticated
    async def get(self) -> None:
        self.reply({"version": __version__, "api": API_VERSION})


class LaunchersHandler(BaseHandler):
    """The launchers a cluster can be started with, each one's allowed options, and ``form``:
    those the Start dialog shows as fields."""

    @tornado.web.authenticated
    async def get(self) -> None:
        from rapydli.cluster.launchers import LAUNCHERS, get_launcher

        self.reply(
            {
                "launchers": [
                    {
                        "name": spec.name,
                        "description": spec.description,
                        "options": {
                            key: {"type": opt.kind.__name__, "help": opt.help} for key, opt in spec.options.items()
                        },
                        "form": list(spec.form),
                    }
                    for spec in map(get_launcher, LAUNCHERS)
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
    """One cluster (this server's or another running one); ``DELETE`` stops it in the background."""

    @tornado.web.authenticated
    async def get(self, cluster_id: str) -> None:
        check_id(cluster_id, "cluster id")
        self.reply(await IOLoop.current().run_in_executor(None, self.manager.describe, cluster_id))

    @tornado.web.authenticated
    async def delete(self, cluster_id: str) -> None:
        check_id(cluster_id, "cluster id")
        stopping = await IOLoop.current().run_in_executor(None, lambda: self.manager.stop(cluster_id, wait=False))
        self.reply(stopping, status=202)


class ClusterRestartHandler(BaseHandler):
    @tornado.web.authenticated
    async def post(self, cluster_id: str) -> None:
        check_id(cluster_id, "cluster id")
        self.reply(await IOLoop.current().run_in_executor(None, self.manager.restart, cluster_id), status=202)


class ClusterWhereHandler(BaseHandler):
    """Where every rank of a cluster stands: each rank's stack, asked from outside the engines (answers within seconds)."""

    @tornado.web.authenticated
    async def get(self, cluster_id: str) -> None:
        check_id(cluster_id, "cluster id")
        self.reply(await IOLoop.current().run_in_executor(None, self.manager.where, cluster_id))


_ID = r"([^/]+)"
ROUTES: list[tuple[str, type[BaseHandler]]] = [
    ("version", VersionHandler),
    ("launchers", LaunchersHandler),
    ("clusters", ClustersHandler),
    (f"clusters/{_ID}", ClusterHandler),
    (f"clusters/{_ID}/restart", ClusterRestartHandler),
    (f"clusters/{_ID}/where", ClusterWhereHandler),
    *RUN_ROUTES,
]


def setup_route_handlers(web_app: tornado.web.Application, manager: ClusterManager) -> None:
    """Add the ``/rapydli/api/`` routes to ``web_app``; handlers reach ``manager`` through its settings."""
    base = url_path_join(web_app.settings["base_url"], "rapydli", "api")
    web_app.settings["rapydli_clusters"] = manager
    web_app.add_handlers(".*$", [(url_path_join(base, path) + "/?$", handler) for path, handler in ROUTES])
