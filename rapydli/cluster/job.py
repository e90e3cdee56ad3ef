"""Watching a task on several engines until every rank is done, failed, or dead.

This is where the failure semantics live, shared by ``%%distributed``, ``rd.train`` and
sweeps:

* output is streamed live, each line prefixed with its rank, and none is lost when a
  rank fails;
* the first exception on any rank interrupts the other ranks (SIGINT through the
  engines' nannies); ranks still running after a grace period are blocked, typically in
  a collective that waits for the failed rank, so the MPI job is aborted;
* a dead engine (segfault, ``os._exit``, OOM kill) ends the task at once;
* a timeout, or Ctrl-C in the notebook, interrupts the same way;
* the scheduler job holding the engines ending under them (time limit, ``scancel``, a
  node failure) ends the task at once, naming the job and the ranks lost;
* a host found lost while the task runs (``lost_hosts``: its link or the whole machine
  gone, with its engines still registered) ends the task at once, naming its ranks and
  the host;
* no rank progressing for the hang timeout (``hang``: a :class:`~rapydli.cluster.hang.HangWatch`)
  prints one diagnosis (which rank waits in which collective, which never arrived), then
  the task goes on waiting or is interrupted, as the watch's ``action`` says.

The outcome is one :class:`~rapydli.errors.RankFailure` naming the ranks, with their
remote tracebacks, or ``KeyboardInterrupt`` re-raised after the engines stopped.
"""

from __future__ import annotations

import concurrent.futures
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ipyparallel.error import EngineError, RemoteError

from rapydli.cluster import events
from rapydli.cluster.usercode import cells_named, condensed, user_frames_first
from rapydli.errors import RankFailure

if TYPE_CHECKING:
    from ipyparallel.client.asyncresult import AsyncResult

    from rapydli.cluster.hang import HangWatch

OutputHandler = Callable[[int, str, str], None]  # (rank, "stdout" | "stderr", line)
EventHandler = Callable[[int, str, Any], None]  # (rank, kind, payload)
DisplayHandler = Callable[[dict[str, Any]], None]  # display_data content from the first rank

GRACE_S = 3.0  # how long interrupted ranks get before the job is aborted
#: After Ctrl-C, once one rank has ended, how long the others get: a rank still running then
#: is blocked in a collective waiting for the ended one, and only the abort ends it.
FOLLOW_S = 1.5
#: After a rank raises, how long the other ranks get to end by themselves before they are
#: interrupted: a rank failing the same way then reports its own traceback (a SIGINT that
#: arrives while IPython formats a traceback leaves only the exception's last line).
SETTLE_S = 1.0
POLL_S = 0.05


def print_output(rank: int, stream: str, line: str) -> None:
    """Default output handler: ``[rank r] line`` on the notebook's stdout or stderr."""
    print(f"[rank {rank}] {line}", file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)


@dataclass
class _Rank:
    rank: int
    result: AsyncResult
    status: str = "running"  # running | ok | error | interrupted | dead | aborted | lost
    value: Any = None
    error: str = ""
    finished_at: float = 0.0
    offsets: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    partial: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    events_seen: int = 0
    outputs_seen: int = 0
    host_down: str = ""  # the host of a rank that died with it


