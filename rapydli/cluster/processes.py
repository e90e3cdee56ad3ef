"""Local helper processes: starting one in its own session, and ending a process tree.

Used for batch items (one papermill process each) and for reaping engine processes after
a cluster stops, so that nothing started by RaPyDLI outlives its owner.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import IO

import psutil


def spawn_python(
    args: Sequence[str], *, cwd: str | os.PathLike[str], env: Mapping[str, str], output: IO[str]
) -> subprocess.Popen[bytes]:
    """Start ``python args...`` in a new session (so its whole tree can be ended together)."""
    return subprocess.Popen(
        [sys.executable, *args], cwd=cwd, env=dict(env), stdout=output, stderr=subprocess.STDOUT, start_new_session=True
    )


def reap(pids: Iterable[int], timeout: float = 5.0) -> None:
    """Wait up to ``timeout`` for processes ``pids`` to exit, then SIGKILL the rest."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=timeout)


def terminate_tree(pid: int, grace: float = 3.0) -> None:
    """SIGTERM a process and everything it started (kernels, engines); SIGKILL what remains."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    reap((p.pid for p in procs), timeout=grace)
