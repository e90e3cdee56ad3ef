"""Running code on a cluster's engines: the part of :class:`~rapydli.cluster.Cluster` that
sends tasks (functions, notebook cells) to ranks and watches them as one :class:`Job`.

:class:`ClusterTasks` is a base of ``Cluster``; it reads the cluster's engines (which
engine is which rank, where each runs), its batch job and its ssh sessions, and ends the
cluster through ``Cluster.abort`` when a job must.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from rapydli.cluster import engine
from rapydli.cluster.job import FOLLOW_S, DisplayHandler, EventHandler, Job, OutputHandler, print_output
from rapydli.cluster.targets import parse_targets
from rapydli.cluster.usercode import notebook_cells
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
        results = self._submit(ranks, lambda rank: (engine.run_task, fn, args, kwargs, ranks, on_event is not None, sources))
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
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
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
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        ranks = parse_targets(targets, self.n)
        results = self._submit(ranks, lambda rank: (engine.run_cell, code, ranks, gather or rank == ranks[0]))
        return self._job(results, timeout=timeout, on_output=on_output, on_display=on_display).wait()

    def _checked(self, ranks: list[int]) -> list[int]:
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
        hosts_down = functools.partial(self._hosts_down, where) if self.launcher.name == "ssh" else None
        gone = self._batch.gone if self._batch is not None else None
        lost = functools.partial(self._hosts_lost, self._sessions, where) if self._sessions is not None else None
        return Job(results, interrupt=self._interrupt, stop=self._request_stop, go_on=self._go_on, abort=self.abort, hosts_down=hosts_down, gone=gone,
                   lost_hosts=lost, **handlers)  # fmt: skip

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
        self._signal(engine.STOP_SIGNAL.name, ranks)

    def _go_on(self, ranks: Sequence[int]) -> None:
        self._signal(engine.GO_ON_SIGNAL.name, ranks)