class Job:
    """A task running on several ranks: one :class:`AsyncResult` per rank.

    Made by :meth:`Cluster.submit`. ``wait()`` blocks until it ends; ``poll()`` advances
    it one step, so a caller can watch several jobs at once (sweeps run trials side by
    side). ``request_stop()`` asks the ranks to stop at their next step boundary
    (cooperative: ranks see :func:`rapydli.cluster.engine.should_stop`); ``interrupt()``
    stops them now.

    Parameters
    ----------
    results
        ``{rank: AsyncResult}`` for the ranks running the task.
    interrupt, stop
        Send SIGINT / the stop request to the given ranks.
    go_on
        Send "go on" to the given ranks (the answer to a report they wait on,
        :func:`rapydli.cluster.engine.await_verdict`); None where the cluster cannot.
    abort
        Called to abort the MPI job when interrupted ranks do not stop (they are blocked).
    gone
        ``gone(fresh)`` returns why the engines are gone (their batch job ended), or
        ``""``; polled, with ``fresh=True`` once a rank died (ask the scheduler now).
    timeout
        Seconds before the task is interrupted and fails (None: no limit).
    on_output, on_event, on_display
        Handlers for streamed lines, events, and rich output of the first rank.
    hosts_down
        Given the ranks that died or were aborted, ``{rank: (host, why)}`` for those
        whose host is down: they are then the ones named (the others died because MPI tore
        the job down after losing them).
    lost_hosts
        Polled while ranks run: given the running ranks, ``{rank: (host, why)}`` for those
        whose host is lost now; they are named and the MPI job is aborted at once.
    hang
        Polled while ranks run: the diagnosis of a hang (printed, sent as a ``"hang"``
        event, and in the failure when its action is ``"abort"``).
    """

    def __init__(
        self,
        results: dict[int, AsyncResult],
        *,
        interrupt: Callable[[Sequence[int]], None],
        stop: Callable[[Sequence[int]], None],
        abort: Callable[[], None],
        go_on: Callable[[Sequence[int]], None] | None = None,
        timeout: float | None = None,
        on_output: OutputHandler | None = print_output,
        on_event: EventHandler | None = None,
        on_display: DisplayHandler | None = None,
        grace: float = GRACE_S,
        hosts_down: Callable[[Sequence[int]], dict[int, tuple[str, str]]] | None = None,
        gone: Callable[[bool], str] | None = None,
        lost_hosts: Callable[[Sequence[int]], dict[int, tuple[str, str]]] | None = None,
        hang: HangWatch | None = None,
    ) -> None:
        self.ranks = {rank: _Rank(rank, ar) for rank, ar in results.items()}
        self._interrupt = interrupt
        self._stop = stop
        self._go_on = go_on
        self._abort = abort
        self._gone = gone
        self.timeout = timeout
        self.on_output = on_output
        self.on_event = on_event
        self.on_display = on_display
        self.grace = grace
        self.hosts_down = hosts_down
        self.lost_hosts = lost_hosts
        self.hang = hang
        self.aborted = False
        self.stop_requested = False
        self.finished = False
        self._first = min(self.ranks)
        self._start = time.monotonic()
        self._interrupted_at: float | None = None
        self._reason = ""

    # -- public --------------------------------------------------------------------------

    def poll(self, wait_s: float = 0.0) -> bool:
        """Advance the job: wait up to ``wait_s`` for a rank, stream output, handle failures.

        Returns True once every rank has ended (then :meth:`result` answers).
        """
        if self.finished:
            return True
        self._wait_any(wait_s)
        self._pump()
        self._collect()
        self._check_gone()
        self._check_hosts()
        self._check_hang()
        now = time.monotonic()
        if self._interrupted_at is None:
            self._reason = self._failure_reason(now - self._start)
            if self._reason and self._settled(now):
                self.interrupt()
        elif now - self._interrupted_at > self.grace and self._running():
            self._abort_job()
        if not self._running():
            self._finish_output()
            self.finished = True
        return self.finished

    def wait(self) -> list[Any]:
        """Wait for every rank; return their values in rank order, or raise.

        Raises
        ------
        RankFailure
            A rank raised, died, or the timeout passed.
        KeyboardInterrupt
            Re-raised after the ranks were interrupted (Ctrl-C in the notebook).
        """
        __tracebackhide__ = True  # noqa: F841 - IPython shows the user's cell, not these frames
        try:
            while not self.poll(POLL_S):
                pass
        except KeyboardInterrupt:
            self.cancel()
            raise KeyboardInterrupt(self.interrupt_summary()) from None
        return self.result()

    def cancel(self) -> None:
        """Interrupt the running ranks and return once all have ended (Ctrl-C's path).

        Ranks still running after the grace period are blocked and the MPI job is aborted.
        """
        self.interrupt()
        self._settle()
        self._finish_output()
        self.finished = True

    def interrupt_summary(self) -> str:
        """One line saying which ranks Ctrl-C interrupted (and which were aborted), after :meth:`cancel`."""
        by_status: dict[str, list[int]] = {}
        for r in sorted(self.ranks.values(), key=lambda r: r.rank):
            by_status.setdefault(r.status, []).append(r.rank)
        parts = []
        for status, words in (
            ("interrupted", "interrupted"),
            ("aborted", "blocked (e.g. in a collective), so the MPI job was aborted: `%rapydli restart` to continue"),
            ("ok", "had already finished"),
            ("error", "had raised"),
            ("dead", "had died"),
        ):
            ranks = by_status.get(status)
            if ranks:
                parts.append(f"{'ranks' if len(ranks) > 1 else 'rank'} {', '.join(map(str, ranks))} {words}")
        return "Ctrl-C: " + "; ".join(parts)

    def result(self) -> list[Any]:
        """Values of the ranks in rank order, or the :class:`RankFailure` raised."""
        if not self.finished:
            raise RuntimeError("the job is still running: poll() or wait() first")
        if any(r.status != "ok" for r in self.ranks.values()):
            raise self._failure(self._reason or "failed")
        return [self.ranks[rank].value for rank in sorted(self.ranks)]

    def request_stop(self) -> None:
        """Ask the ranks to stop at their next step boundary (they end normally)."""
        self.stop_requested = True
        running = [r.rank for r in self._running()]
        if running:
            self._stop(running)

    def go_on(self, ranks: Sequence[int]) -> None:
        """Tell ``ranks`` (those still running) to go on past the report they wait on
        (:func:`rapydli.cluster.engine.await_verdict`)."""
        running = [r.rank for r in self._running() if r.rank in ranks]
        if running and self._go_on is not None:
            self._go_on(running)

    def interrupt(self) -> None:
        """Interrupt the running ranks now (SIGINT); blocked ones are aborted after the grace."""
        if self._interrupted_at is None:
            self._interrupted_at = time.monotonic()
        running = [r.rank for r in self._running()]
        if running:
            self._interrupt(running)

    # -- phases --------------------------------------------------------------------------

    def _running(self) -> list[_Rank]:
        return [r for r in self.ranks.values() if r.status == "running"]

    def _wait_any(self, seconds: float) -> None:
        futures = [r.result for r in self._running()]
        if futures:
            concurrent.futures.wait(futures, timeout=seconds, return_when=concurrent.futures.FIRST_COMPLETED)

    def _collect(self) -> None:
        for r in self._running():
            if not r.result.done():
                continue
            try:
                r.value = r.result.get(0)
                r.status = "ok"
            except TimeoutError:
                # the future is done, but ipyparallel marks the result ready from its own thread
                # a moment later (seen once as "Result not ready." on a failed cell): next poll
                continue
            except EngineError as exc:
                r.status, r.error = "dead", f"the engine process died ({exc})"
            except RemoteError as exc:
                if exc.ename == "EngineError":  # raised client-side for a task whose engine died
                    r.status, r.error = "dead", f"the engine process died ({exc.evalue})"
                else:
                    r.status = "interrupted" if exc.ename == "KeyboardInterrupt" else "error"
                    r.error = _traceback_text(exc)
            r.finished_at = time.monotonic()

    def _check_gone(self) -> None:
        """The engines' batch job ended: its ranks are lost (not failed by themselves); the cluster is dead."""
        died = [r for r in self.ranks.values() if r.status == "dead"]
        if self._gone is None or not (self._running() or died):
            return
        reason = self._gone(bool(died))
        if not reason:
            return
        for r in [*self._running(), *died]:
            r.status, r.error, r.finished_at = "lost", reason, time.monotonic()
        self._reason = reason
        self._interrupted_at = time.monotonic()
        self._abort()

    def _check_hosts(self) -> None:
        """Ranks on a host found lost are dead; the others cannot go on in their MPI job, which is aborted
        (at once, also when a rank already failed for the loss: no grace for ranks that wait on a lost host)."""
        if self.lost_hosts is None or not self._running():
            return
        down = self.lost_hosts([r.rank for r in self.ranks.values() if r.status in ("running", "dead")])
        if not down:
            return
        self._mark_hosts_down(down)
        self.hosts_down = None  # known already: not asked again when the failure is built
        self._reason = "failed"
        self._interrupted_at = self._interrupted_at or time.monotonic()
        self._abort_job()

    def _check_hang(self) -> None:
        """No rank progressed for the hang timeout: say why; interrupt the task if the watch's action is abort."""
        if self.hang is None or self._interrupted_at is not None or self._reason:
            return
        diagnosis = self.hang.check([r.rank for r in self._running()])
        if not diagnosis:
            return
        then = (
            "aborting the task (on_hang='abort')"
            if self.hang.action == "abort"
            else "still waiting (on_hang='wait'; Ctrl-C ends it)"
        )
        if self.on_output is not None:
            print(f"[rapydli] hang: {diagnosis}\n[rapydli] {then}", file=sys.stderr, flush=True)
        if self.on_event is not None:
            self.on_event(self._first, "hang", {"diagnosis": diagnosis, "action": self.hang.action})
        if self.hang.action == "abort":
            self._reason = "hung"
            self.interrupt()

    def _failure_reason(self, elapsed: float) -> str:
        if any(r.status in ("error", "dead") for r in self.ranks.values()):
            return "failed"
        if self.timeout is not None and elapsed > self.timeout:
            return f"timed out after {self.timeout:g} s"
        return ""

    def _settled(self, now: float) -> bool:
        """True once the other ranks may be interrupted: at once, unless the failure is an
        exception raised :data:`SETTLE_S` ago or less."""
        raised = [r.finished_at for r in self.ranks.values() if r.status == "error"]
        if not raised or any(r.status == "dead" for r in self.ranks.values()):
            return True
        return now - min(raised) >= SETTLE_S

    def _settle(self) -> None:
        """After an interrupt: give ranks the grace period, then abort the stragglers."""
        deadline = time.monotonic() + self.grace
        while self._running() and time.monotonic() < deadline:
            self._wait_any(POLL_S)
            self._pump()
            self._collect()
            since = self._interrupted_at or 0.0
            ended = [r.finished_at for r in self.ranks.values() if r.status != "running" and r.finished_at >= since]
            if ended:
                deadline = min(deadline, min(ended) + FOLLOW_S)
        if self._running():
            self._abort_job()

    def _abort_job(self) -> None:
        self._wait_output()  # the abort stops the controller, so no output arrives after it
        self._pump()
        self._abort()
        self.aborted = True
        for r in self._running():
            r.status = "aborted"
            r.error = "still running (blocked, e.g. in a collective) after the interrupt; the MPI job was aborted"

    # -- output --------------------------------------------------------------------------

    def _pump(self) -> None:
        for r in self.ranks.values():
            for stream in ("stdout", "stderr"):
                text = getattr(r.result, stream) or ""
                fresh = text[r.offsets[stream] :]
                if not fresh:
                    continue
                r.offsets[stream] = len(text)
                lines = (r.partial[stream] + fresh).split("\n")
                r.partial[stream] = lines.pop()
                for line in lines:
                    self._emit_line(r.rank, stream, line)
            if self.on_event is not None:
                fresh_events, r.events_seen = events.new_events(r.result.data or {}, r.events_seen)
                for kind, payload in fresh_events:
                    if self.hang is not None:
                        self.hang.event(r.rank == self._first, kind)
                    self.on_event(r.rank, kind, payload)
            if self.on_display is not None and r.rank == self._first:
                outputs = r.result.outputs or []
                for content in outputs[r.outputs_seen :]:
                    self.on_display(content)
                r.outputs_seen = len(outputs)

    def _emit_line(self, rank: int, stream: str, line: str) -> None:
        if self.on_output is not None:
            self.on_output(rank, stream, line)

    def _wait_output(self) -> None:
        for r in self.ranks.values():
            if r.status in ("ok", "error", "interrupted"):
                try:
                    r.result.wait_for_output(timeout=2)
                except Exception:  # noqa: BLE001 - output is best effort once a rank is gone
                    pass

    def _finish_output(self) -> None:
        if self.finished:
            return
        if not self.aborted:
            self._wait_output()
        self._pump()
        for r in self.ranks.values():
            for stream, rest in r.partial.items():
                if rest:
                    self._emit_line(r.rank, stream, rest)
                    r.partial[stream] = ""

    # -- the error -----------------------------------------------------------------------

    def _failure(self, reason: str) -> RankFailure:
        states = self.ranks.values()
        self._blame_hosts_down()
        culprits = [r for r in states if r.status in ("error", "dead", "lost")]
        if not culprits:  # a timeout: the ranks that did not finish are the ones to name
            culprits = [r for r in states if r.status in ("interrupted", "aborted")]
        dead = sorted((r for r in culprits if r.status == "dead"), key=lambda r: r.finished_at)
        if dead and len(dead) == len(culprits) and len(dead) > 1:
            # MPI tears down the whole job when one rank dies: the first to go is the cause.
            culprits = dead[:1]
        names = ", ".join(str(r.rank) for r in sorted(culprits, key=lambda r: r.rank))
        plural = "s" if len(culprits) > 1 else ""
        full = {r.rank: cells_named(r.error.rstrip()) for r in culprits}
        said: dict[
            str, list[_Rank]
        ] = {}  # each rank's failure as the user reads it, ranks failing the same way together
        for r in sorted(culprits, key=lambda r: r.rank):
            said.setdefault(f"({r.status})\n{condensed(full[r.rank])}", []).append(r)
        verb = _verb(culprits, reason)
        if len(said) == 1 and len(culprits) > 1 and verb == "raised exceptions":
            verb = "raised the same exception"
        lines = [f"{'rank' + plural} {names} {verb}"]
        if reason == "hung" and self.hang is not None:
            lines[0] = f"the task hung and was interrupted: {self.hang.diagnosis}\ninterrupted: {lines[0]}"
        down = sorted({r.host_down for r in culprits if r.host_down})
        if down:
            lines[0] += f": host{'s' if len(down) > 1 else ''} {', '.join(down)} down"
        for text, group in said.items():
            status, _, error = text.partition("\n")
            ranks = ", ".join(str(r.rank) for r in group)
            lines.append(f"--- rank{'s' if len(group) > 1 else ''} {ranks} {status} ---\n{error}")
        others = [r for r in states if r not in culprits and r.status != "ok"]
        if others:
            lines.append(
                "other ranks: "
                + ", ".join(f"{r.rank} {r.status}{_where(r)}" for r in sorted(others, key=lambda r: r.rank))
            )
        if self.aborted or any(r.status in ("dead", "lost") for r in states):
            lines.append("the engines were stopped; run `%rapydli restart` (or Cluster.restart()) to continue")
        died = all(
            r.status in ("dead", "lost") for r in culprits
        )  # processes, hosts or the batch job gone: no exception of the user
        return RankFailure("\n".join(lines), full, died=bool(culprits) and died)

    def _blame_hosts_down(self) -> None:
        """Ranks on a host that is down are the dead ones; ranks that died after them were aborted."""
        lost = [r.rank for r in self.ranks.values() if r.status in ("dead", "aborted")]
        if self.hosts_down is None or not lost:
            return
        down = self.hosts_down(lost)
        if down:
            self._mark_hosts_down(down)
        self.hosts_down = None  # asked once

    def _mark_hosts_down(self, down: dict[int, tuple[str, str]]) -> None:
        """The ranks of ``down`` died with their host; ranks that died besides were ended by MPI after them."""
        for r in self.ranks.values():
            if r.rank in down:
                r.host_down, why = down[r.rank]
                r.status, r.error = "dead", f"host {r.host_down} is down: {why}"
            elif r.status == "dead":
                r.status = "aborted"
                r.error = f"ended by MPI after the loss of rank(s) {sorted(down)} ({r.error})"


