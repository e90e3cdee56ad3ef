"""Every running cluster of this user, wherever it was started, from the files clusters leave.

Each :class:`~rapydli.cluster.Cluster` runs an ipyparallel controller under the profile
``$RAPYDLI_HOME/ipython``; ipyparallel writes ``security/cluster-<id>.json`` there while
it runs (controller and engine-launcher pids) and removes it on stop. A detached cluster
(``rapydli cluster start``, or one the Jupyter server publishes) also has rapydli's
record ``$RAPYDLI_HOME/clusters/<id>.json`` with each rank's pid and host. Reading both
finds clusters started from the command line, from a kernel or from a server, without
asking any of them; :func:`stop_cluster` stops one without attaching to it, so a cluster
with dead engines stops as fast as a healthy one.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import string
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

from rapydli.cluster.launchers import LAUNCHERS, get_launcher, launcher_of, queue_of
from rapydli.cluster.mpi_engine import PROGRAM
from rapydli.cluster.processes import alive, reap, reap_marked, terminate_trees
from rapydli.cluster.watchdog import HOLDER_MARKER, holder_alive
from rapydli.errors import NotFoundError
from rapydli.paths import subdir

log = logging.getLogger(__name__)


def new_cluster_id() -> str:
    """A new cluster id, in ipyparallel's own format (``<unix time>-<4 letters>``).

    One id names a cluster everywhere: ipyparallel's files, :meth:`Cluster.attach
    <rapydli.cluster.Cluster.attach>`, ``rapydli cluster status|stop``, the lab panel and the
    REST API (a cluster the Jupyter server starts runs under its entry's id).
    """
    return f"{int(time.time())}-{''.join(secrets.choice(string.ascii_lowercase) for _ in range(4))}"


def ipp_log(cluster_id: str) -> logging.Logger:
    """The logger ipyparallel logs cluster ``cluster_id`` to: errors only, RaPyDLI's own.

    Without it, ipyparallel logs to the running ``Application``'s logger where there is
    one (the Jupyter server's, whose logger passes DEBUG), and then streams the
    controller's and engines' log files into it: ~150 lines in the Lab terminal per start.
    The processes' logs stay in their files (``ipython/log/`` under ``RAPYDLI_HOME``).
    """
    log = logging.getLogger(f"rapydli.ipyparallel.{cluster_id}")
    log.setLevel(logging.ERROR)  # failures reach the user as ClusterError/RankFailure instead
    return log


def _profile() -> Path:
    return subdir("ipython")


#: The modules engines run as (``python -m ...``): ipyparallel's, and RaPyDLI's for batch and ssh launches.
ENGINE_MODULES = ("ipyparallel.engine", PROGRAM[-1])


def _engine_processes(launcher_pids: Iterable[object]) -> list[psutil.Process]:
    """ipyparallel engine processes under the engine launchers (mpiexec and its proxies).

    ``launcher_pids`` as the cluster file records them; what is not an int is skipped.
    """
    found = []
    for pid in launcher_pids:
        proc = alive(pid)
        if proc is None:
            continue
        for child in proc.children(recursive=True):
            try:
                if any(program in child.cmdline() for program in ENGINE_MODULES):  # the engine itself, not its nanny
                    found.append(child)
            except psutil.Error:
                continue
    return found


def _records() -> dict[str, dict[str, Any]]:
    out = {}
    for path in sorted(subdir("clusters").glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[record.get("id", path.stem)] = record
    return out


#: Scheduler states of a job that has not started its engines yet.
_QUEUED = ("SUBMITTED", "PENDING", "CONFIGURING", "REQUEUED")


def _job(launcher: object, job_id: object) -> dict[str, Any] | None:
    """The batch job ``job_id`` as the scheduler reports it now (None without one)."""
    queue = queue_of(launcher)
    if queue is None or not job_id:
        return None
    described: dict[str, Any] = queue.state(str(job_id)).describe()
    return described


def running_clusters() -> list[dict[str, Any]]:
    """Every cluster whose controller runs on this machine, oldest first.

    Returns
    -------
    list of dict
        ``id`` (ipyparallel's cluster id, which :meth:`Cluster.attach` takes), ``origin``
        (``detached``: started by ``rapydli cluster start`` or published by a server;
        ``kernel``: a cluster a notebook or script started and still holds), ``launcher``,
        ``n``, ``engines_alive``, ``hosts``, ``started`` (epoch seconds), ``threads``,
        ``engine_pids`` (the live engine processes on this host), ``state`` (``starting``
        while its start is under way or its job waits in the queue, else ``running``) and
        ``job`` (the batch job's ``{"id", "state", "reason", "nodes"}`` as the scheduler
        reports it now; None for launchers without one); a ``kernel`` cluster also has
        ``held``: whether the process that started it still runs (False: an orphan, which
        its watchdog failed to stop, :mod:`rapydli.cluster.watchdog`).
    """
    records = _records()
    clusters = []
    for path in sorted((_profile() / "security").glob("cluster-*.json")):
        try:
            data = json.loads(path.read_text())
            cluster_id = data["cluster"]["cluster_id"]
            controller = alive(data["controller"]["state"]["pid"])
            sets = data.get("engines", {}).get("sets", {}).values()
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if controller is None:
            continue  # a cluster whose process died without removing its file
        record = records.get(cluster_id)
        if record is not None:
            engines = record.get("engines", {}).values()
            up = [e for e in engines if alive(e.get("pid")) is not None]
            hosts = sorted({str(e.get("host")) for e in up}) if up else []
            entry = {"origin": "detached", "launcher": record.get("launcher"), "n": record.get("n"),
                     "engines_alive": len(up), "hosts": hosts, "threads": record.get("threads"),
                     "engine_pids": [e["pid"] for e in up], "state": record.get("state", "running")}  # fmt: skip
            job_id = (record.get("job") or {}).get("id")
        else:
            engine_class = str(data.get("engines", {}).get("class", ""))
            procs = _engine_processes([s.get("pid") for s in sets if isinstance(s, dict)])
            entry = {"origin": "kernel", "launcher": launcher_of(engine_class),
                     "n": data["cluster"].get("n"), "engines_alive": len(procs),
                     "hosts": [socket.gethostname()] if procs else [], "threads": None,
                     "engine_pids": [p.pid for p in procs], "state": "running", "held": _held(controller)}  # fmt: skip
            job_id = next((s["job_id"] for s in sets if isinstance(s, dict) and s.get("job_id")), None)
        entry["job"] = _job(entry["launcher"], job_id)
        if entry["job"] is not None and entry["job"]["state"] in _QUEUED:
            entry["state"] = "starting"
        clusters.append({"id": cluster_id, "started": controller.create_time(), **entry})
    return sorted(clusters, key=lambda c: c["started"])


def _held(controller: psutil.Process) -> bool:
    """Whether the process holding the cluster of ``controller`` still runs (:data:`~rapydli.cluster.watchdog.HOLDER_MARKER`).

    A controller without the marker (an ipyparallel cluster RaPyDLI did not start) counts as held.
    """
    try:
        holder = controller.environ().get(HOLDER_MARKER)
    except (psutil.Error, OSError):
        return True
    return holder is None or holder_alive(holder)


def stop_cluster(cluster_id: str, timeout: float = 10.0) -> None:
    """Stop a cluster of this machine that this process does not hold, and remove its files.

    The one way to stop a cluster from outside (``rapydli cluster stop``, the Jupyter
    server's other clusters), without attaching to it, so a cluster with dead engines stops
    as fast as a healthy one. A local cluster's controller, engine launchers and engines
    are all sent SIGTERM at once (and SIGKILL ``timeout`` s later); on other launchers
    ipyparallel stops the controller and the engine launchers,
    the batch job (if any) is cancelled and waited out of the queue, engines still alive
    ``timeout`` seconds later and every other process carrying the cluster's marker
    (:func:`~rapydli.cluster.processes.reap_marked`: nannies, a half-started set) are
    ended, then its records and connection files are removed. A cluster with a record but
    no controller left (it died) is cleaned up the same way.

    Raises
    ------
    NotFoundError
        No running cluster and no record has this id.
    """
    import ipyparallel as ipp

    running = {c["id"]: c for c in running_clusters()}
    if cluster_id not in running and cluster_id not in _records():
        raise NotFoundError(f"no running cluster {cluster_id!r}: running are {', '.join(sorted(running)) or 'none'}")
    found = running.get(cluster_id)
    cluster = None
    if found is not None:
        try:
            cluster = ipp.Cluster.from_file(profile_dir=str(_profile()), cluster_id=cluster_id, log=ipp_log(cluster_id))
        except Exception as exc:  # noqa: BLE001 - no cluster file left: the engines and marked processes still go
            log.warning("cluster %s: ipyparallel could not read it: %s", cluster_id, exc)
    here = found is not None and found["launcher"] in LAUNCHERS and get_launcher(found["launcher"]).on_this_machine
    if found is not None and here:  # every process is here: end them all at once
        launchers = [cluster.controller, *cluster.engines.values()] if cluster is not None else []
        terminate_trees(
            [*(launcher.pid for launcher in launchers if launcher is not None), *found["engine_pids"]], grace=timeout
        )
    elif found is not None:
        try:
            if cluster is not None:
                cluster.stop_cluster_sync()
        except Exception as exc:  # noqa: BLE001 - stop what can be stopped; the processes are reaped below
            log.warning("cluster %s: ipyparallel could not stop it cleanly: %s", cluster_id, exc)
        queue = queue_of(found["launcher"])
        if found["job"] is not None and queue is not None:
            from rapydli.cluster.batchjob import BatchJob

            BatchJob(
                str(found["job"]["id"]), queue.state, list(queue.cancel)
            ).cancel()  # idempotent: ipyparallel may have done it
        pids = found["engine_pids"]
        psutil.wait_procs([p for p in map(alive, pids) if p is not None], timeout=timeout)
        reap(pids)
    reap_marked(cluster_id)
    (subdir("clusters") / f"{cluster_id}.json").unlink(missing_ok=True)
    remove_connection_files(cluster_id)


def remove_connection_files(cluster_id: str) -> None:
    """Remove ipyparallel's files of a stopped cluster (its cluster file and connection files).

    A killed controller leaves them behind, and a restart under the same id would read them.
    """
    security = _profile() / "security"
    (security / f"cluster-{cluster_id}.json").unlink(missing_ok=True)
    for stale in security.glob(f"ipcontroller-{cluster_id}-*.json"):
        stale.unlink(missing_ok=True)
