"""rapydli.server.manager: background start, failure reporting, stop (also while starting)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

import pytest

from rapydli.errors import ClusterError, NotFoundError
from rapydli.server.manager import ClusterManager


class Recorder:
    """A stand-in cluster whose start waits until released (or cancelled by a stop), to observe the states."""

    def __init__(self, n: int, release: threading.Event, fail: bool = False) -> None:
        self.n, self.release, self.fail = n, release, fail
        self.calls: list[str] = []
        self.cancelled = threading.Event()

    def start(self, *, wait: bool = True) -> None:
        assert not wait  # the manager never blocks in start(): a stop must be able to cancel it
        self.calls.append("start")

    def wait_started(self) -> None:
        deadline = time.monotonic() + 10
        while not (self.release.is_set() or self.cancelled.is_set()) and time.monotonic() < deadline:
            time.sleep(0.005)
        if self.cancelled.is_set():
            raise RuntimeError("the start was cancelled")
        if self.fail:
            raise RuntimeError("mpiexec not found")

    def stop(self) -> None:
        self.calls.append("stop")
        self.cancelled.set()

    def restart(self) -> None:
        self.calls.append("restart")

    def detach(self) -> str:
        self.calls.append("detach")
        return f"ipp-{len(self.calls)}"

    def status(self) -> dict[str, Any]:
        return {"state": "running", "engines_alive": self.n}


def wait_state(manager: ClusterManager, cluster_id: str, state: str, timeout: float = 10) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = manager.get(cluster_id).describe()
        if entry["state"] == state:
            return entry
        time.sleep(0.01)
    raise AssertionError(f"cluster never reached {state}: {manager.get(cluster_id).describe()}")


@pytest.fixture
def made() -> list[Recorder]:
    return []


def factory(made: list[Recorder], release: threading.Event, fail: bool = False):
    def make(n: int, launcher: str, options: Mapping[str, Any], cluster_id: str) -> Recorder:
        made.append(Recorder(n, release, fail))
        return made[-1]

    return make


def test_start_answers_at_once_then_runs(made: list[Recorder]) -> None:
    release = threading.Event()
    manager = ClusterManager(factory(made, release))
    entry = manager.start(2, "local", {})
    assert entry["state"] == "starting" and entry["engines_alive"] == 0
    release.set()
    running = wait_state(manager, entry["id"], "running")
    assert running["engines_alive"] == 2 and running["n"] == 2 and running["launcher"] == "local"
    assert running["attach_id"] == "ipp-2"  # published for notebooks (rd.Cluster.attach)
    assert [c["id"] for c in manager.list()] == [entry["id"]]
    assert manager.stop(entry["id"])["state"] == "stopped"
    assert made[0].calls == ["start", "detach", "stop"]
    assert manager.list() == []


def test_failed_start_reports_the_error(made: list[Recorder]) -> None:
    release = threading.Event()
    release.set()
    manager = ClusterManager(factory(made, release, fail=True))
    entry = manager.start(2, "local", {})
    failed = wait_state(manager, entry["id"], "failed")
    assert "mpiexec not found" in failed["error"]
    with pytest.raises(ClusterError, match="only a running cluster"):
        manager.restart(entry["id"])


def test_stop_all_cancels_a_start_in_progress(made: list[Recorder]) -> None:
    release = threading.Event()  # never set: the engines never come
    manager = ClusterManager(factory(made, release))
    entry = manager.start(2, "local", {})
    deadline = time.monotonic() + 10
    while not made and time.monotonic() < deadline:
        time.sleep(0.005)
    started = time.monotonic()
    manager.stop_all()
    assert time.monotonic() - started < 5  # not the start's own 10 s
    assert made[0].calls == ["start", "stop"] and manager.list() == []
    with pytest.raises(NotFoundError):
        manager.get(entry["id"])


def test_restart_and_unknown_ids(made: list[Recorder]) -> None:
    release = threading.Event()
    release.set()
    manager = ClusterManager(factory(made, release))
    entry = manager.start(1, "local", {})
    wait_state(manager, entry["id"], "running")
    assert manager.restart(entry["id"])["state"] in ("restarting", "running")
    wait_state(manager, entry["id"], "running")
    assert made[0].calls[-2:] == ["restart", "detach"]
    with pytest.raises(NotFoundError):
        manager.get("nope")
    manager.stop_all()


def test_stop_without_waiting_answers_at_once_and_the_entry_shows_stopping(made: list[Recorder]) -> None:
    release = threading.Event()
    manager = ClusterManager(factory(made, release))
    entry = manager.start(2, "local", {})
    answered = manager.stop(entry["id"], wait=False)  # the start is still waiting: the stop must not wait for it
    assert answered["state"] == "stopping"
    assert [c["state"] for c in manager.list()] in (["stopping"], [])
    deadline = time.monotonic() + 5  # the start is cancelled: no release needed
    while manager.list() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager.list() == []
    assert not made or made[0].calls == ["start", "stop"]  # cancelled before or after the cluster was made
    with pytest.raises(NotFoundError):
        manager.stop("c-unknown", wait=False)


@pytest.mark.engines
def test_the_panel_and_the_cli_name_a_cluster_alike() -> None:
    """A cluster the server starts (the lab panel's) runs under its entry's id: `rapydli cluster status`
    lists that id and `rapydli cluster stop <id>` stops it; the server then no longer lists it."""
    import subprocess
    import sys

    from rapydli.cluster.registry import running_clusters

    manager = ClusterManager()
    try:
        cluster_id = manager.start(1, "local", {})["id"]
        deadline = time.monotonic() + 120
        while manager.describe(cluster_id)["state"] == "starting" and time.monotonic() < deadline:
            time.sleep(0.1)
        shown = manager.describe(cluster_id)
        assert shown["state"] == "running" and shown["attach_id"] == cluster_id, shown
        assert [c["id"] for c in manager.list()] == [cluster_id]  # listed once, under the one id
        assert cluster_id in [c["id"] for c in running_clusters()]
        rapydli = [sys.executable, "-m", "rapydli", "cluster"]
        status = subprocess.run([*rapydli, "status"], capture_output=True, text=True, timeout=60)
        assert cluster_id in status.stdout, status.stdout
        stopped = subprocess.run([*rapydli, "stop", cluster_id], capture_output=True, text=True, timeout=60)
        assert stopped.returncode == 0 and f"stopped {cluster_id}" in stopped.stdout, stopped.stderr
        assert cluster_id not in [c["id"] for c in manager.list()]
    finally:
        manager.stop_all()