def _where(r: _Rank) -> str:
    """What an interrupted rank said it was doing (``KeyboardInterrupt: <where>``), in parentheses."""
    lines = r.error.strip().splitlines()
    said = (
        lines[-1].removeprefix("KeyboardInterrupt: ") if lines and lines[-1].startswith("KeyboardInterrupt: ") else ""
    )
    return f" ({said})" if r.status == "interrupted" and said else ""


def _verb(culprits: list[_Rank], reason: str) -> str:
    if reason == "hung":
        return "were still waiting" if len(culprits) > 1 else "was still waiting"
    if reason.startswith("timed out") or any(r.status == "lost" for r in culprits):
        return f"lost: {reason}" if not reason.startswith("timed out") else reason
    if all(r.status == "dead" for r in culprits):
        return "died"
    return "raised an exception" if len(culprits) == 1 else "raised exceptions"


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_INTERNAL = ("ipyparallel/engine/", "rapydli/cluster/engine.py", "Could not get source")


def _traceback_text(exc: RemoteError) -> str:
    """The remote traceback as plain text, without the engine's own frames."""
    text = _ANSI.sub("", exc.traceback or "") or f"{exc.ename}: {exc.evalue}"
    blocks = text.split("\n\n")
    kept = [b for b in blocks if not any(marker in b for marker in _INTERNAL)]
    return user_frames_first("\n\n".join(kept).strip())
