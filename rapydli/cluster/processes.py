"""Local helper processes: starting one in its own session, ending a process tree, and
finding the processes a cluster started by the marker they carry.

Used for batch items (one papermill process each) and for reaping engine processes after
a cluster stops, so that nothing started by RaPyDLI outlives its owner.

A cluster's processes cannot be found by parentage: ``mpiexec`` and the controller run
in sessions of their own, and an engine's nanny re-parents to init when its engine is
killed. So every process a cluster starts carries ``RAPYDLI_CLUSTER=<cluster id>`` in
its environment (inherited by ``mpiexec``, the ranks, their nannies, the controller and
its schedulers), and :func:`reap_marked` ends every local process that carries it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import IO

import psutil

#: The environment variable every process of a cluster carries; its value is the cluster's id.
CLUSTER_MARKER = "RAPYDLI_CLUSTER"


def spawn_python(
    args: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str], output: IO[str]
) -> subprocess.Popen[bytes]:
    """Start ``python args...`` in a new session (so its whole tree can be ended together)."""
    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=dict(env), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )


def alive(pid: object, started: float | None = None) -> psutil.Process | None:
    """Process ``pid`` of this host if it runs (not a zombie), else ``None``.

    ``started``: its creation time when known (as :func:`started_at` gave it), so that a
    reused pid does not count. What is not an int (a record's missing pid) is ``None``.
    """
    if not isinstance(pid, int) or isinstance(pid, bool):
        return None
    try:
        proc = psutil.Process(pid)
        if started is not None and abs(proc.create_time() - started) > 1.0:
            return None  # the pid was reused by another process
        return proc if proc.status() != psutil.STATUS_ZOMBIE else None
    except (psutil.Error, OSError):
        return None


def started_at(pid: int) -> float | None:
    """Creation time of process ``pid`` (to tell a reused pid apart later), or ``None``."""
    proc = alive(pid)
    try:
        return proc.create_time() if proc is not None else None
    except (psutil.Error, OSError):
        return None


class Spawned:
    """A started program (here, or the ssh session of one on another host), waited for and ended as a whole.

    The interface batch items are run through, shared with
    :class:`rapydli.cluster.slurmprogram.SlurmProgram`: ``wait(timeout)`` (raises
    :class:`subprocess.TimeoutExpired`), ``kill()`` (the whole process tree) and ``exit_text()``.
    """

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the program to exit; its exit status."""
        code = self.proc.wait(timeout=timeout)
        self._close()
        return code

    def kill(self) -> None:
        """End the program and everything it started (idempotent)."""
        terminate_tree(self.proc.pid)
        self.proc.wait()
        self._close()

    def exit_text(self) -> str:
        return f"item process exited with {self.proc.returncode}"

    def _close(self) -> None:
        if self.proc.stdin is not None:  # an ssh session's lifeline (sshhosts.spawn_python): closing it ends it
            self.proc.stdin.close()


def reap(pids: Iterable[int], timeout: float = 5.0) -> None:
    """Wait up to ``timeout`` for processes ``pids`` to exit, then SIGKILL the rest."""
    procs = [proc for proc in map(alive, pids) if proc is not None]
    left = _wait_exited(procs, timeout)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    _wait_exited(left, timeout)


def _wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait up to ``timeout`` until ``procs`` have exited; those still running.

    A zombie has exited: it waits only for its parent (init, for an orphan, in its own
    time) to collect it. This process's own children are collected here.
    """
    deadline = time.monotonic() + timeout
    while True:
        _, running = psutil.wait_procs(procs, timeout=0.05)  # collects this process's children
        procs = [proc for proc in running if not _exited(proc)]
        if not procs or time.monotonic() > deadline:
            return procs


def _exited(proc: psutil.Process) -> bool:
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def terminate_tree(pid: int, grace: float = 3.0) -> None:
    """SIGTERM a process and everything it started (kernels, engines); SIGKILL what remains."""
    terminate_trees([pid], grace)


def terminate_trees(pids: Iterable[int], grace: float = 3.0) -> None:
    """SIGTERM processes ``pids`` and everything they started, all at once; SIGKILL what remains ``grace`` s later.

    All at once: a cluster's controller and engines end in the time the slowest takes,
    not in the sum of their times. Pids of no running process are skipped.
    """
    procs: dict[int, psutil.Process] = {}
    for root in filter(None, map(alive, pids)):
        try:
            for proc in (root, *root.children(recursive=True)):
                procs[proc.pid] = proc
        except psutil.NoSuchProcess:
            continue
    for proc in procs.values():
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    reap(list(procs), timeout=grace)


def marked(
    value: str | None = None, name: str = CLUSTER_MARKER, also: Mapping[str, str] | None = None
) -> list[psutil.Process]:
    """Processes of this host (other than this one) whose environment sets ``name``.

    With ``value``, only those where it equals ``value``; with ``also``, only those whose
    environment has each of its ``{variable: value}`` too (a test session finds its own
    clusters' processes by ``RAPYDLI_HOME``). Processes whose environment cannot be read
    (other users') are left out.
    """
    found = []
    me = os.getpid()
    for proc in psutil.process_iter():
        if proc.pid == me:
            continue
        try:
            env = proc.environ()
        except (psutil.Error, OSError):
            continue
        if (
            name in env
            and (value is None or env[name] == value)
            and all(env.get(k) == v for k, v in (also or {}).items())
        ):
            found.append(proc)
    return found


def reap_marked(value: str, grace: float = 3.0) -> list[int]:
    """SIGTERM every local process marked with cluster id ``value``, SIGKILL what remains.

    ``grace=0`` SIGKILLs them at once and returns without waiting for them to finish
    exiting (an abort: a process with a large address space takes a second or two).

    Returns the pids that were still alive when called (empty when the cluster stopped cleanly).
    """
    procs = marked(value)
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM if grace > 0 else signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    if grace > 0:
        reap((p.pid for p in procs), timeout=grace)
    return [p.pid for p in procs]
