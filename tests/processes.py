"""Finding processes a test started and must not leave behind (engines, controllers, mpiexec)."""

from __future__ import annotations

import os
import time

import psutil

_MARKERS = ("ipyparallel", "ipengine", "ipcontroller", "mpiexec", "hydra_pmi_proxy")


def engine_pids(root: int | None = None) -> set[int]:
    """Descendants of ``root`` (default: this process) that are MPI engines or their launchers."""
    try:
        children = psutil.Process(root or os.getpid()).children(recursive=True)
    except psutil.NoSuchProcess:
        return set()
    found = set()
    for proc in children:
        try:
            command = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if any(marker in command for marker in _MARKERS):
            found.add(proc.pid)
    return found


def wait_until_gone(before: set[int] = frozenset(), timeout: float = 10.0, root: int | None = None) -> set[int]:
    """Wait until no engine process beyond ``before`` is left; returns those still there."""
    deadline = time.monotonic() + timeout
    left = engine_pids(root) - before
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = engine_pids(root) - before
    return left
