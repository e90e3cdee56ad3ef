"""The base of every REST handler: authentication, JSON replies, errors mapped in one place.

:class:`BaseHandler` maps :class:`~rapydli.errors.RapydliError` subclasses to status codes
and answers every error as ``{"error": message, "status": code}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import tornado.web
from jupyter_server.base.handlers import APIHandler

from rapydli.errors import (
    ClusterError,
    ConfigError,
    NotFoundError,
    RapydliError,
    StoreError,
)
from rapydli.server.manager import ClusterManager
from rapydli.server.query import parse_json_body

log = logging.getLogger(__name__)

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
        from rapydli.experiments.store.runstore import require_store

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
