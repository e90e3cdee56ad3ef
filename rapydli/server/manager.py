"""Clusters owned by the Jupyter server: started in the background, stopped with the server.

:class:`ClusterManager` is plain Python (no jupyter_server import). Each
``start`` returns at once with a ``starting`` entry; a thread starts the
:class:`rapydli.cluster.Cluster` and moves the entry to ``running``, or to ``failed``
with the error text. :meth:`ClusterManager.stop_all` stops every cluster; the server
extension calls it on shutdown, and it is registered with :mod:`atexit` as a fallback,
so no engine outlives the server.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rapydli.errors import ClusterError, NotFoundError, RapydliError

log = logging.getLogger(__name__)

#: Reported states. ``starting`` and ``restarting`` move to ``running`` or ``failed``;
#: ``degraded`` is a running cluster with dead engines.
STATES = ("starting", "running", "degraded", "restarting", "stopping", "failed")


def _default_factory(n: int, launcher: str, options: Mapping[str, Any]) -> Any:
    from rapydli.cluster import Cluster

    return Cluster(n=n, launcher=launcher, **options)


def cluster_status(cluster: Any) -> dict[str, Any]:
    """A started cluster's ``status()`` dict (empty when it cannot be asked)."""
    try:
        status = cluster.status()
    except Exception as exc:  # noqa: BLE001 - a cluster that cannot answer is reported with 0 engines
        log.debug("cluster status failed: %s", exc)
        return {}
    return dict(status) if isinstance(status, Mapping) else {}


@dataclass
class ManagedCluster:
    """One server-owned cluster and what the API reports about it."""

    id: str
    n: int
    launcher: str
    options: dict[str, Any]
    state: str = "starting"
    error: str | None = None
    attach_id: str | None = None
    created: float = field(default_factory=time.time)
    cluster: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary: id, launcher, n, engines_alive, state, error, created, options;
        ``job`` (id, state, reason, nodes) for a batch launcher, also while the job is queued;
        ``rank_hosts`` (rank -> host) once running."""
        state, alive = self.state, 0
        status = cluster_status(self.cluster) if self.cluster is not None else {}
        if state == "running" and status:
            alive = int(status.get("engines_alive", 0))
            if status.get("state") == "degraded":
                state = "degraded"  # some engines died; a restart replaces them
        return {
            "id": self.id,
            "launcher": self.launcher,
            "n": self.n,
            "engines_alive": alive,
            "state": state,
            "error": self.error,
            "attach_id": self.attach_id if state in ("running", "degraded") else None,
            "created": self.created,
            "options": dict(self.options),
            "job": status.get("job"),
            "rank_hosts": {str(rank): host for rank, host in status.get("rank_hosts", {}).items()},
        }


class ClusterManager:
    """The clusters this server started, by id.

    Parameters
    ----------
    factory
        ``factory(n, launcher, options)`` returns an unstarted cluster object with
        ``start()``, ``stop()``, ``restart()`` and ``status()``; default
        :class:`rapydli.cluster.Cluster`.
    """

    def __init__(self, factory: Callable[[int, str, Mapping[str, Any]], Any] | None = None) -> None:
        self._factory = factory or _default_factory
        self._clusters: dict[str, ManagedCluster] = {}
        self._lock = threading.Lock()
        atexit.register(self.stop_all)

    def start(self, n: int, launcher: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """Create a cluster entry in state ``starting`` and start it in a background thread."""
        entry = ManagedCluster(id=f"c{uuid.uuid4().hex[:10]}", n=n, launcher=launcher, options=dict(options))
        with self._lock:
            self._clusters[entry.id] = entry
        entry.thread = threading.Thread(target=self._start, args=(entry,), name=f"rapydli-start-{entry.id}", daemon=True)
        entry.thread.start()
        return entry.describe()

    def _start(self, entry: ManagedCluster) -> None:
        with entry.lock:
            try:
                entry.cluster = self._factory(entry.n, entry.launcher, entry.options)
                entry.cluster.start()
            except Exception as exc:  # noqa: BLE001 - any failure is reported as the entry's error
                log.warning("cluster %s failed to start: %s", entry.id, exc)
                entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                self._stop_quietly(entry)
                return
            self._publish(entry)
            entry.state = "running"

    def _publish(self, entry: ManagedCluster) -> None:
        """Let notebooks connect: ``rd.Cluster.attach(entry.attach_id)`` (the server still stops it)."""
        detach = getattr(entry.cluster, "detach", None)
        if not callable(detach):
            return
        try:
            entry.attach_id = detach()
        except RapydliError as exc:
            log.warning("cluster %s cannot be attached to from notebooks: %s", entry.id, exc)

    def _stop_quietly(self, entry: ManagedCluster) -> None:
        if entry.cluster is None:
            return
        # forget() also removes the record notebooks attach through.
        stop = getattr(entry.cluster, "forget", None) if entry.attach_id else None
        try:
            (stop or entry.cluster.stop)()
        except Exception as exc:  # noqa: BLE001 - stopping is best effort after a failure
            log.warning("cluster %s did not stop cleanly: %s", entry.id, exc)

    def get(self, cluster_id: str) -> ManagedCluster:
        """The entry for ``cluster_id``; NotFoundError if this server has none."""
        with self._lock:
            entry = self._clusters.get(cluster_id)
        if entry is None:
            raise NotFoundError(f"no cluster {cluster_id!r} on this server")
        return entry

    def list(self) -> list[dict[str, Any]]:
        """Every cluster, oldest first, as :meth:`ManagedCluster.describe` dicts."""
        with self._lock:
            entries = sorted(self._clusters.values(), key=lambda e: e.created)
        return [entry.describe() for entry in entries]

    def restart(self, cluster_id: str) -> dict[str, Any]:
        """Restart a running cluster's engines in the background (state ``restarting``)."""
        entry = self.get(cluster_id)
        if entry.state != "running":
            raise ClusterError(f"cluster {cluster_id!r} is {entry.state}; only a running cluster can restart")
        entry.state = "restarting"

        def restart() -> None:
            with entry.lock:
                try:
                    entry.cluster.restart()
                except Exception as exc:  # noqa: BLE001 - reported as the entry's error
                    entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
                    return
                self._publish(entry)  # fresh engines under a new id
                entry.state, entry.error = "running", None

        entry.thread = threading.Thread(target=restart, name=f"rapydli-restart-{cluster_id}", daemon=True)
        entry.thread.start()
        return entry.describe()

    def stop(self, cluster_id: str) -> dict[str, Any]:
        """Stop a cluster (waiting for a start in progress) and forget it. Blocks until stopped."""
        entry = self.get(cluster_id)
        entry.state = "stopping"
        with entry.lock:  # waits for a start or restart in progress
            self._stop_quietly(entry)
            entry.cluster = None
        with self._lock:
            self._clusters.pop(cluster_id, None)
        summary = entry.describe()
        summary["state"] = "stopped"
        return summary

    def stop_all(self) -> None:
        """Stop every cluster (on server shutdown)."""
        with self._lock:
            ids = list(self._clusters)
        for cluster_id in ids:
            try:
                self.stop(cluster_id)
            except NotFoundError:
                continue
