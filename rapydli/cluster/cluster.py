"""``rd.Cluster``: ipyparallel MPI engines, one MPI rank each, started by a named launcher."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import psutil

from rapydli.cluster import engine
from rapydli.cluster.job import (
    DisplayHandler,
    EventHandler,
    Job,
    OutputHandler,
    print_output,
)
from rapydli.cluster.launchers import get_launcher, validate_options
from rapydli.cluster.mpirun import rank_environment, threads_per_rank
from rapydli.cluster.processes import reap
from rapydli.cluster.targets import parse_targets
from rapydli.cluster.usercode import notebook_cells
from rapydli.errors import ClusterError, ConfigError, NotFoundError
from rapydli.paths import subdir

_live: weakref.WeakSet[Cluster] = weakref.WeakSet()
_live_lock = threading.Lock()


def current() -> Cluster | None:
    """The most recently started cluster of this process that is still running, if any."""
    with _live_lock:
        running = [c for c in _live if c.running]
    return max(running, key=lambda c: c._started_at) if running else None


class Cluster:
    """A set of MPI engines the notebook drives; every engine is one MPI rank.

    Parameters
    ----------
    n
        Number of engines (MPI ranks), >= 1.
    launcher
        ``"local"`` (mpiexec on this machine), ``"ssh"``, ``"slurm"`` or ``"pbs"``; see
        :mod:`rapydli.cluster.launchers`.
    threads
        Threads per engine (``OMP_NUM_THREADS`` and ``torch.set_num_threads``). Default:
        cores // n, at least 1, so ranks on one machine do not oversubscribe it.
    start_timeout
        Seconds to wait for all engines to register.
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
        launcher: str = "local",
        *,
        threads: int | None = None,
        start_timeout: float = 120.0,
        **launcher_options: Any,
    ) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"n={n!r} is invalid: the number of engines must be an integer >= 1")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads={threads!r} is invalid: must be an integer >= 1")
        self.launcher = get_launcher(launcher)
        self.options = validate_options(launcher, launcher_options)
        self.n = n
        self.threads = threads or threads_per_rank(n)
        self.start_timeout = start_timeout
        self._ipp: Any = None
        self._client: Any = None
        self._engine_of_rank: dict[int, int] = {}
        self._info: dict[int, dict[str, Any]] = {}
        self._state = "stopped"
        self._started_at = 0.0
        self._detached = False
        self._cluster_id: str | None = None  # kept across restarts, so attach ids stay valid
        self._lock = threading.RLock()

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start the controller and ``n`` engines and wait until all are ready (idempotent)."""
        with self._lock:
            if self._state == "running":
                return self
            import ipyparallel as ipp
            from traitlets.config import Config

            self._state = "starting"
            config = Config(self.launcher.config(self.options, work_dir=str(subdir("ipython"))))
            config.BaseLauncher.environment = {
                k: v for k, v in rank_environment(self.n, self.threads, base={}).items()
            }
            kwargs: dict[str, Any] = {}
            if self.launcher.listen_all:
                kwargs["controller_ip"] = "*"
            self._ipp = ipp.Cluster(
                engines=self.launcher.engines,
                controller=self.launcher.controller,
                n=self.n,
                config=config,
                log_level=logging.ERROR,  # failures reach the user as ClusterError/RankFailure instead
                engine_timeout=int(self.start_timeout),
                profile_dir=str(subdir("ipython")),
                **({"cluster_id": self._cluster_id} if self._cluster_id else {}),
                **kwargs,
            )
            try:
                self._ipp.start_cluster_sync()
                self._client = self._ipp.connect_client_sync()
                self._client.wait_for_engines(self.n, timeout=self.start_timeout, block=True, widget=False, interactive=False)
                self._configure_engines()
            except BaseException as exc:
                self._teardown()
                self._state = "failed"
                if isinstance(exc, KeyboardInterrupt):
                    raise
                raise ClusterError(f"could not start {self.n} engines with launcher {self.launcher.name!r}: {exc}") from exc
            self._state = "running"
            self._started_at = time.monotonic()
            self._cluster_id = self._ipp.cluster_id
            with _live_lock:
                _live.add(self)
            return self

    def _configure_engines(self) -> None:
        ids = sorted(self._client.ids)[: self.n]
        view = self._client[ids]
        view.use_cloudpickle()
        view.apply_sync(engine.pickle_classes_by_value)
        engine.pickle_classes_by_value()
        paths = [os.path.abspath(p or os.curdir) for p in sys.path]
        infos = view.apply_sync(engine.setup, self.threads, paths)
        ranks = [info["rank"] for info in infos]
        if sorted(ranks) != list(range(self.n)) or any(info["size"] != self.n for info in infos):
            raise ClusterError(f"engines do not form one MPI job of {self.n} ranks (ranks {ranks}, sizes {[i['size'] for i in infos]})")
        self._engine_of_rank = {info["rank"]: eid for eid, info in zip(ids, infos)}
        self._info = {info["rank"]: info for info in infos}

    def stop(self) -> None:
        """Stop every engine and the controller; no process is left behind."""
        with self._lock:
            if self._ipp is None:
                self._state = "stopped"
                return
            self._teardown()
            self._state = "stopped"

    def restart(self) -> Cluster:
        """Replace the engines by fresh ones (same size, launcher, options and id)."""
        with self._lock:
            self.stop()
            self.start()
            if self._detached:  # the attach record must name the new engines
                self.detach()
            return self

    def _teardown(self) -> None:
        pids = [info["pid"] for info in self._info.values() if _is_local(info)]
        if self._client is not None:
            try:  # engines that exit on request let mpiexec end by itself; a dead engine never
                # replies, so no reply is awaited: the wait below is for the processes to exit
                if self._client.ids:
                    self._client.shutdown(targets="all", block=False)
            except Exception:  # noqa: BLE001 - dead engines cannot answer; they are reaped below
                pass
        # the client's I/O thread delivers the requests meanwhile, so close it afterwards
        psutil.wait_procs([p for p in map(_process, pids) if p is not None], timeout=10)
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
        reap(pids)
        self._ipp = self._client = None
        self._engine_of_rank, self._info = {}, {}
        with _live_lock:
            _live.discard(self)

    def abort(self) -> None:
        """Kill the engines at once (an MPI job blocked in a collective cannot be interrupted)."""
        with self._lock:
            pids = [info["pid"] for info in self._info.values() if _is_local(info)]
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if self._ipp is not None:
                try:
                    self._ipp.stop_engines_sync()
                except Exception:  # noqa: BLE001 - the engines may already be gone
                    pass
            reap(pids)
            self._state = "dead"

    # -- outliving this process ------------------------------------------------------------

    def detach(self) -> str:
        """Keep the engines running after this process exits; returns the id for :meth:`attach`."""
        with self._lock:
            self._require_running()
            self._ipp.shutdown_atexit = False
            self._detached = True
            cluster_id = self._ipp.cluster_id
            record = {
                "id": cluster_id,
                "n": self.n,
                "launcher": self.launcher.name,
                "options": self.options,
                "threads": self.threads,
                "profile_dir": self._ipp.profile_dir,
                "engines": {str(rank): info for rank, info in self._info.items()},
            }
            (subdir("clusters") / f"{cluster_id}.json").write_text(json.dumps(record, indent=2))
            return cluster_id

    @classmethod
    def attach(cls, cluster_id: str, timeout: float = 30.0) -> Cluster:
        """Connect to a cluster another process started and detached (e.g. ``rapydli cluster start``)."""
        import ipyparallel as ipp

        record = _detached_record(cluster_id)
        cluster = cls(record["n"], record["launcher"], threads=record["threads"], start_timeout=timeout, **record["options"])
        try:
            cluster._ipp = ipp.Cluster.from_file(profile_dir=record["profile_dir"], cluster_id=cluster_id, log_level=logging.ERROR)
            cluster._ipp.shutdown_atexit = False
            cluster._detached = True  # stays up when this process exits, unless stopped
            cluster._client = cluster._ipp.connect_client_sync()
            cluster._client.wait_for_engines(cluster.n, timeout=timeout, block=True, widget=False, interactive=False)
            cluster._configure_engines()
        except Exception as exc:
            raise ClusterError(f"cannot attach to cluster {cluster_id!r}: {exc}") from exc
        cluster._state = "running"
        cluster._started_at = time.monotonic()
        cluster._cluster_id = cluster_id
        with _live_lock:
            _live.add(cluster)
        return cluster

    @staticmethod
    def detached() -> list[dict[str, Any]]:
        """Records of detached clusters, each with ``alive`` engine processes counted (this host)."""
        records = []
        for path in sorted(subdir("clusters").glob("*.json")):
            record = json.loads(path.read_text())
            record["engines_alive"] = sum(psutil.pid_exists(e["pid"]) for e in record["engines"].values())
            records.append(record)
        return records

    def forget(self) -> None:
        """Stop the cluster and remove its detached record."""
        cluster_id = getattr(self._ipp, "cluster_id", None)
        self.stop()
        if cluster_id:
            (subdir("clusters") / f"{cluster_id}.json").unlink(missing_ok=True)

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
        """What the cluster is doing: state, engines alive/dead, ranks, hosts, launcher."""
        alive = self.alive_ranks()
        state = self._state
        if state == "running" and len(alive) < self.n:
            state = "degraded"
        return {
            "state": state,
            "launcher": self.launcher.name,
            "n": self.n,
            "engines_alive": len(alive),
            "engines_dead": self.n - len(alive) if self._engine_of_rank else 0,
            "ranks": alive,
            "hosts": sorted({self._info[r]["host"] for r in alive}),
            "threads_per_engine": self.threads,
            "options": dict(self.options),
            "cluster_id": getattr(self._ipp, "cluster_id", None),
        }

    def _require_running(self) -> None:
        if self._state != "running":
            raise ClusterError(f"the cluster is {self._state}: start() it first")

    def view(self, targets: Sequence[int] | None = None) -> Any:
        """An ipyparallel :class:`DirectView` on the engines of ``targets`` (ranks; default all)."""
        self._require_running()
        return self._client[self._engines(targets)]

    def _engines(self, targets: Sequence[int] | None) -> list[int]:
        ranks = list(range(self.n)) if targets is None else list(targets)
        bad = [r for r in ranks if r not in self._engine_of_rank]
        if bad:
            raise ConfigError(f"targets {bad} are not ranks of this cluster: allowed 0..{self.n - 1}")
        return [self._engine_of_rank[r] for r in ranks]

    # -- running code --------------------------------------------------------------------

    def push(self, namespace: dict[str, Any], targets: Sequence[int] | str | None = None) -> None:
        """Define ``namespace``'s names on the engines (functions too, via cloudpickle)."""
        self.view(parse_targets(targets, self.n)).push(namespace, block=True)

    def submit(
        self,
        fn: Callable[..., Any],
        *args: Any,
        targets: Sequence[int] | str | None = None,
        timeout: float | None = None,
        on_event: EventHandler | None = None,
        on_output: OutputHandler | None = print_output,
        **kwargs: Any,
    ) -> Job:
        """Start ``fn(*args, **kwargs)`` on the ``targets`` ranks and return its :class:`Job`.

        Inside ``fn``, :func:`rapydli.cluster.engine.context` gives the rank, the group's
        size, a communicator over exactly the targets, and the device;
        :func:`rapydli.cluster.events.emit` sends events to ``on_event(rank, kind, payload)``;
        :func:`rapydli.cluster.engine.should_stop` tells whether ``Job.request_stop`` was
        called. Jobs on disjoint targets run side by side.
        """
        ranks = parse_targets(targets, self.n)
        sources = notebook_cells()
        results = self._submit(ranks, engine.run_task, fn, args, kwargs, ranks, on_event is not None, sources)
        return self._job(results, timeout=timeout, on_output=on_output, on_event=on_event)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        targets: Sequence[int] | str | None = None,
        timeout: float | None = None,
        on_event: EventHandler | None = None,
        on_output: OutputHandler | None = print_output,
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on the ``targets`` ranks and return their results.

        The blocking form of :meth:`submit`.

        Raises
        ------
        RankFailure
            A rank raised, died, or the timeout passed; the other ranks were interrupted.
        """
        job = self.submit(fn, *args, targets=targets, timeout=timeout, on_event=on_event, on_output=on_output, **kwargs)
        return job.wait()

    def run_cell(
        self,
        code: str,
        *,
        targets: Sequence[int] | str | None = None,
        timeout: float | None = None,
        gather: bool = False,
        on_output: OutputHandler | None = print_output,
        on_display: DisplayHandler | None = None,
    ) -> list[Any]:
        """Execute notebook cell ``code`` on the ranks; values of the last expression per rank.

        Only the first rank's value is sent back unless ``gather`` (values need not be picklable
        on the other ranks).
        """
        ranks = parse_targets(targets, self.n)
        results = {
            rank: self._client[self._engine_of_rank[rank]].apply_async(
                engine.run_cell, code, ranks, gather or rank == ranks[0]
            )
            for rank in self._checked(ranks)
        }
        return self._job(results, timeout=timeout, on_output=on_output, on_display=on_display).wait()

    def _checked(self, ranks: list[int]) -> list[int]:
        self._require_running()
        dead = sorted(set(ranks) - set(self.alive_ranks()))
        if dead:
            raise ClusterError(f"engines of ranks {dead} are dead: restart the cluster (`%rapydli restart`)")
        return ranks

    def _submit(self, ranks: list[int], fn: Callable[..., Any], *args: Any) -> dict[int, Any]:
        return {rank: self._client[self._engine_of_rank[rank]].apply_async(fn, *args) for rank in self._checked(ranks)}

    def _job(self, results: dict[int, Any], **handlers: Any) -> Job:
        return Job(results, interrupt=self._interrupt, stop=self._request_stop, abort=self.abort, **handlers)

    def _signal(self, name: str, ranks: Sequence[int]) -> None:
        try:
            self._client.send_signal(name, targets=self._engines(ranks), block=False)
        except Exception:  # noqa: BLE001 - a dead engine cannot be signalled; the abort follows
            pass

    def _interrupt(self, ranks: Sequence[int]) -> None:
        self._signal("SIGINT", ranks)

    def _request_stop(self, ranks: Sequence[int]) -> None:
        self._signal(engine.STOP_SIGNAL.name, ranks)

    def __repr__(self) -> str:
        return f"<rapydli.Cluster n={self.n} launcher={self.launcher.name!r} state={self._state!r}>"


def _detached_record(cluster_id: str) -> dict[str, Any]:
    if not cluster_id.replace("-", "").isalnum():
        raise ConfigError(f"cluster id {cluster_id!r} is invalid: letters, digits and '-' only")
    path = subdir("clusters") / f"{cluster_id}.json"
    if not path.exists():
        known = ", ".join(p.stem for p in subdir("clusters").glob("*.json")) or "none"
        raise NotFoundError(f"no detached cluster {cluster_id!r}: known are {known}")
    return json.loads(path.read_text())


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def _is_local(info: dict[str, Any]) -> bool:
    import socket

    return info.get("host") == socket.gethostname()

