"""The scheduler job that holds a cluster's engines: waiting for it, watching it, cancelling it.

A batch launcher (``slurm``) submits the engines as one job. Until the engines register
the job may wait in the queue; once they run, the job can still end under them (time
limit, ``scancel`` from outside, a node failure). :class:`BatchJob` asks the scheduler
(``scontrol``) so that each of these is reported with the job id instead of looking like
a hang, and makes sure nothing is left in the queue when the cluster stops.
"""

from __future__ import annotations

import dataclasses
import subprocess
import time
from collections.abc import Callable
from typing import Any

from rapydli.cluster import slurm
from rapydli.cluster.launchers import LauncherSpec
from rapydli.errors import ClusterError

POLL_S = 0.25  # between scheduler queries while waiting for the engines
WATCH_S = 1.0  # at most one scheduler query per this many seconds while tasks run
CANCEL_WAIT_S = 30.0
CAUSE_WAIT_S = 3.0  # how long a completing job's cause is looked for in its output before it is reported as COMPLETING


class BatchJob:
    """One submitted engine job.

    Parameters
    ----------
    job_id
        The scheduler's id of the job.
    state_of
        ``state_of(job_id)`` -> :class:`~rapydli.cluster.slurm.JobState`.
    cancel_command
        The command that cancels a job (the id is appended), e.g. ``["scancel"]``.
    output
        ``output(lines)``: the last lines of the job's output so far (shown when it ends
        early, and searched for why it ends).
    """

    def __init__(
        self,
        job_id: str,
        state_of: Callable[[str], slurm.JobState],
        cancel_command: list[str],
        output: Callable[[int], str] = lambda lines: "",
    ) -> None:
        self.job_id = job_id
        self._state_of = state_of
        self._cancel_command = cancel_command
        self.output = output
        self.state = slurm.JobState(job_id, "SUBMITTED")
        self._checked_at = 0.0

    def refresh(self) -> slurm.JobState:
        """Ask the scheduler for the job's state now (for a completing job, why it ends)."""
        state = self._state_of(self.job_id)
        if state.completing and state.state == "COMPLETING":
            cause = slurm.ending_cause(self.output(200))
            if cause:
                state = dataclasses.replace(state, state=cause)
        self.state = state
        self._checked_at = time.monotonic()
        return self.state

    def describe(self) -> dict[str, Any]:
        """The last known state: ``{"id", "state", "reason", "nodes"}``."""
        return self.state.describe()

    def wait_for_engines(
        self,
        client: Any,
        n: int,
        timeout: float,
        on_state: Callable[[dict[str, Any]], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> None:
        """Wait until ``n`` engines registered with ``client``, watching the job meanwhile.

        Raises
        ------
        ClusterError
            The job ended before the engines were ready, ``timeout`` seconds passed, or
            ``cancelled()`` became true (the caller cancels the job).
        """
        deadline = time.monotonic() + timeout
        last: tuple[str, str] | None = None
        while len(client.ids) < n:
            if cancelled():
                raise ClusterError(f"job {self.job_id} was cancelled while {self._said(self.state)}")
            state = self.refresh()
            if (state.state, state.reason) != last:
                last = (state.state, state.reason)
                if on_state is not None:
                    on_state(state.describe())
            if state.ended:
                tail = self.output(20)
                raise ClusterError(
                    f"job {self.job_id} ended ({self._said(state)}) before its {n} engines were ready"
                    + (f"; its output ends with:\n{tail}" if tail else "")
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"job {self.job_id} was still {self._said(state)} after {timeout:g} s with "
                    f"{len(client.ids)} of {n} engines ready; it was cancelled"
                )
            time.sleep(POLL_S)
        self.refresh()

    def gone(self, fresh: bool = False) -> str:
        """Why the running job's engines are gone (``""`` while it runs).

        Asks the scheduler at most once a second, or now when ``fresh`` (an engine died).
        """
        if fresh or time.monotonic() - self._checked_at >= WATCH_S:
            self.refresh()
        if not self.state.ended:
            return ""
        deadline = time.monotonic() + CAUSE_WAIT_S
        while self.state.state == "COMPLETING" and time.monotonic() < deadline:  # slurmstepd's line is on its way
            time.sleep(POLL_S)
            self.refresh()
        return f"job {self.job_id} ended ({self._said(self.state)}) under its engines"

    def cancel(self) -> None:
        """Cancel the job and wait until it has left the queue (idempotent)."""
        if not self.refresh().ended:
            subprocess.run([*self._cancel_command, self.job_id], capture_output=True, timeout=30)
        deadline = time.monotonic() + CANCEL_WAIT_S
        while self.refresh().in_queue and time.monotonic() < deadline:
            time.sleep(POLL_S)

    @staticmethod
    def _said(state: slurm.JobState) -> str:
        where = f" on {state.nodes}" if state.nodes else ""
        reason = f", reason {state.reason}" if state.reason and state.reason != "None" else ""
        return f"{state.state}{reason}{where}"


def batch_job(launcher: LauncherSpec, ipp_cluster: Any) -> BatchJob | None:
    """The job a batch launcher (one with a :class:`~rapydli.cluster.launchers.BatchQueue`) submitted for
    ``ipp_cluster``'s engines (None for other launchers)."""
    queue = launcher.queue
    if queue is None:
        return None
    job_id = queue.job_id(ipp_cluster)
    if job_id is None:
        raise ClusterError(f"the {launcher.name} launcher's submission returned no job id for the engines")
    return BatchJob(job_id, queue.state, list(queue.cancel), lambda lines: queue.output(ipp_cluster, lines))
