"""rd.Cluster against real MPI engines: lifecycle, run(), events, launchers, threads, detach."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import psutil
import pytest
from processes import engine_pids, wait_until_gone

from rapydli.cluster import Cluster, launchers, parse_targets
from rapydli.cluster.engine import context
from rapydli.cluster.events import emit
from rapydli.errors import ClusterError, ConfigError, NotFoundError, RankFailure

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=2) as started:
        yield started
    assert not wait_until_gone()


# -- validation happens before anything starts -------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0}, "n=0"),
        ({"n": 2, "launcher": "kubernetes"}, "allowed are local, pbs, slurm, srun, ssh"),
        ({"n": 2, "launcher": "slurm", "gpus": 3}, "no option 'gpus'"),
        ({"n": 2, "launcher": "slurm", "partition": 5}, "must be str"),
        ({"n": 2, "threads": 0}, "threads=0"),
    ],
)
def test_bad_configuration_is_refused_before_starting(kwargs, message):
    before = engine_pids()
    with pytest.raises(ConfigError, match=message):
        Cluster(**kwargs)
    assert engine_pids() == before


def test_launcher_options_become_ipyparallel_config():
    slurm = launchers.get_launcher("slurm")
    config = slurm.config(launchers.validate_options("slurm", {"partition": "gpu", "timelimit": "00:10:00"}))
    assert config == {"SlurmEngines": {"queue": "gpu", "timelimit": "00:10:00"}}
    ssh = launchers.get_launcher("ssh")
    config = ssh.config(launchers.validate_options("ssh", {"hosts": ["a", "b"], "mpi_args": "-bind-to core"}))
    assert config["MPIEngineSetLauncher"]["mpi_args"] == [
        "-hosts",
        "a,b",
        "-prepend-pattern",
        "[host %h rank %r] ",
        "-bind-to",
        "core",
    ]
    # the mpiexec beside this Python, so a venv kernel without the venv on PATH still finds it
    assert config["MPIEngineSetLauncher"]["mpi_cmd"] == [os.path.join(os.path.dirname(sys.executable), "mpiexec")]
    pbs = launchers.get_launcher("pbs")
    config = pbs.config(launchers.validate_options("pbs", {"queue": "batch"}), work_dir="/scratch/me")
    assert config == {"PBSEngineSetLauncher": {"queue": "batch", "batch_file_name": "/scratch/me/pbs_engine.sh"}}


def test_a_launcher_added_by_its_spec_alone_starts_engines_and_runs_batch_items():
    """A launcher is its LauncherSpec: registered as another package's entry point would be, with the
    capabilities of mpiexec on this machine, it starts engines, stops them all and runs batch items,
    with no other file touched."""
    import dataclasses

    from rapydli.experiments.batch.places import LocalPlaces, places

    spec = dataclasses.replace(
        launchers.get_launcher("local"), name="mine", description="mpiexec here, by another name"
    )
    launchers.LAUNCHERS.register("mine", spec)
    try:
        with Cluster(n=2, launcher="mine") as mine:
            assert mine.run(lambda: context().world_size) == [2, 2]
            assert mine.status()["launcher"] == "mine"
        assert not wait_until_gone()
        assert isinstance(places("mine"), LocalPlaces)
    finally:
        launchers.LAUNCHERS.unregister("mine")


def test_the_hub_hears_new_engines_within_its_short_heartbeat(tmp_path):
    """ipyparallel's 3 s heartbeat held every start for up to two periods; the profile's controller file shortens it."""
    from rapydli.cluster.controller_config import HEART_MISSES, HEART_PERIOD_MS, write_controller_config

    text = write_controller_config(tmp_path).read_text()
    assert f"c.HeartMonitor.period = {HEART_PERIOD_MS}" in text and HEART_PERIOD_MS <= 1000
    assert HEART_PERIOD_MS * HEART_MISSES >= 30_000  # a busy engine is not counted dead sooner than before


def test_a_wait_whose_future_timed_out_raises_its_error():
    """Engines that do not register in time fail the start (the wait used to retry that TimeoutError forever)."""
    from concurrent.futures import Future

    from rapydli.cluster.cluster import _wait

    future: Future = Future()
    future.set_exception(TimeoutError("2 engines did not register within 1 s"))
    with pytest.raises(TimeoutError, match="did not register"):
        _wait(future)
    done: Future = Future()
    done.set_result([0, 1])
    assert _wait(done) == [0, 1]


def test_an_mpiexec_that_exits_at_once_fails_the_start_within_seconds_with_its_stderr():
    started = time.monotonic()
    with pytest.raises(ClusterError) as failure:
        Cluster(n=2, mpi_args=["-no-such-flag"], start_timeout=120).start()
    elapsed = time.monotonic() - started
    message = str(failure.value)
    assert re.search(
        r"the engines' launcher \(mpiexec\) exited( with status \d+)? after 0 of 2 engines registered", message
    ), message
    assert "unrecognized argument no-such-flag" in message, message
    assert elapsed < 5, f"the failed start took {elapsed:.1f} s"
    assert not wait_until_gone()


def test_engines_that_never_register_fail_the_start_quoting_what_the_launcher_wrote():
    stuck = ["sh", "-c", "echo waiting for an allocation >&2; exec sleep 600", "mpiexec"]  # the engines never come
    cluster = Cluster(n=2, mpi_cmd=stuck, start_timeout=3)
    with pytest.raises(
        ClusterError, match=r"2 of 2 engines not ready in 3 seconds; the launcher wrote:\n  waiting for an allocation"
    ):
        cluster.start()
    assert cluster.status()["state"] == "failed"
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "600"]], (
        "the launcher was left running"
    )


def test_targets_are_parsed_without_eval():
    assert parse_targets("0,2-3", 4) == [0, 2, 3]
    assert parse_targets([1, 1, 0], 2) == [0, 1]
    for bad in ("__import__('os')", "1-", "3-1", ""):
        with pytest.raises(ConfigError):
            parse_targets(bad, 4)


# -- a running cluster ---------------------------------------------------------------------


def test_status_reports_ranks_hosts_and_threads(cluster):
    status = cluster.status()
    assert status["state"] == "running"
    assert status["engines_alive"] == 2 and status["engines_dead"] == 0
    assert status["ranks"] == [0, 1] and status["hosts"] == [socket.gethostname()]
    assert status["threads_per_engine"] == max(1, len(os.sched_getaffinity(0)) // 2)


def _threads() -> tuple[int, str]:
    import torch

    return torch.get_num_threads(), os.environ["OMP_NUM_THREADS"]


def test_engines_import_torch_and_the_trainer_behind_their_start(cluster):
    """The first run on a running cluster does not wait for torch, TorchDynamo and the trainer to
    import: the engines import them as their first task (warm_up), on their main thread."""
    from rapydli.cluster.engine import WARM_MODULES

    assert cluster.run(lambda: [name for name in WARM_MODULES if name not in sys.modules]) == [[], []]
    assert not cluster.warming


def test_engines_do_not_oversubscribe_cores(cluster):
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert cluster.run(_threads) == [(expected, str(expected))] * 2


def _rank_info(scale: int) -> tuple[int, int, int]:
    ctx = context()
    total = ctx.comm.allreduce(ctx.rank)
    return ctx.rank * scale, ctx.world_size, total


def test_run_gives_each_rank_its_context(cluster):
    assert cluster.run(_rank_info, 10) == [(0, 2, 1), (10, 2, 1)]
    # a sub-group gets its own communicator: rank 1 of the cluster is rank 0 of the group
    assert cluster.run(_rank_info, 10, targets=[1]) == [(0, 1, 0)]


def _slow_events(n: int) -> int:
    for step in range(n):
        emit("metrics", {"step": step, "rank": context().rank})
        time.sleep(0.3)
    return n


def test_events_arrive_while_the_task_runs(cluster):
    arrivals: list[tuple[float, int, dict]] = []
    start = time.monotonic()
    cluster.run(
        _slow_events, 5, on_event=lambda rank, kind, payload: arrivals.append((time.monotonic(), rank, payload))
    )
    end = time.monotonic()
    by_rank = {rank: [p["step"] for _, r, p in arrivals if r == rank] for rank in (0, 1)}
    assert by_rank == {0: [0, 1, 2, 3, 4], 1: [0, 1, 2, 3, 4]}
    first = min(t for t, _, _ in arrivals)
    assert first - start < end - start - 0.6, "the first event should arrive well before the task ends"


def _fail_on(rank: int) -> None:
    if context().rank == rank:
        raise KeyError("missing shard")
    time.sleep(30)


def test_run_raises_one_rank_failure(cluster):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        cluster.run(_fail_on, 0)
    assert time.monotonic() - start < 10
    assert info.value.ranks == [0] and "KeyError" in info.value.failures[0]
    assert cluster.running  # the other rank was interrupted, the engines live on


def test_restart_gives_fresh_engines(cluster):
    before = {info["pid"] for info in cluster._info.values()}
    cluster.restart()
    after = {info["pid"] for info in cluster._info.values()}
    assert cluster.status()["engines_alive"] == 2
    assert before.isdisjoint(after)
    assert not any(psutil.pid_exists(pid) for pid in before)


# -- launchers beyond local ------------------------------------------------------------------


def test_ssh_launcher_spans_the_named_hosts():
    before = engine_pids()
    with Cluster(n=2, launcher="ssh", hosts=[socket.gethostname()]) as started:
        assert started.run(_rank_info, 1) == [(0, 2, 1), (1, 2, 1)]
    assert not wait_until_gone(before)


# -- outliving the process that started it ---------------------------------------------------


def test_cli_started_cluster_can_be_attached_and_stopped(tmp_path):
    env = dict(os.environ)
    rapydli = [sys.executable, "-m", "rapydli"]
    started = subprocess.run(
        [*rapydli, "cluster", "start", "-n", "2"], capture_output=True, text=True, env=env, timeout=120
    )
    assert started.returncode == 0, started.stderr
    cluster_id = started.stdout.strip()
    status = subprocess.run([*rapydli, "cluster", "status"], capture_output=True, text=True, env=env, timeout=60)
    assert cluster_id in status.stdout
    attached = Cluster.attach(cluster_id)
    old_pids = [info["pid"] for info in attached._info.values()]
    attached.restart()  # fresh engines under the same id: the record follows them
    assert Cluster.attach(cluster_id).run(_rank_info, 2) == [(0, 2, 1), (2, 2, 1)]
    pids = [info["pid"] for info in attached._info.values()]
    assert set(pids).isdisjoint(old_pids)
    stopped = subprocess.run(
        [*rapydli, "cluster", "stop", cluster_id], capture_output=True, text=True, env=env, timeout=60
    )
    assert stopped.returncode == 0, stopped.stderr
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(psutil.pid_exists(p) for p in pids)
    with pytest.raises(NotFoundError, match=cluster_id):
        Cluster.attach(cluster_id)


def test_cli_reports_user_mistakes_in_one_line():
    result = subprocess.run(
        [sys.executable, "-m", "rapydli", "cluster", "start", "-n", "2", "--launcher", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("rapydli: error: unknown launcher 'nope'")
    assert "Traceback" not in result.stderr


def _steps_until_stopped(limit: int) -> int:
    from rapydli.cluster.engine import should_stop

    ctx = context()
    for step in range(limit):
        ctx.comm.Barrier()  # a collective every step, as in training
        emit("step", step)
        time.sleep(0.1)
        if should_stop():
            return step
    return limit


def test_jobs_on_disjoint_ranks_run_side_by_side_and_stop_cleanly(cluster):
    steps: dict[int, int] = {}

    def seen(rank: int, kind: str, step: int) -> None:
        steps[rank] = step

    left = cluster.submit(_steps_until_stopped, 10_000, targets=[0], on_event=seen)
    right = cluster.submit(_steps_until_stopped, 10_000, targets=[1], on_event=seen)
    deadline = time.monotonic() + 60
    while not (steps.get(0, 0) >= 1 and steps.get(1, 0) >= 1) and time.monotonic() < deadline:  # both under way
        left.poll(0.05)
        right.poll(0.05)
    left.request_stop()
    while not left.poll(0.05):
        right.poll(0.05)
    right_when_left_ended = steps[1]
    deadline = time.monotonic() + 60
    while steps[1] <= right_when_left_ended and time.monotonic() < deadline:  # the right job goes on alone
        right.poll(0.05)
    right.request_stop()
    stopped_left, stopped_right = left.result()[0], right.wait()[0]
    assert 0 < stopped_left < 10_000 and right_when_left_ended < stopped_right < 10_000, (
        stopped_left,
        stopped_right,
        steps,
    )
    assert cluster.running


def test_stop_request_ends_every_rank_at_the_same_step(cluster):
    steps = []
    job = cluster.submit(_steps_until_stopped, 10_000, on_event=lambda rank, kind, step: steps.append((rank, step)))
    deadline = time.monotonic() + 30
    while not steps and time.monotonic() < deadline:
        job.poll(0.05)
    job.request_stop()
    values = job.wait()
    assert values[0] == values[1] < 10_000  # both ranks agreed on the step; neither left blocked
    assert cluster.running


def test_ctrl_c_during_an_engines_first_torch_import_leaves_torch_usable():
    """SIGINT while the first task imports torch is raised after the import, not inside it:
    an import cut half-way breaks torch in that process for good ("Only a single
    TORCH_LIBRARY ..."), so every later cell on the engine failed."""
    script = """
import os, signal, sys, threading, time
from rapydli.cluster import engine

def interrupt_half_way_through_the_import():
    while "torch.nn" not in sys.modules:  # half-way through torch/__init__.py
        time.sleep(0.001)
    os.kill(os.getpid(), signal.SIGINT)

threading.Thread(target=interrupt_half_way_through_the_import, daemon=True).start()
try:
    engine._import_torch()
    print("not interrupted")
except KeyboardInterrupt:
    import torch
    print("interrupted after the import;", float(torch.ones(2).sum()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "interrupted after the import; 2.0", done.stderr
