"""Finding processes a test started and must not leave behind (engines, controllers, mpiexec).

Parentage alone misses some: an engine's nanny re-parents to init when its engine is
killed, and a process started in its own session may outlive the one that started it.
So a process also counts when it carries a cluster's marker
(:data:`rapydli.cluster.processes.CLUSTER_MARKER`) and this test session's
``RAPYDLI_HOME`` (each session has its own, see ``conftest.py``), whoever its parent is.
"""

from __future__ import annotations

import os
import time

import psutil

from rapydli.cluster.processes import marked
from rapydli.settings import HOME

_MARKERS = ("ipyparallel", "ipengine", "ipcontroller", "mpiexec", "hydra_pmi_proxy", "rapydli.cluster.mpi_engine")


def engine_pids(root: int | None = None) -> set[int]:
    """Engine processes and their launchers: descendants of ``root`` (default: this process),
    and every process of a cluster started in this test session, wherever it is now."""
    try:
        children = psutil.Process(root or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    found = set()
    for proc in children:
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if any(marker in command for marker in _MARKERS):
            found.add(proc.pid)
    return found | session_cluster_pids()


def session_cluster_pids() -> set[int]:
    """Processes carrying a cluster marker and this session's ``RAPYDLI_HOME``."""
    home = os.environ.get("RAPYDLI_HOME")
    return {proc.pid for proc in marked(also={HOME: home})} if home is not None else set()


def wait_until_gone(before: set[int] = frozenset(), timeout: float = 10.0, root: int | None = None) -> set[int]:
    """Wait until no engine process beyond ``before`` is left; returns those still there."""
    deadline = time.monotonic() + timeout
    left = engine_pids(root) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = engine_pids(root) - before
    return left
