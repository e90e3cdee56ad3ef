"""The Jupyter server extension: RaPyDLI's REST API under ``/rapydli/api/``.

Enabled on install by ``etc/jupyter/jupyter_server_config.d/rapydli.json``. The routes
read the run store and drive clusters owned by a :class:`~rapydli.server.manager.ClusterManager`;
the JupyterLab panel (``extensions/rapydli-lab``) talks only to them.

Importing this package does not import jupyter_server: the pure logic lives in
:mod:`rapydli.server.manager` and :mod:`rapydli.server.query`, and the extension
application is loaded only when the server asks for it.
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, Any]]:
    """Tell jupyter_server where the extension application is."""
    from rapydli.server.app import RapydliServerApp

    return [{"module": "rapydli.server", "app": RapydliServerApp}]
