"""Ctrl-C in ``rd.train`` during its set-up: the cluster start, shipping the task, autotuning.

Ctrl-C is a real SIGINT to the test's main thread (as a kernel interrupt is), sent from a
thread that watches for the phase to begin. Each run must end with ``KeyboardInterrupt``
long before it could have trained to its end, be recorded ``interrupted``, and leave no
process of a cluster it started.
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from interrupt_cases import InterruptWhenShipped, built_then_tell
from processes import session_cluster_pids, wait_until_gone

import rapydli as rd
from rapydli.cluster import current
from rapydli.experiments.store.runstore import open_store
from rapydli.zoo import datasets  # noqa: F401 - imported before any interrupt can land in the import

pytestmark = pytest.mark.engines

#: Ctrl-C must end ``rd.train`` within this many seconds at any phase; left alone, these runs
#: take minutes (thousands of steps; autotuning alone takes tens of seconds).
BOUND_S = 5.0
LONG = {"epochs": 50, "max_steps": 5000, "batch_size": 16, "allreduce": "mpi", "workers": 2}


def _interrupt_when(condition: Callable[[], bool]) -> dict[str, float]:
    """SIGINT to the main thread once ``condition()`` holds; returns ``{"at": monotonic time}``."""
    sent: dict[str, float] = {}
    main = threading.main_thread().ident or 0

    def watch() -> None:
        deadline = time.monotonic() + 300
        while not condition() and time.monotonic() < deadline and "done" not in sent:
            time.sleep(0.05)
        if "done" not in sent:  # never into a later test
            sent["at"] = time.monotonic()
            signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=watch, daemon=True).start()
    return sent


def _last_run() -> dict:
    runs, _ = open_store().list_runs(kind="train", limit=1)
    return runs[0]


def _interrupted(train: Callable[[], object], sent: dict[str, float]) -> float:
    """Run ``train``; it must raise KeyboardInterrupt; seconds from the SIGINT to the raise."""
    try:
        with pytest.raises(KeyboardInterrupt):
            train()
    finally:
        sent["done"] = 0.0
    assert "at" in sent, "the run ended by itself before the phase was reached"
    return time.monotonic() - sent["at"]


@pytest.fixture(scope="module")
def cluster():
    """The module's 2-engine cluster (started by the first test that needs it), stopped at the end."""
    made = rd.Cluster(n=2)
    yield made
    made.stop()
    assert not wait_until_gone(), "the module's cluster left processes behind"


@pytest.fixture
def running(cluster):
    """The module's cluster, running (restarted when a test left it dead after an abort)."""
    if not cluster.running:
        cluster.restart()
    return cluster


def _engine_processes() -> bool:
    return any(
        program in " ".join(_cmdline(pid))
        for pid in session_cluster_pids()
        for program in ("ipyparallel.engine", "rapydli.cluster.mpi_engine")
    )


def _cmdline(pid: int) -> list[str]:
    import psutil

    try:
        return psutil.Process(pid).cmdline()
    except psutil.Error:
        return []


@pytest.mark.parametrize("phase", ["controller", "engines"])
def test_ctrl_c_while_the_cluster_starts(phase: str) -> None:
    assert current() is None and not session_cluster_pids()
    condition = (lambda: bool(session_cluster_pids())) if phase == "controller" else _engine_processes
    sent = _interrupt_when(condition)
    took = _interrupted(
        lambda: rd.train("rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", LONG, progress=False), sent
    )
    print(f"TOOK {took:.2f} s")
    assert took < BOUND_S
    run = _last_run()
    assert run["status"] == "interrupted", run
    assert not wait_until_gone(), "an interrupted start left processes behind"


def test_ctrl_c_while_the_task_is_shipped(running) -> None:
    sent = {"at": 0.0}

    def train() -> None:
        sent["at"] = time.monotonic()  # the SIGINT comes from the pickling, within this call
        rd.train(InterruptWhenShipped(nth=2), "rapydli.zoo.datasets:digits", LONG, cluster=running, progress=False)

    took = _interrupted(train, sent)
    print(f"TOOK {took:.2f} s")
    assert took < BOUND_S
    assert _last_run()["status"] == "interrupted"
    # rank 0 had its task and waited for rank 1 in its first collective: it must not be left
    # there (or training): either it was interrupted, or the cluster was aborted
    if running.running:
        assert running.run(lambda: 1, timeout=10) == [1, 1]
    else:
        assert running.status()["state"] == "dead"


def test_ctrl_c_while_rank_0_autotunes(running, tmp_path: Path) -> None:
    flag = tmp_path / "built"
    sent = _interrupt_when(flag.exists)
    config = {**LONG, "autotune": True}
    model_fn = functools.partial(built_then_tell, str(flag))
    took = _interrupted(
        lambda: rd.train(model_fn, "rapydli.zoo.datasets:digits", config, cluster=running, progress=False), sent
    )
    print(f"TOOK {took:.2f} s")
    assert took < BOUND_S
    assert _last_run()["status"] == "interrupted"


def test_ctrl_c_while_training_ends_with_one_line_naming_the_ranks(running, ipython_shell) -> None:
    """What a user sees after Ctrl-C in ``rd.train``: no stray ``[rank r] KeyboardInterrupt``
    lines and no engine or library frames; the last line names the interrupted ranks and the run."""
    import re

    from IPython.utils.capture import capture_output

    running.restart()  # fresh engines: an earlier test's Ctrl-C may have landed in an engine's `import torch`
    rows: list[dict] = []
    sent = _interrupt_when(lambda: len(rows) >= 2)
    ipython_shell.user_ns.update(rd=rd, LONG=LONG, running=running, rows=rows)
    try:
        with capture_output() as captured:
            outcome = ipython_shell.run_cell(
                'rd.train("rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", LONG, cluster=running,'
                " callbacks=[rows.append], progress=False, live=False)"
            )
    finally:
        sent["done"] = 0.0
    shown = captured.stdout + captured.stderr
    assert isinstance(outcome.error_in_exec, KeyboardInterrupt) and "at" in sent, shown
    last = shown.rstrip().splitlines()[-1]
    # "ranks 0, 1 interrupted" (or, where a rank was blocked in a collective, "rank 1 blocked ... aborted")
    assert re.fullmatch(r"KeyboardInterrupt: Ctrl-C: ranks? [01](, 1)? \w.*; run \S+ recorded as interrupted", last), (
        shown
    )
    assert "0" in last and "1" in last
    assert not [line for line in shown.splitlines() if line.startswith("[rank") and "KeyboardInterrupt" in line], shown
    for internal in (
        "ipyparallel",
        "concurrent/futures",
        "threading.py",
        "rapydli/notebook.py",
        "rapydli/experiments/run.py",
        "rapydli/cluster/",
    ):
        assert internal not in shown, shown
    # IPython always shows the frame that raised (as for %%distributed); every other one of ours is hidden
    assert len(re.findall(r"^File \S*rapydli/", shown, re.M)) == 1, shown
    assert _last_run()["status"] == "interrupted"
