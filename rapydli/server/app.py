"""The jupyter_server extension application: routes on load, clusters stopped on shutdown."""

from __future__ import annotations

from jupyter_server.extension.application import ExtensionApp

from rapydli.server.handlers import setup_route_handlers
from rapydli.server.manager import ClusterManager


class RapydliServerApp(ExtensionApp):
    """Serves ``/rapydli/api/`` and owns the clusters started through it."""

    name = "rapydli"
    load_other_extensions = True

    def initialize_settings(self) -> None:
        self.clusters = ClusterManager()

    def initialize_handlers(self) -> None:
        assert self.serverapp is not None  # jupyter_server links the extension to its ServerApp before its handlers
        setup_route_handlers(self.serverapp.web_app, self.clusters)

    async def stop_extension(self) -> None:
        """Stop every cluster this server started, so no engine outlives it."""
        self.log.info("rapydli: stopping %d cluster(s)", len(self.clusters.list()))
        self.clusters.stop_all()
