"""Running code on a cluster's engines: the part of :class:`~rapydli.cluster.Cluster` that
sends tasks (functions, notebook cells) to ranks and watches them as one :class:`Job`.

:class:`ClusterTasks` is a base of ``Cluster``; it reads the cluster's engines (which
engine is which rank, where each runs), its batch job and its ssh sessions, and ends the
cluster through ``Cluster.abort`` when a job must.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rapydli.cluster import engine, trace
from rapydli.cluster.hang import ACTIONS, HangWatch
from rapydli.cluster.job import FOLLOW_S, DisplayHandler, EventHandler, Job, OutputHandler, print_output
from rapydli.cluster.targets import parse_targets
from rapydli.cluster.usercode import notebook_cells
from rapydli.cluster.where import WHERE_SIGNAL, WITHIN_S, Reader, Where, collect, read_local, read_ssh
from rapydli.errors import ClusterError, ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.cluster.batchjob import BatchJob
    from rapydli.cluster.launchers import LauncherSpec
    from rapydli.cluster.sshhosts import SessionWatch


class ClusterTasks:
    """Tasks on the engines of a running cluster (a base of :class:`~rapydli.cluster.Cluster`)."""

    n: int
    launcher: LauncherSpec
    options: dict[str, Any]
    _client: Any  # ipyparallel's Client while running
    _engine_of_rank: dict[int, int]
    _info: dict[int, dict[str, Any]]  # rank -> what its engine reported (host, pid, node, ...)
    _batch: BatchJob | None
    _sessions: SessionWatch | None
    _state: str  # "running", "dead" (aborted), ...

    if TYPE_CHECKING:  # defined by Cluster

        def abort(self) -> None: ...

        def alive_ranks(self) -> list[int]: ...

        def _require_running(self) -> None: ...

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
        hang_timeout_s: float | None = None,
        on_hang: str = "wait",
        **kwargs: Any,
    ) -> Job:
        """Start ``fn(*args, **kwargs)`` on the ``targets`` ranks and return its :class:`Job`.

        Inside ``fn``, :func:`rapydli.cluster.engine.context` gives the rank, the group's
        size, a communicator over exactly the targets, and the device;
        :func:`rapydli.cluster.events.emit` sends events to ``on_event(rank, kind, payload)``;
        :func:`rapydli.cluster.engine.should_stop` tells whether ``Job.request_stop`` was
        called. Jobs on disjoint targets run side by side.

        When no rank progresses for ``hang_timeout_s`` seconds (None: 5x the median step,
        at least 60 s) while one waits in a collective, the job prints a diagnosis
        (:mod:`rapydli.cluster.hang`) and, with ``on_hang="abort"``, interrupts the ranks
        (``"wait"``: it keeps waiting).
        """
        ranks = parse_targets(targets, self.n)
        hang = self._hang_watch(ranks, hang_timeout_s, on_hang)
        sources = notebook_cells()
        results = self._submit(
            ranks, lambda rank: (engine.run_task, fn, args, kwargs, ranks, on_event is not None, sources)
        )
        return self._job(results, timeout=timeout, on_output=on_output, on_event=on_event, hang=hang)

    def run(
        self,
        fn: Callable[..., Any],
        *args: Any,
        targets: Sequence[int] | str | None = None,
        timeout: float | None = None,
        on_event: EventHandler | None = None,
        on_output: OutputHandler | None = print_output,
        hang_timeout_s: float | None = None,
        on_hang: str = "wait",
        **kwargs: Any,
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on the ``targets`` ranks and return their results.

        The blocking form of :meth:`submit`.

        Raises
        ------
        RankFailure
            A rank raised, died, or the timeout passed; the other ranks were interrupted.
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        job = self.submit(
            fn,
            *args,
            targets=targets,
            timeout=timeout,
            on_event=on_event,
            on_output=on_output,
            hang_timeout_s=hang_timeout_s,
            on_hang=on_hang,
            **kwargs,
        )
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
        hang_timeout_s: float | None = None,
        on_hang: str = "wait",
    ) -> list[Any]:
        """Execute notebook cell ``code`` on the ranks; values of the last expression per rank.

        Only the first rank's value is sent back unless ``gather`` (values need not be picklable
        on the other ranks).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        ranks = parse_targets(targets, self.n)
        hang = self._hang_watch(ranks, hang_timeout_s, on_hang)
        self._cell_lines = code.splitlines()  # shown by where() for "<distributed cell>" frames
        results = self._submit(ranks, lambda rank: (engine.run_cell, code, ranks, gather or rank == ranks[0]))
        return self._job(results, timeout=timeout, on_output=on_output, on_display=on_display, hang=hang).wait()

    def where(self, targets: Sequence[int] | str | None = None, within: float = WITHIN_S) -> Where:
        """The Python stack of every thread of the ``targets`` ranks (default all), and their collective traces.

        Asked from outside the engines (a signal to each engine process, whose handler
        writes the stacks to a file), so ranks blocked in MPI, in C code or in a long cell
        answer too, within ``within`` seconds. ``str()`` of the result groups the ranks
        that stand on the same line of their task; a rank that did not answer says so.

        Examples
        --------
        >>> print(cluster.where())  # doctest: +SKIP
        rank 0: comm.Barrier()  <module> (<distributed cell>:4)
        rank 1: time.sleep(30)  <module> (<distributed cell>:3)
        """
        self._require_running()
        ranks = parse_targets(targets, self.n)
        infos = {rank: self._info[rank] for rank in ranks if "stacks_file" in self._info.get(rank, {})}
        stacks = collect(infos, self._signal_where, self._reader(), within)
        return Where(stacks, self._traces(ranks), {"<distributed cell>": getattr(self, "_cell_lines", [])})

    def _hang_watch(self, ranks: list[int], timeout_s: float | None, action: str) -> HangWatch:
        """The hang detection of a task on ``ranks`` (bad options: :class:`ConfigError`, before anything runs)."""
        if action not in ACTIONS:
            raise ConfigError(f"on_hang={action!r} is invalid: one of {', '.join(map(repr, ACTIONS))}")
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(
                f"hang_timeout_s={timeout_s!r} is invalid: seconds > 0, or None for 5x the median step (at least 60 s)"
            )
        return HangWatch(self._traces, lambda asked: self.where(asked), timeout_s, action, self.n)

    def _traces(self, ranks: Sequence[int]) -> dict[int, trace.Trace]:
        """The collective traces of ``ranks`` as they stand now (ranks without one left out)."""
        traced = [rank for rank in ranks if "trace_file" in self._info.get(rank, {})]
        spans = [(self._info[rank]["host"], self._info[rank]["trace_file"], 0) for rank in traced]
        traces = {}
        for rank, data in zip(traced, self._reader()(spans)):
            try:
                traces[rank] = trace.read(data)
            except (ValueError, struct.error):  # no file there (yet), or one cut short
                pass
        return traces

    def _reader(self) -> Reader:
        """How the engines' stack and trace files are read from here: over ssh for hosts reached by ssh,
        as the batch queue reads its job's nodes (Slurm: through ``srun``, files on a node's own disk), as an
        allocation the engines run in reads its nodes, else (one host) directly."""
        if self.launcher.over_ssh:
            return read_ssh(self.options.get("ssh_command", "ssh"))
        if self._batch is not None and self.launcher.queue is not None:
            reader: Reader = self.launcher.queue.reader(self._batch.job_id)
            return reader
        allocation = self.launcher.allocation
        held = allocation.current() if allocation is not None else None
        if allocation is not None and held is not None:
            reader = allocation.reader(held)
            return reader
        return read_local

    def _signal_where(self, ranks: Sequence[int]) -> None:
        """Deliver the stack-dump signal."""
        self._deliver(WHERE_SIGNAL, ranks)

    def _deliver(self, signum: Any, ranks: Sequence[int]) -> None:
        """Deliver one of the signals the engines' tasks handle: straight to engine processes on this host,
        through the engines' nannies (the controller) elsewhere.

        The direct path does not depend on the controller relaying the message: a rank waiting on
        a verdict or a stack dump gets it at once.
        """
        import os
        import socket

        local = socket.gethostname()
        remote = []
        for rank in ranks:
            info = self._info[rank]
            if info["host"] == local:
                try:
                    os.kill(info["pid"], signum)
                except ProcessLookupError:
                    pass
            else:
                remote.append(rank)
        if remote:
            self._signal(signum.name, remote)

    def _checked(self, ranks: list[int]) -> list[int]:
        if self._state == "dead" or (self._state == "running" and set(ranks) - set(self.alive_ranks())):
            from rapydli.cluster.ensure import ready

            ready(self)  # type: ignore[arg-type]  # (a Cluster) aborted, or an engine died: fresh engines, said in one line
        self._require_running()
        dead = sorted(set(ranks) - set(self.alive_ranks()))
        if dead:
            raise ClusterError(f"engines of ranks {dead} are dead: restart the cluster (`%rapydli restart`)")
        return ranks

    def _submit(self, ranks: list[int], call: Callable[[int], tuple[Any, ...]]) -> dict[int, Any]:
        """Send ``fn(*args)`` (``call(rank)`` gives ``(fn, *args)``) to each rank's engine.

        Interrupted half-way (Ctrl-C while the task is pickled and sent), the ranks that
        already have the task are interrupted too: they would otherwise wait for the
        others in their first collective, and run on after the notebook gave up.
        """
        results: dict[int, Any] = {}
        try:
            for rank in self._checked(ranks):
                fn, *args = call(rank)
                results[rank] = self._client[self._engine_of_rank[rank]].apply_async(fn, *args)
        except BaseException:
            if results:  # the others never get the task: the ranks that have it get FOLLOW_S, as after a rank ended
                self._job(results, on_output=None, grace=FOLLOW_S).cancel()
            raise
        return results

    def _job(self, results: dict[int, Any], **handlers: Any) -> Job:
        # where each rank runs, taken now: an abort (which the job may call) forgets the engines
        where = {rank: info["host"] for rank, info in self._info.items()}
        hosts_down = functools.partial(self._hosts_down, where) if self.launcher.over_ssh else None
        gone = self._batch.gone if self._batch is not None else None
        lost = functools.partial(self._hosts_lost, self._sessions, where) if self._sessions is not None else None
        return Job(
            results,
            interrupt=self._interrupt,
            stop=self._request_stop,
            go_on=self._go_on,
            abort=self.abort,
            hosts_down=hosts_down,
            gone=gone,
            lost_hosts=lost,
            **handlers,
        )

    @staticmethod
    def _hosts_lost(sessions: SessionWatch, where: dict[int, str], ranks: Sequence[int]) -> dict[int, tuple[str, str]]:
        """``{rank: (host, why)}`` for the ``ranks`` whose host ``sessions`` found lost."""
        down = sessions.lost()
        return {rank: (where[rank], down[where[rank]]) for rank in ranks if where.get(rank) in down}

    def _hosts_down(self, where: dict[int, str], ranks: Sequence[int]) -> dict[int, tuple[str, str]]:
        """``{rank: (host, why)}`` for the ``ranks`` whose host (in ``where``) no longer answers over ssh."""
        from rapydli.cluster.sshhosts import unreachable_hosts

        hosts = {rank: where[rank] for rank in ranks if rank in where}
        down = unreachable_hosts(sorted(set(hosts.values())), self.options.get("ssh_command", "ssh"))
        return {rank: (host, down[host]) for rank, host in hosts.items() if host in down}

    def _signal(self, name: str, ranks: Sequence[int]) -> None:
        try:
            self._client.send_signal(name, targets=self._engines(ranks), block=False)
        except Exception:  # noqa: BLE001 - a dead engine cannot be signalled; the abort follows
            pass

    def _interrupt(self, ranks: Sequence[int]) -> None:
        self._signal("SIGINT", ranks)

    def _request_stop(self, ranks: Sequence[int]) -> None:
        self._deliver(engine.STOP_SIGNAL, ranks)

    def _go_on(self, ranks: Sequence[int]) -> None:
        self._deliver(engine.GO_ON_SIGNAL, ranks)
