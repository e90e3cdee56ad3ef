"""Hang detection: no rank of a task progresses, so say which rank waits for what, and why.

A :class:`HangWatch` is polled by the task's :class:`~rapydli.cluster.job.Job`. It reads
the ranks' collective traces (:mod:`rapydli.cluster.trace`, files the ranks keep up to
date, read without asking them); a rank progresses when it begins or ends an operation,
or sends an event (a training step's metrics). When no rank progressed for the timeout
while some rank waits in an operation, it asks every rank where it is
(:mod:`rapydli.cluster.where`) and returns one diagnosis (:func:`diagnose`):

* ranks of one group in different operations with the same number: *mismatched
  collectives* ("rank 1 is in broadcast #57 on world; ranks 0, 2, 3 wait in allreduce
  #57, 4 MiB float32");
* a rank of the group that waits in no operation: it *never arrived* (with its stack);
* two ranks each waiting to receive from the other: a *deadlocked send/receive pair*.

The timeout is ``timeout_s``, or by default 5 times the median time between the first
rank's metrics events (a training step) and at least :data:`MIN_TIMEOUT_S`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

from rapydli.cluster.trace import Record, Trace, group_ranks
from rapydli.cluster.where import Where, format_ranks

MIN_TIMEOUT_S = 60.0
STEP_FACTOR = 5.0
CHECK_S = 0.5  # how often the traces are read
ACTIONS = ("wait", "abort")


class HangWatch:
    """Watches one task's ranks for a hang (polled by its :class:`~rapydli.cluster.job.Job`).

    Parameters
    ----------
    traces
        ``traces(ranks)`` reads those ranks' collective traces now (ranks without a trace left out).
    where
        ``where(ranks)`` asks those ranks for their stacks (:meth:`Cluster.where`).
    timeout_s
        Seconds without progress that make a hang; None: 5x the median step, at least 60 s.
    action
        ``"wait"``: report the diagnosis and keep waiting (reported again only after
        progress); ``"abort"``: report it and end the task.
    world_size
        Ranks of the cluster (the ``world`` group's size).
    """

    def __init__(
        self,
        traces: Callable[[Sequence[int]], dict[int, Trace]],
        where: Callable[[Sequence[int]], Where],
        timeout_s: float | None = None,
        action: str = "wait",
        world_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._traces = traces
        self._where = where
        self.timeout_s = timeout_s
        self.action = action
        self.world_size = world_size
        self._clock = clock
        self._progress_at = clock()
        self._checked_at = 0.0
        self._seen: dict[int, tuple[int, float]] = {}
        self._steps: list[float] = []  # seconds between the first rank's metrics events
        self._last_step: float | None = None
        self._reported = False
        self.diagnosis = ""

    def timeout(self) -> float:
        """The seconds without progress that make a hang now."""
        if self.timeout_s is not None:
            return self.timeout_s
        step = statistics.median(self._steps) if self._steps else 0.0
        return max(MIN_TIMEOUT_S, STEP_FACTOR * step)

    def event(self, first_rank: bool, kind: str) -> None:
        """A rank sent an event: progress (the first rank's metrics also time a step)."""
        now = self._clock()
        self._progressed(now)
        if first_rank and kind == "metrics":
            if self._last_step is not None:
                self._steps.append(now - self._last_step)
                del self._steps[:-200]
            self._last_step = now

    def check(self, running: Sequence[int]) -> str:
        """The diagnosis when the ``running`` ranks hang now (once per hang), else ``""``."""
        now = self._clock()
        if not running or now - self._checked_at < CHECK_S:
            return ""
        if now - self._progress_at < self.timeout() / 2:  # events came lately: progress is known without reading traces
            return ""  # (a trace on another host costs an ssh per rank)
        self._checked_at = now
        traces = self._traces(running)
        state = {rank: (t.count, t.active) for rank, t in traces.items()}
        if any(self._seen.get(rank) != seen for rank, seen in state.items()):
            self._seen = state
            self._progressed(now)
            return ""
        idle = now - self._progress_at
        if self._reported or idle < self.timeout() or not any(t.waiting for t in traces.values()):
            return ""
        self._reported = True
        where = self._where(running)
        traces = self._traces(running)  # read again: what the ranks did while they answered
        self.diagnosis = f"no rank progressed for {idle:.0f} s (hang_timeout_s={self.timeout():g}):\n" + diagnose(
            traces, where, running, self.world_size
        )
        return self.diagnosis

    def _progressed(self, now: float) -> None:
        self._progress_at = now
        self._reported = False


def diagnose(traces: dict[int, Trace], where: Where, ranks: Sequence[int], world_size: int) -> str:
    """What keeps the ``ranks`` waiting, from their traces and stacks (see the module's list)."""
    waiting = {rank: t.waiting for rank, t in traces.items() if t.waiting is not None}
    lines: list[str] = []
    blamed: set[int] = set()
    collectives = {rank: r for rank, r in waiting.items() if r.kind not in ("send", "recv")}
    for group in sorted({r.group for r in collectives.values()}):
        members = [m for m in group_ranks(group, world_size) if m in ranks]
        by_op: dict[tuple[str, int], list[int]] = {}
        for rank in members:
            record = collectives.get(rank)
            if record is not None and record.group == group:
                by_op.setdefault((record.kind, record.seq), []).append(rank)
        if len(by_op) > 1:
            ordered = sorted(by_op.items(), key=lambda item: len(item[1]))
            parts = [_in(ranks_in, collectives[ranks_in[0]]) for _, ranks_in in ordered]
            lines.append(f"mismatched collectives on {group}: " + "; ".join(parts))
        absent = [m for m in members if m not in collectives or collectives[m].group != group]
        for rank in absent:
            if rank in waiting and waiting[rank].kind in ("send", "recv"):
                continue  # reported with the point-to-point operations below
            op = max(by_op.items(), key=lambda item: len(item[1]))
            record = collectives[op[1][0]]
            elsewhere = f" (it is in {waiting[rank].describe()})" if rank in waiting else ""
            lines.append(
                f"rank {rank} never arrived at {record.describe()}{elsewhere}, where {format_ranks(op[1])} "
                f"{'waits' if len(op[1]) == 1 else 'wait'}; rank {rank} is at: {where.describe(rank)}"
            )
            blamed.add(rank)
    for rank, record in sorted(waiting.items()):
        if record.kind != "recv":
            continue
        peer = record.peer
        theirs = waiting.get(peer)
        if theirs is not None and theirs.kind == "recv" and theirs.peer == rank:
            if rank < peer:
                lines.append(
                    f"deadlocked send/receive pair: rank {rank} waits to receive from rank {peer} ({record.describe()}), "
                    f"and rank {peer} waits to receive from rank {rank} ({theirs.describe()})"
                )
        elif theirs is not None:
            lines.append(
                f"rank {rank} waits to receive from rank {peer} ({record.describe()}), which is in {theirs.describe()}"
            )
        elif peer not in blamed:
            lines.append(
                f"rank {rank} waits to receive from rank {peer} ({record.describe()}); rank {peer} is at: {where.describe(peer)}"
            )
            blamed.add(peer)
    if not lines:
        lines.append(
            "no mismatch in the traces: "
            + "; ".join(f"rank {r} is in {w.describe()}" for r, w in sorted(waiting.items()))
        )
    return "\n".join(lines) + "\nwhere the ranks are:\n" + "\n".join("  " + line for line in where.text().splitlines())


def _in(ranks: list[int], record: Record) -> str:
    verb = "is in" if len(ranks) == 1 else "wait in"
    return f"{format_ranks(ranks)} {verb} {record.describe()}"
