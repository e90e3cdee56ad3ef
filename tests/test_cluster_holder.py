"""A cluster a kernel holds ends with the kernel; ``rapydli cluster stop --all`` stops orphans, not held clusters.

A kernel killed with ``kill -9`` runs no exit handler: its cluster's watchdog
(:mod:`rapydli.cluster.watchdog`) stops the cluster within seconds, idle or with its ranks
blocked in a collective. Each test has a ``RAPYDLI_HOME`` of its own, so the clusters other
tests hold meanwhile are not in its view.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from rapydli.cluster.processes import marked, reap_marked
from rapydli.cluster.watchdog import HOLDER_MARKER

HOLDER = Path(__file__).resolve().parent / "kernel_holder.py"
#: The issue's bound: within 30 s of the kernel's death nothing of its cluster remains.
GONE_WITHIN_S = 30.0


def _hold(mode: str, env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    """A process holding a 2-engine cluster (``mode`` idle or blocked), and the cluster's id."""
    holder = subprocess.Popen([sys.executable, str(HOLDER), mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    line = holder.stdout.readline().strip() if holder.stdout is not None else ""
    if not line:
        holder.kill()
        raise AssertionError(f"the holder did not start its cluster: {holder.communicate(timeout=30)[1][-3000:]}")
    return holder, line


def _watchdog(cluster_id: str) -> psutil.Process:
    (found,) = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and
                "rapydli.cluster.watchdog" in p.info["cmdline"] and cluster_id in p.info["cmdline"]]  # fmt: skip
    return found


def _gone_within(cluster_id: str, seconds: float) -> float:
    """Seconds until no process of ``cluster_id`` is left; fails after ``seconds``."""
    began = time.monotonic()
    while marked(cluster_id):
        assert time.monotonic() - began < seconds, [p.cmdline() for p in marked(cluster_id)]
        time.sleep(0.2)
    return time.monotonic() - began


@pytest.fixture
def home_env(tmp_path: Path):
    """An environment with a RAPYDLI_HOME of this test's own; every cluster under it is reaped afterwards."""
    env = {**os.environ, "RAPYDLI_HOME": str(tmp_path / "home")}
    yield env
    for proc in marked(also={"RAPYDLI_HOME": env["RAPYDLI_HOME"]}, name="RAPYDLI_CLUSTER"):
        reap_marked(proc.environ().get("RAPYDLI_CLUSTER", ""), grace=1.0)


@pytest.mark.engines
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["idle", "blocked"])
def test_a_kernel_killed_with_sigkill_takes_its_cluster_along(home_env: dict[str, str], mode: str) -> None:
    holder, cluster_id = _hold(mode, home_env)
    processes = marked(cluster_id)
    assert len(processes) >= 3  # the controller, mpiexec, the engines
    assert all(p.environ()[HOLDER_MARKER].startswith(f"{holder.pid}:") for p in processes)
    watchdog = _watchdog(cluster_id)
    holder.send_signal(signal.SIGKILL)  # as a crashing kernel dies: no exit handler runs
    holder.wait(10)
    _gone_within(cluster_id, GONE_WITHIN_S)
    watchdog.wait(GONE_WITHIN_S)  # its work done, the watchdog is gone too
    status = subprocess.run([sys.executable, "-m", "rapydli", "cluster", "status"], capture_output=True, text=True,
                            env=home_env, timeout=60)  # fmt: skip
    assert status.stdout.strip() == "no clusters", status.stdout


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_stop_all_stops_orphans_and_leaves_held_clusters_saying_so(home_env: dict[str, str]) -> None:
    cli = [sys.executable, "-m", "rapydli", "cluster"]
    held, held_id = _hold("idle", home_env)
    orphaned, orphan_id = _hold("idle", home_env)
    try:
        _watchdog(orphan_id).kill()  # its watchdog gone first: nothing stops it when its holder dies
        orphaned.send_signal(signal.SIGKILL)
        orphaned.wait(10)
        assert marked(orphan_id)  # left running, an orphan
        status = subprocess.run([*cli, "status"], capture_output=True, text=True, env=home_env, timeout=60).stdout
        rows = {line.split()[0]: line for line in status.splitlines()[1:]}
        assert set(rows) == {held_id, orphan_id}, status
        assert "kernel (gone)" in rows[orphan_id] and "(gone)" not in rows[held_id], status
        stopped = subprocess.run([*cli, "stop", "--all"], capture_output=True, text=True, env=home_env, timeout=120)
        assert stopped.returncode == 0, stopped.stderr
        lines = stopped.stdout.splitlines()
        assert lines == [f"left {held_id}: a running kernel or script holds it", f"stopped {orphan_id}"], lines
        assert not marked(orphan_id) and marked(held_id)
    finally:
        held.stdin.close()  # type: ignore[union-attr]  # it exits normally: ipyparallel or the watchdog stops its cluster
        held.wait(30)
    _gone_within(held_id, GONE_WITHIN_S)  # its watchdog stopped it
    stopped = subprocess.run([*cli, "stop", "--all"], capture_output=True, text=True, env=home_env, timeout=120)
    assert stopped.stdout.strip() == "no cluster to stop", stopped.stdout
