"""Clusters the Jupyter server shows: its own, started in the background and stopped with
the server, and every other running cluster of the user (command line, kernels).

:class:`ClusterManager` is plain Python (no jupyter_server import). Each ``start``
returns at once with a ``starting`` entry; a thread starts the
:class:`rapydli.cluster.Cluster` and moves the entry to ``running``, or to ``failed``
with the error text. ``stop`` and ``restart`` also answer at once (``stopping``,
``restarting``) and do the work in a thread, for the server's clusters and for the
others (found by :mod:`rapydli.cluster.registry`) alike. :meth:`ClusterManager.stop_all`
stops the server's own clusters, never the others; the server extension calls it on
shutdown, and it is registered with :mod:`atexit` as a fallback, so no engine the server
started outlives it.
"""

from __future__ import annotations

import atexit
import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rapydli.cluster.registry import new_cluster_id, running_clusters, stop_cluster
from rapydli.errors import ClusterError, NotFoundError, RapydliError

log = logging.getLogger(__name__)

#: Reported states. ``starting`` and ``restarting`` move to ``running`` or ``failed``;
#: ``degraded`` is a running cluster with dead engines.
STATES = ("starting", "running", "degraded", "restarting", "stopping", "failed")


def _default_factory(n: int, launcher: str, options: Mapping[str, Any], cluster_id: str) -> Any:
    from rapydli.cluster import Cluster

    return Cluster(n=n, launcher=launcher, cluster_id=cluster_id, **options)


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
    listed: bool = False  # seen among the running clusters' files (so gone from them: stopped from outside)
    cluster: Any = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    thread: threading.Thread | None = field(default=None, repr=False)

    def describe(self) -> dict[str, Any]:
        """JSON-ready summary: id, origin (``server``), launcher, n, engines_alive, hosts, state,
        error, attach_id, created, options; ``job`` (id, state, reason, nodes) for a batch
        launcher, also while the job is queued; ``rank_hosts`` (rank -> host) once running."""
        state, alive, hosts = self.state, 0, []
        status = cluster_status(self.cluster) if self.cluster is not None else {}
        if state == "running" and status:
            alive = int(status.get("engines_alive", 0))
            hosts = list(status.get("hosts", []))
            if status.get("state") == "degraded":
                state = "degraded"  # some engines died; a restart replaces them
        return {
            "id": self.id,
            "origin": "server",
            "launcher": self.launcher,
            "n": self.n,
            "engines_alive": alive,
            "hosts": hosts,
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
        ``factory(n, launcher, options, cluster_id)`` returns an unstarted cluster object,
        running under ``cluster_id`` (the entry's id: what the panel, ``rapydli cluster`` and
        ``rd.Cluster.attach`` name it), with
        ``start(wait=False)``, ``wait_started()``, ``stop()`` (which cancels a start under
        way), ``restart()`` and ``status()``; default :class:`rapydli.cluster.Cluster`.
    """

    def __init__(self, factory: Callable[[int, str, Mapping[str, Any], str], Any] | None = None) -> None:
        self._factory = factory or _default_factory
        self._clusters: dict[str, ManagedCluster] = {}
        self._others: dict[str, dict[str, Any]] = {}  # other clusters being stopped or restarted
        self._lock = threading.Lock()
        atexit.register(self.stop_all)

    def start(self, n: int, launcher: str, options: Mapping[str, Any]) -> dict[str, Any]:
        """Create a cluster entry in state ``starting`` and start it in a background thread."""
        entry = ManagedCluster(id=new_cluster_id(), n=n, launcher=launcher, options=dict(options))
        with self._lock:
            self._clusters[entry.id] = entry
        entry.thread = threading.Thread(
            target=self._start, args=(entry,), name=f"rapydli-start-{entry.id}", daemon=True
        )
        entry.thread.start()
        return entry.describe()

    def _start(self, entry: ManagedCluster) -> None:
        # The wait for the engines holds no lock: a stop meanwhile cancels it (a queued job
        # leaves the queue) instead of waiting for the engines or the start's timeout.
        with entry.lock:
            if entry.state == "stopping":
                return
            try:
                entry.cluster = self._factory(entry.n, entry.launcher, entry.options, entry.id)
                entry.cluster.start(wait=False)
            except Exception as exc:  # noqa: BLE001 - any failure is reported as the entry's error
                self._failed(entry, exc)
                return
        try:
            entry.cluster.wait_started()
        except Exception as exc:  # noqa: BLE001 - any failure is reported as the entry's error
            with entry.lock:
                if entry.state != "stopping":  # else the stop cancelled it: no failure to show
                    self._failed(entry, exc)
            return
        with entry.lock:
            if entry.state == "stopping":
                return  # the stop under way (waiting for this lock) stops it
            self._publish(entry)
            entry.state = "running"

    def _failed(self, entry: ManagedCluster, exc: Exception) -> None:
        log.warning("cluster %s failed to start: %s", entry.id, exc)
        entry.state, entry.error = "failed", f"{type(exc).__name__}: {exc}"
        self._stop_quietly(entry)

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
        try:  # stop() also removes the record notebooks attach through
            entry.cluster.stop()
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
        """Every cluster, oldest first: this server's (:meth:`ManagedCluster.describe`) and every
        other running one of the user (``origin`` ``detached`` or ``kernel``)."""
        found_running = running_clusters()
        self._forget_stopped_elsewhere({c["id"] for c in found_running})
        with self._lock:
            entries = sorted(self._clusters.values(), key=lambda e: e.created)
            others = dict(self._others)
        own = [entry.describe() for entry in entries]
        # this server's clusters also leave ipyparallel's files: never list them twice (even while starting)
        published = {e.attach_id for e in entries if e.attach_id} | {
            cluster_status(e.cluster).get("cluster_id") for e in entries if e.cluster is not None
        }
        seen = {}
        for found in found_running:
            if found["id"] not in published:
                seen[found["id"]] = _describe_other(found)
        for cluster_id, pending in others.items():  # stopping, restarting or failed: what the row shows
            seen[cluster_id] = {**seen.get(cluster_id, pending), "state": pending["state"], "error": pending["error"]}
        return own + sorted(seen.values(), key=lambda c: c["created"])

    def _forget_stopped_elsewhere(self, running_ids: set[str]) -> None:
        """Drop this server's running clusters that were stopped from outside (``rapydli cluster
        stop ID``): their controller is gone; the client left behind is closed in the background."""
        with self._lock:
            for entry in self._clusters.values():
                entry.listed = entry.listed or entry.id in running_ids
            gone = [
                e
                for e in self._clusters.values()
                if e.listed and e.state in ("running", "degraded") and e.id not in running_ids
            ]
            for entry in gone:
                del self._clusters[entry.id]
        for entry in gone:
            self._in_background(f"rapydli-forget-{entry.id}", functools.partial(self._stop_quietly, entry))

    def describe(self, cluster_id: str) -> dict[str, Any]:
        """One cluster as :meth:`list` shows it; NotFoundError if none runs under that id."""
        with self._lock:
            entry = self._clusters.get(cluster_id)
        if entry is not None:
            return entry.describe()
        for cluster in self.list():
            if cluster["id"] == cluster_id:
                return cluster
        raise NotFoundError(f"no cluster {cluster_id!r}: not started by this server and not running elsewhere")

    def where(self, cluster_id: str) -> dict[str, Any]:
        """Where every rank of a running cluster stands (:meth:`rapydli.cluster.Cluster.where`).

        Returns ``{"id", "text", "ranks"}``: ``text`` groups the ranks standing on the same
        line; ``ranks`` has each rank's ``rank``, ``host``, ``where`` (its line and call chain)
        and ``error`` (why it did not answer). This server's clusters are asked through their
        client, a detached one (``rapydli cluster start``) from its record; a cluster a
        kernel holds is asked there (:class:`ClusterError`, naming how).
        """
        from rapydli.cluster.where import where_of_record

        with self._lock:
            entry = self._clusters.get(cluster_id)
        if entry is not None:
            if entry.state not in ("running", "degraded") or entry.cluster is None:
                raise ClusterError(
                    f"cluster {cluster_id} is {entry.state}: only a running cluster's engines can be asked"
                )
            found = entry.cluster.where()
        else:
            other = self._other(cluster_id)
            if other["origin"] == "kernel":
                raise ClusterError(
                    f"cluster {cluster_id} is held by a kernel: run `%rapydli where` (or cluster.where()) in that notebook"
                )
            from rapydli.cluster import Cluster

            record = next((r for r in Cluster.detached() if r["id"] == cluster_id), None)
            if record is None:
                raise NotFoundError(f"no record of cluster {cluster_id!r} (it is not running detached)")
            found = where_of_record(record)
        ranks = [
            {
                "rank": rank,
                "host": stacks.host,
                "where": "" if stacks.error else found.describe(rank),
                "error": stacks.error or None,
            }
            for rank, stacks in found.ranks.items()
        ]
        return {"id": cluster_id, "text": found.text(), "ranks": ranks}

    def _other(self, cluster_id: str) -> dict[str, Any]:
        for found in running_clusters():
            if found["id"] == cluster_id:
                return _describe_other(found)
        raise NotFoundError(f"no cluster {cluster_id!r}: not started by this server and not running elsewhere")

    def _in_background(self, name: str, work: Callable[[], None]) -> threading.Thread:
        thread = threading.Thread(target=work, name=name, daemon=True)
        thread.start()
        return thread

    def restart(self, cluster_id: str) -> dict[str, Any]:
        """Restart a running cluster's engines in the background (state ``restarting``).

        A cluster another process holds (``origin`` ``kernel``) cannot be restarted from
        here; a detached one is attached to and restarted under the same id.
        """
        with self._lock:
            entry = self._clusters.get(cluster_id)
        if entry is None:
            return self._restart_other(cluster_id)
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
                self._publish(entry)  # fresh engines, the same id
                entry.state, entry.error = "running", None

        entry.thread = self._in_background(f"rapydli-restart-{cluster_id}", restart)
        return entry.describe()

    def _restart_other(self, cluster_id: str) -> dict[str, Any]:
        found = self._other(cluster_id)
        if found["origin"] == "kernel":
            raise ClusterError(
                f"cluster {cluster_id!r} is held by a kernel or script; restart it there (cluster.restart())"
            )
        pending = self._begin_other(found, "restarting")

        def restart() -> None:
            from rapydli.cluster import Cluster

            try:
                attached = Cluster.attach(cluster_id)
                attached.restart()
                attached.client.close()  # the engines stay up (detached); only this connection ends
            except Exception as exc:  # noqa: BLE001 - reported in the row
                pending.update(state="failed", error=f"{type(exc).__name__}: {exc}")
                return
            with self._lock:
                self._others.pop(cluster_id, None)

        self._in_background(f"rapydli-restart-{cluster_id}", restart)
        return dict(pending)

    def _begin_other(self, found: dict[str, Any], state: str) -> dict[str, Any]:
        with self._lock:
            busy = self._others.get(found["id"])
            if busy is not None and busy["state"] in ("stopping", "restarting"):
                raise ClusterError(f"cluster {found['id']!r} is already {busy['state']}")
            pending = self._others[found["id"]] = {**found, "state": state, "error": None}
        return pending

    def stop(self, cluster_id: str, wait: bool = True) -> dict[str, Any]:
        """Stop a cluster (cancelling a start in progress) and forget it.

        With ``wait`` (the default) return once stopped; without, return at once with state
        ``stopping`` and stop in a thread (the entry stays listed as ``stopping`` until then).
        A start under way is cancelled (its batch job leaves the queue). A cluster this
        server did not start is stopped through :mod:`rapydli.cluster.registry`.
        """
        with self._lock:
            entry = self._clusters.get(cluster_id)
        if entry is None:
            return self._stop_other(cluster_id, wait)
        entry.state = "stopping"

        def stop() -> None:
            with entry.lock:  # waits for a restart in progress; a start's wait for engines is cancelled
                self._stop_quietly(entry)
                entry.cluster = None
            with self._lock:
                self._clusters.pop(cluster_id, None)

        if not wait:
            self._in_background(f"rapydli-stop-{cluster_id}", stop)
            return entry.describe()
        stop()
        summary = entry.describe()
        summary["state"] = "stopped"
        return summary

    def _stop_other(self, cluster_id: str, wait: bool) -> dict[str, Any]:
        pending = self._begin_other(self._other(cluster_id), "stopping")

        def stop() -> None:
            try:
                stop_cluster(cluster_id)
            except Exception as exc:  # noqa: BLE001 - reported in the row
                log.warning("cluster %s did not stop: %s", cluster_id, exc)
                pending.update(state="failed", error=f"{type(exc).__name__}: {exc}")
                return
            with self._lock:
                self._others.pop(cluster_id, None)

        if not wait:
            self._in_background(f"rapydli-stop-{cluster_id}", stop)
            return dict(pending)
        stop()
        return {**pending, "state": "stopped"}

    def stop_all(self) -> None:
        """Stop every cluster this server started (on server shutdown); others keep running."""
        with self._lock:
            ids = list(self._clusters)
        for cluster_id in ids:
            try:
                self.stop(cluster_id)
            except NotFoundError:
                continue


def _describe_other(found: dict[str, Any]) -> dict[str, Any]:
    """A cluster from :func:`~rapydli.cluster.registry.running_clusters` as :meth:`ClusterManager.list` shows it."""
    n, alive = found["n"] or 0, found["engines_alive"]
    return {
        "id": found["id"],
        "origin": found["origin"],
        "launcher": found["launcher"],
        "n": n,
        "engines_alive": alive,
        "hosts": found["hosts"],
        "state": found["state"] if found["state"] != "running" or alive >= n else "degraded",
        "job": found["job"],
        "error": None,
        "attach_id": found["id"] if found["origin"] == "detached" else None,
        "created": found["started"],
        "options": {},
    }
