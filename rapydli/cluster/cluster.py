"""``rd.Cluster``: ipyparallel MPI engines, one MPI rank each, started by a named launcher.

Here: starting, stopping, restarting, detaching and attaching a cluster, and its status;
running code on its engines is :class:`rapydli.cluster.tasks.ClusterTasks`, a base of
:class:`Cluster`.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from rapydli.cluster import engine, launchwatch
from rapydli.cluster.batchjob import BatchJob, batch_job
from rapydli.cluster.controller_config import write_controller_config
from rapydli.cluster.encryption import beyond_loopback, curve_ready
from rapydli.cluster.launchers import DEFAULT_LAUNCHER, get_launcher, queue_of, validate_options
from rapydli.cluster.mpirun import rank_environment, threads_per_rank
from rapydli.cluster.processes import CLUSTER_MARKER, alive, reap, reap_marked
from rapydli.cluster.registry import ipp_log, new_cluster_id, remove_connection_files
from rapydli.cluster.sshhosts import SessionWatch
from rapydli.cluster.tasks import ClusterTasks
from rapydli.cluster.watchdog import DETACHED, HOLDER_MARKER, STOPPED, Watchdog, holder_value
from rapydli.errors import ClusterError, ConfigError, NotFoundError
from rapydli.paths import subdir

_live: weakref.WeakSet[Cluster] = weakref.WeakSet()
_live_lock = threading.Lock()


def current() -> Cluster | None:
    """The cluster this process holds: the most recently started one not stopped since, if any.

    It may be ``starting`` (a ``start(wait=False)`` under way), running with all its
    engines, ``degraded`` (an engine died) or ``dead`` (aborted);
    :func:`rapydli.cluster.ensure.ready` makes it usable. A stopped cluster, or one whose
    start failed, is not held.
    """
    with _live_lock:
        held = [c for c in _live if c._state in ("starting", "running", "dead")]
    return max(held, key=lambda c: c._started_at) if held else None


def _hold(cluster: Cluster) -> None:
    """Count ``cluster`` as started now (what :func:`current` returns, newest first)."""
    cluster._started_at = time.monotonic()
    with _live_lock:
        _live.add(cluster)


class Cluster(ClusterTasks):
    """A set of MPI engines the notebook drives; every engine is one MPI rank.

    Parameters
    ----------
    n
        Number of engines (MPI ranks), >= 1.
    launcher
        ``"local"`` (mpiexec on this machine), ``"ssh"``, ``"slurm"`` (a job), ``"srun"`` (a step of the allocation
        this process runs in) or ``"pbs"``; see
        :mod:`rapydli.cluster.launchers`.
    threads
        Threads per engine (``OMP_NUM_THREADS`` and ``torch.set_num_threads``). Default:
        cores // n, at least 1, so ranks on one machine do not oversubscribe it.
    start_timeout
        Seconds to wait for all engines to register.
    cluster_id
        The id it runs under (ipyparallel's, :meth:`attach`'s, the one ``rapydli cluster``
        and the lab panel show); default a new one (:func:`new_cluster_id`) at the first start.
    **launcher_options
        Options of the launcher, validated against its allow-list.

    Examples
    --------
    >>> with Cluster(n=2) as cluster:  # doctest: +SKIP
    ...     cluster.run(lambda: __import__("rapydli.cluster.engine").cluster.engine.context().rank)
    [0, 1]
    """

    def __init__(
        self,
        n: int = 2,
        launcher: str = DEFAULT_LAUNCHER,
        *,
        threads: int | None = None,
        start_timeout: float = 120.0,
        cluster_id: str | None = None,
        **launcher_options: Any,
    ) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"n={n!r} is invalid: the number of engines must be an integer >= 1")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads={threads!r} is invalid: must be an integer >= 1")
        self.launcher = get_launcher(launcher)
        self.options = validate_options(launcher, launcher_options)
        if self.launcher.check_size is not None:
            self.launcher.check_size(n, self.options)
        if self.launcher.allocation is not None:
            self.launcher.allocation.check(launcher, n)
        self.n = n
        self._full = (n, dict(self.options))  # what a restart brings back: n and options may shrink after one (restart)
        self.threads = threads or self._default_threads(n)
        self.start_timeout = start_timeout
        self._ipp: Any = None
        self._client: Any = None
        self._engine_of_rank: dict[int, int] = {}
        self._info: dict[int, dict[str, Any]] = {}
        self._warming: Any = None  # the engines' warm-up task (engine.warm_up), not waited for
        self._state = "stopped"
        self._started_at = 0.0
        self._detached = False
        self._watchdog: Watchdog | None = None  # ends the cluster if this process dies holding it
        if cluster_id is not None:
            _check_id(cluster_id)
        self._cluster_id: str | None = cluster_id  # kept across restarts, so attach ids stay valid
        self._batch: BatchJob | None = None  # the scheduler job holding the engines (slurm)
        self._sessions: SessionWatch | None = None  # mpiexec's ssh session to each host (ssh)
        self._starter: threading.Thread | None = None  # a start(wait=False) under way
        self._start_error: BaseException | None = None
        self._cancel = threading.Event()  # set by stop(): a start under way gives up
        self._lock = threading.RLock()

    def _default_threads(self, n: int) -> int:
        """Cores per engine: the launcher's option (``cpus_per_task``), 1 on a scheduler, else cores // n."""
        option = self.launcher.threads_option
        if option is None:
            return threads_per_rank(n)
        return int(self.options.get(option) or 1)

    # -- lifecycle -----------------------------------------------------------------------

    def start(self, on_state: Callable[[dict[str, Any]], None] | None = None, *, wait: bool = True) -> Cluster:
        """Start the controller and ``n`` engines and wait until all are ready (idempotent).

        With a batch launcher (``slurm``) the engines are one job: while it waits in the
        queue ``status()["job"]`` shows it (state, reason, id) and ``on_state(job)`` is
        called on every change. A job that ends before its engines are ready, the
        ``start_timeout`` passing, Ctrl-C, or :meth:`stop` cancel it (``scancel``) and raise.

        With ``wait=False`` the start goes on in a background thread and this returns at
        once (state ``starting``); :meth:`wait_started` waits for it and raises its error.
        """
        if not wait:
            with self._lock:
                if self._state in ("running", "starting"):
                    return self
                self._state, self._start_error = "starting", None
                _hold(self)
                self._cancel.clear()
                self._starter = threading.Thread(
                    target=self._start_behind, args=(on_state,), name="rapydli-start", daemon=True
                )
                self._starter.start()
                return self
        if threading.current_thread() is not self._starter:
            self._cancel.clear()  # a stop() before this start (restart) does not cancel it
        with self._lock:
            if self._state == "running":
                return self
            import ipyparallel as ipp
            from traitlets.config import Config

            self._state = "starting"
            if threading.current_thread() is not self._starter:
                _hold(self)
            self._cluster_id = self._cluster_id or new_cluster_id()
            held = {} if self._detached else {HOLDER_MARKER: holder_value()}
            if not self._detached and (self._watchdog is None or not self._watchdog.watching):
                self._watchdog = Watchdog.start(self._cluster_id)  # before any process: a kernel dying mid-start too
            write_controller_config(subdir("ipython"))  # its log without ipykernel 7's iopub_welcome errors
            config = Config(self.launcher.config(self.options, work_dir=str(subdir("ipython"))))
            launcher_env = dict(config.BaseLauncher.get("environment", {}))
            config.BaseLauncher.environment = {
                **rank_environment(self.n, self.threads, base={}),
                **launcher_env,
                CLUSTER_MARKER: self._cluster_id,  # how stop/abort find every process it started
                **held,  # whose it is: `rapydli cluster status` tells a held cluster from an orphan
            }
            kwargs: dict[str, Any] = {}
            if self.launcher.listen_all and "controller_ip" not in config.get("Cluster", {}):
                kwargs["controller_ip"] = "*"
            if beyond_loopback(kwargs.get("controller_ip") or config.get("Cluster", {}).get("controller_ip")):
                try:
                    curve_ready()
                    kwargs["controller_args"] = ["--IPController.enable_curve=True"]
                except ClusterError:
                    self._state = "failed"
                    raise
            self._ipp = ipp.Cluster(
                engines=self.launcher.engines,
                controller=self.launcher.controller,
                n=self.n,
                config=config,
                log=ipp_log(self._cluster_id),  # errors only, and never the Jupyter server's log
                engine_timeout=int(self.start_timeout),
                profile_dir=str(subdir("ipython")),
                cluster_id=self._cluster_id,
                **kwargs,
            )
            try:
                self._ipp.start_cluster_sync()
                self._client = self._ipp.connect_client_sync()
                self._batch = batch_job(self.launcher, self._ipp)
                if self._batch is not None:
                    self._batch.wait_for_engines(
                        self._client, self.n, self.start_timeout, on_state, self._cancel.is_set
                    )
                else:
                    launchwatch.wait_for_engines(self._ipp, self._client, self.n, self.start_timeout)
                self._configure_engines()
                self._sessions = self._watch_sessions()
            except BaseException as exc:
                # Ctrl-C included: a start cancelled half-way leaves engines ipyparallel no
                # longer tracks; the teardown finds them by their marker
                died = not isinstance(exc, (ClusterError, KeyboardInterrupt))
                output = (
                    self._batch.output(20) if self._batch is not None and died else ""
                )  # read before the stop removes it
                self._teardown()
                self._release_watchdog(STOPPED)
                self._state = "failed"
                if isinstance(exc, KeyboardInterrupt):
                    raise
                raise ClusterError(
                    f"could not start {self.n} engines with launcher {self.launcher.name!r}: {exc}"
                    + (f"\nthe job's output ends with:\n{output}" if output else "")
                ) from exc
            self._state = "running"
            return self

    def _start_behind(self, on_state: Callable[[dict[str, Any]], None] | None) -> None:
        try:
            self.start(on_state)
        except BaseException as exc:  # noqa: BLE001 - handed to wait_started()
            self._start_error = exc

    def wait_started(self, timeout: float | None = None) -> Cluster:
        """Wait for a ``start(wait=False)`` to finish; raise its error if it failed.

        The wait is in short steps, so Ctrl-C ends it (the start goes on).
        """
        starter = self._starter
        if starter is not None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while starter.is_alive() and (deadline is None or time.monotonic() < deadline):
                starter.join(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
            if starter.is_alive():
                raise ClusterError(f"the cluster is still starting after {timeout:g} s: {self.status().get('job', '')}")
            self._starter = None
        error, self._start_error = self._start_error, None
        if error is not None:
            raise error
        return self

    def _configure_engines(self) -> None:
        ids = sorted(self._client.ids)[: self.n]
        view = self._client[ids]
        view.use_cloudpickle()
        view.apply_sync(engine.pickle_classes_by_value)
        engine.pickle_classes_by_value()
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        infos = _wait(view.apply_async(engine.setup, self.threads, paths))
        ranks = [info["rank"] for info in infos]
        if sorted(ranks) != list(range(self.n)) or any(info["size"] != self.n for info in infos):
            raise ClusterError(
                f"engines do not form one MPI job of {self.n} ranks (ranks {ranks}, sizes {[i['size'] for i in infos]})"
            )
        self._engine_of_rank = {info["rank"]: eid for eid, info in zip(ids, infos)}
        self._info = {info["rank"]: info for info in infos}
        # ready now; torch and the trainer import behind this, ahead of any task sent meanwhile
        self._warming = view.apply_async(engine.warm_up)

    def _watch_sessions(self) -> SessionWatch | None:
        """The ssh sessions to the engines' hosts (a launcher `over_ssh`), watched while tasks run."""
        if not self.launcher.over_ssh or self._cluster_id is None:
            return None
        remote = sorted({info["host"] for info in self._info.values() if not _is_local(info)})
        return SessionWatch.find(self._cluster_id, remote, self.options.get("ssh_command", "ssh"))

    def stop(self) -> None:
        """Stop every engine and the controller; no process is left behind.

        A start under way is cancelled first (a queued job leaves the queue). A detached
        cluster's record goes too (:meth:`attach` and ``rapydli cluster status`` no longer
        find it). A cluster this process does not hold is stopped by
        :func:`rapydli.cluster.registry.stop_cluster`.
        """
        self._cancel.set()
        starter = self._starter
        if starter is not None:
            starter.join()
            self._starter, self._start_error = None, None
        with self._lock:
            if self._detached and self._cluster_id is not None:
                (subdir("clusters") / f"{self._cluster_id}.json").unlink(missing_ok=True)
            if self._ipp is None:
                self._state = "stopped"
                self._release_watchdog(STOPPED)
                return
            self._teardown()
            self._release_watchdog(STOPPED)
            self._state = "stopped"

    def _release_watchdog(self, word: str) -> None:
        """Tell the watchdog the cluster is let go (stopped here, or detached); it exits without acting."""
        if self._watchdog is not None:
            self._watchdog.release(word)
            self._watchdog = None

    def restart(self, min_engines: int | None = None) -> Cluster:
        """Replace the engines by fresh ones (same launcher and id), as many as the cluster was made with.

        A launcher that can tell which of its hosts are gone (``ssh``: those that do not
        answer) is asked first. Their engines are left out when at least ``min_engines``
        remain: the cluster then has fewer engines (``n``, ``options`` say which) until a
        later restart brings them all back. Otherwise the restart fails at once, naming
        the hosts, rather than waiting ``start_timeout`` for engines that cannot come.

        Raises
        ------
        ClusterError
            Fewer than ``min_engines`` (default: all) engines can start, or the start failed.
        """
        full, options = self._full
        if min_engines is not None and (
            not isinstance(min_engines, int) or isinstance(min_engines, bool) or not 1 <= min_engines <= full
        ):
            raise ConfigError(f"min_engines={min_engines!r} is invalid: an integer in 1..{full}")
        with self._lock:
            self.stop()
            n, left_out = full, dict[str, str]()
            if self.launcher.reachable is not None:
                n, options, left_out = self.launcher.reachable(full, dict(options))
            if n < (min_engines or full):
                why = "; ".join(f"{host}: {reason}" for host, reason in left_out.items())
                raise ClusterError(f"only {n} of {full} engines can start ({why}); need {min_engines or full}")
            self.n, self.options = n, options
            self.start()
            if self._detached:  # the attach record must name the new engines
                self.detach()
            return self

    def _teardown(self, wait: bool = True) -> None:
        """Stop the controller and engines and reap every process of the cluster.

        ``wait=False`` (an abort, whose processes were SIGKILLed already) does not wait for
        them to finish exiting: they are gone in a moment, and Ctrl-C gives control back now.
        """
        pids = [info["pid"] for info in self._info.values() if _is_local(info)]
        remote: dict[str, list[int]] = {}  # engines (and their nannies) on other hosts, by host
        for info in self._info.values():
            if not _is_local(info):
                remote.setdefault(info["host"], []).extend([info["pid"], *info.get("helper_pids", [])])
        if self._client is not None:
            try:  # engines that exit on request let mpiexec end by itself; a dead engine never
                # replies, so no reply is awaited: the wait below is for the processes to exit
                if self._client.ids:
                    self._client.shutdown(targets="all", block=False)
            except Exception:  # noqa: BLE001 - dead engines cannot answer; they are reaped below
                pass
        # the client's I/O thread delivers the requests meanwhile, so close it afterwards; a
        # batch job is cancelled soon after (scancel ends its engines wherever they run)
        grace = (2 if self._batch is not None else 10) if wait else 0
        psutil.wait_procs([p for p in map(alive, pids) if p is not None], timeout=grace)
        if self._client is not None:
            try:
                self._client.close()
            except Exception:  # noqa: BLE001 - closing a client whose controller is gone
                pass
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - stop what can be stopped, then reap below
                pass
        if self._batch is not None:
            self._batch.cancel()  # idempotent; returns once the job has left the queue
        if wait:
            reap(pids)
        if self._cluster_id is not None:  # nannies orphaned by killed engines, a half-started set, ...
            if reap_marked(self._cluster_id, grace=3.0 if wait else 0):
                self._remove_connection_files()
        lost = self._sessions.down if self._sessions is not None else {}
        remote = {host: pids for host, pids in remote.items() if host not in lost}  # their processes cannot be reached
        if remote and self.launcher.over_ssh:
            from rapydli.cluster.sshhosts import reap_remote

            reap_remote(remote, self.options.get("ssh_command", "ssh"))
        for info in self._info.values():  # the engines' stack dumps and traces (where())
            for name in ("stacks_file", "trace_file"):
                if _is_local(info) and name in info:
                    Path(info[name]).unlink(missing_ok=True)
        self._ipp = self._client = None
        self._sessions = None
        self._engine_of_rank, self._info = {}, {}

    def abort(self) -> None:
        """Kill the engines at once (an MPI job blocked in a collective cannot be interrupted).

        The controller and every other process of the cluster are stopped too; the cluster
        is then ``dead`` until :meth:`restart` (``%%distributed`` restarts it by itself).
        """
        with self._lock:
            for pid in (info["pid"] for info in self._info.values() if _is_local(info)):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self._cluster_id is not None:  # the controller and the rest too: nothing to wait for
                reap_marked(self._cluster_id, grace=0)
            if self._ipp is not None:
                self._teardown(wait=False)
            self._remove_connection_files()
            self._state = "dead"

    def _remove_connection_files(self) -> None:
        if self._cluster_id is not None:
            remove_connection_files(self._cluster_id)

    # -- outliving this process ------------------------------------------------------------

    def detach(self) -> str:
        """Keep the engines running after this process exits; returns the id for :meth:`attach`."""
        with self._lock:
            self._require_running()
            self._ipp.shutdown_atexit = False
            self._detached = True
            cluster_id = self._ipp.cluster_id
            self.write_record("running")
            self._release_watchdog(DETACHED)
            return cluster_id

    def write_record(self, state: str) -> None:
        """Write this cluster's record where ``rapydli cluster status`` and :meth:`attach` read it.

        ``state`` is ``"running"`` once detached, or ``"starting"`` while a start is under way
        (its batch job, if any, is shown, e.g. pending in the queue).
        """
        record = {
            "id": self._ipp.cluster_id,
            "n": self.n,
            "launcher": self.launcher.name,
            "options": self.options,
            "threads": self.threads,
            "profile_dir": self._ipp.profile_dir,
            "state": state,
            "engines": {str(rank): info for rank, info in self._info.items()},
            **({"job": self._batch.describe()} if self._batch is not None else {}),
        }
        (subdir("clusters") / f"{record['id']}.json").write_text(json.dumps(record, indent=2))

    @classmethod
    def attach(cls, cluster_id: str, timeout: float = 30.0) -> Cluster:
        """Connect to a cluster another process started and detached (e.g. ``rapydli cluster start``)."""
        import ipyparallel as ipp

        record = _detached_record(cluster_id)
        cluster = cls(
            record["n"], record["launcher"], threads=record["threads"], start_timeout=timeout, **record["options"]
        )
        try:
            cluster._ipp = ipp.Cluster.from_file(
                profile_dir=record["profile_dir"], cluster_id=cluster_id, log=ipp_log(cluster_id)
            )
            cluster._ipp.shutdown_atexit = False
            cluster._detached = True  # stays up when this process exits, unless stopped
            cluster._batch = batch_job(cluster.launcher, cluster._ipp)  # watched, and cancelled on stop
            cluster._client = cluster._ipp.connect_client_sync()
            cluster._client.wait_for_engines(cluster.n, timeout=timeout, block=True, widget=False, interactive=False)
            cluster._configure_engines()
        except Exception as exc:
            raise ClusterError(f"cannot attach to cluster {cluster_id!r}: {exc}") from exc
        cluster._state = "running"
        cluster._cluster_id = cluster_id
        _hold(cluster)
        return cluster

    @staticmethod
    def detached() -> list[dict[str, Any]]:
        """Records of detached (and starting) clusters: engine processes alive on this host, and
        the batch job's state as the scheduler reports it now."""
        records = []
        for path in sorted(subdir("clusters").glob("*.json")):
            record = json.loads(path.read_text())
            record["engines_alive"] = sum(psutil.pid_exists(e["pid"]) for e in record["engines"].values())
            queue = queue_of(record.get("launcher"))
            if record.get("job") and queue is not None:
                record["job"] = queue.state(record["job"]["id"]).describe()
            records.append(record)
        return records

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if getattr(self, "_state", "stopped") in ("running", "dead") and not self._detached:
            try:
                self.stop()
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass

    # -- state ---------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while the cluster is started and all its engines are alive."""
        return self._state == "running" and len(self.alive_ranks()) == self.n

    @property
    def warming(self) -> bool:
        """True while the engines still import torch and the trainer after their start (:func:`engine.warm_up`).

        A task sent meanwhile runs once that import ends; this says so to a caller that
        tells the user what it waits for.
        """
        warming = self._warming
        return warming is not None and not warming.ready()

    @property
    def client(self) -> Any:
        """The ipyparallel :class:`~ipyparallel.Client` (the cluster must be running)."""
        self._require_running()
        return self._client

    def alive_ranks(self) -> list[int]:
        """Ranks whose engine is registered with the controller."""
        if self._client is None:
            return []
        ids = set(self._client.ids)
        return sorted(rank for rank, eid in self._engine_of_rank.items() if eid in ids)

    def status(self) -> dict[str, Any]:
        """What the cluster is doing: state, engines alive/dead, ranks, hosts (``rank_hosts``: rank -> host), launcher."""
        alive = self.alive_ranks()
        state = self._state
        if state == "running" and len(alive) < self.n:
            state = "degraded"
        return {
            "state": state,
            "launcher": self.launcher.name,
            "n": self.n,
            "engines_alive": len(alive),
            "engines_dead": self.n - len(alive) if self._engine_of_rank or state == "dead" else 0,
            "ranks": alive,
            "hosts": sorted({self._info[r]["host"] for r in alive}),
            "threads_per_engine": self.threads,
            "options": dict(self.options),
            "cluster_id": self._cluster_id,
            "rank_hosts": {r: _where(self._info[r]) for r in alive},
            **({"job": self._batch.describe()} if self._batch is not None else {}),
        }

    def _require_running(self) -> None:
        if self._state != "running":
            raise ClusterError(f"the cluster is {self._state}: start() it first")

    def __repr__(self) -> str:
        return f"<rapydli.Cluster n={self.n} launcher={self.launcher.name!r} state={self._state!r}>"


def _check_id(cluster_id: str) -> None:
    if not isinstance(cluster_id, str) or not cluster_id.replace("-", "").isalnum():
        raise ConfigError(f"cluster id {cluster_id!r} is invalid: letters, digits and '-' only")


def _detached_record(cluster_id: str) -> dict[str, Any]:
    _check_id(cluster_id)
    path = subdir("clusters") / f"{cluster_id}.json"
    if not path.exists():
        known = ", ".join(p.stem for p in subdir("clusters").glob("*.json")) or "none"
        raise NotFoundError(f"no detached cluster {cluster_id!r}: known are {known}")
    return json.loads(path.read_text())


def _wait(future: Any, step: float = 0.1) -> Any:
    """``future.result()`` in short waits, so Ctrl-C (a SIGINT or ``interrupt_main``) ends it.

    A wait without a timeout blocks in a lock that only a real signal to this very thread
    interrupts; ipyparallel's ``*_sync`` calls wait so. A future that itself failed with a
    ``TimeoutError`` (engines that did not register in time) raises it.
    """
    result = getattr(future, "get", None) or future.result  # an AsyncResult's own get(), else the Future's
    while True:
        try:
            return result(timeout=step)
        except TimeoutError:
            if future.done():  # perhaps not this short wait's timeout but the future's own error: its outcome, once
                return result(timeout=step)


def _where(info: dict[str, Any]) -> str:
    """Where a rank runs: its host, and its Slurm node when that names it differently."""
    node = info.get("node")
    return f"{info['host']} ({node})" if node and node != info["host"] else info["host"]


def _is_local(info: dict[str, Any]) -> bool:
    import socket

    return info.get("host") == socket.gethostname()
