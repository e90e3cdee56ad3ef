"""Finding a cluster's processes by their marker, wherever they were re-parented."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
from processes import engine_pids

from rapydli.cluster.processes import CLUSTER_MARKER, marked, reap_marked

# starts a marked sleeper in its own session and exits, as an engine's nanny is left when its engine is killed
ORPHAN = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
os._exit(0)
"""


def _orphan(cluster_id: str) -> int:
    env = {**os.environ, CLUSTER_MARKER: cluster_id}
    out = subprocess.run(
        [sys.executable, "-c", ORPHAN], env=env, capture_output=True, text=True, check=True, timeout=60
    )
    return int(out.stdout.split()[0])


def test_an_orphan_is_found_by_its_marker_and_reaped() -> None:
    pid = _orphan("test-orphan-1")
    other = _orphan("test-orphan-2")
    try:
        assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}  # parentage cannot see it
        assert pid in engine_pids()  # the suite's leak check does
        assert [p.pid for p in marked("test-orphan-1")] == [pid]
        assert reap_marked("test-orphan-1") == [pid]
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert psutil.pid_exists(other)  # another cluster's processes are left alone
    finally:
        reap_marked("test-orphan-2")
    deadline = time.monotonic() + 10
    while other in engine_pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert other not in engine_pids()
