"""Hang detection against real MPI engines: a diagnosis in the cell, then abort or keep waiting."""

from __future__ import annotations

import threading
import time

import hang_cases
import pytest
from processes import wait_until_gone

from rapydli.cluster import Cluster, ready
from rapydli.errors import ConfigError, RankFailure

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=2) as started:
        yield started
    assert not wait_until_gone()


def test_mismatched_collectives_are_diagnosed_and_the_run_aborted(cluster, capfd):
    with pytest.raises(RankFailure) as failure:
        cluster.run(hang_cases.mismatched, hang_timeout_s=3, on_hang="abort")
    message = str(failure.value)
    assert "the task hung and was interrupted: no rank progressed for" in message
    assert (
        "mismatched collectives on world: rank 0 is in allreduce #1 on world, 4 MiB float32; rank 1 is in broadcast #1 on world, 4 MiB float32"
        in message
    )
    assert (
        "rank 1: in broadcast_ <- mismatched (hang_cases.py:22): comm.broadcast_(t, root=0)" in message
    )  # the user's line
    assert "[rapydli] hang: no rank progressed" in capfd.readouterr().err  # shown while the cell runs
    assert cluster.status()["state"] == "dead"
    assert cluster.run(hang_cases.late, "/", hang_timeout_s=3) == [
        0,
        1,
    ]  # the next task brings the aborted engines back itself
    said = capfd.readouterr().out
    assert (
        "[rapydli] the engines of the cluster had died; restarting 2 fresh engines (variables defined on them are gone)"
        in said
    )


def test_a_rank_that_never_arrived_is_named_with_its_stack_and_the_run_waits(cluster, tmp_path):
    flag = tmp_path / "go"
    hangs: list = []

    def on_event(rank, kind, payload):
        if kind == "hang":
            hangs.append(payload)
            flag.touch()  # the diagnosis came: let rank 1 arrive

    job = cluster.submit(hang_cases.late, str(flag), on_event=on_event, hang_timeout_s=2, on_hang="wait")
    assert job.wait() == [0, 1]  # kept waiting, and finished once rank 1 arrived
    (payload,) = hangs
    assert payload["action"] == "wait"
    assert "rank 1 never arrived at allreduce #0 on world, 16 B float32, where rank 0 waits" in payload["diagnosis"]
    assert "rank 1 is at: late (hang_cases.py:30): time.sleep(0.05)" in payload["diagnosis"]


def test_bad_hang_options_are_refused_before_anything_runs(cluster):
    with pytest.raises(ConfigError, match="on_hang='kill' is invalid: one of 'wait', 'abort'"):
        cluster.run(hang_cases.late, "/", on_hang="kill")
    with pytest.raises(ConfigError, match="hang_timeout_s=0 is invalid"):
        cluster.run(hang_cases.late, "/", hang_timeout_s=0)
    assert not threading.active_count() == 0


SKIPPED_CELL = """\
import torch
from rapydli.comm import Communicator
c = Communicator(comm, algorithm="mpi")
if rank == 0:
    c.barrier()
c.allreduce_(torch.ones(2, dtype=torch.float64))
"""


def test_distributed_cell_with_a_collective_inside_an_if_is_diagnosed(cluster, ipython_shell):
    from IPython.utils.capture import capture_output

    ready(cluster)
    with capture_output() as captured, pytest.raises(RankFailure) as failure:
        ipython_shell.run_cell_magic("distributed", "--hang-timeout 3 --on-hang abort", SKIPPED_CELL)
    message = str(failure.value)
    assert (
        "mismatched collectives on world: rank 0 is in barrier #0 on world; rank 1 is in allreduce #0 on world, 16 B float64"
        in message
    )
    assert "rank 0: in barrier <- <module> (<distributed cell>:5): c.barrier()" in message
    assert (
        "rank 1: in allreduce_ <- <module> (<distributed cell>:6): c.allreduce_(torch.ones(2, dtype=torch.float64))"
        in message
    )
    assert "[rapydli] aborting the task (on_hang='abort')" in captured.stderr
    with pytest.raises(Exception, match="--hang-timeout -1 is invalid"):
        ipython_shell.run_cell_magic("distributed", "--hang-timeout -1", "1")


def test_a_send_receive_deadlock_is_named(cluster):
    ready(cluster)
    with pytest.raises(RankFailure) as failure:
        cluster.run(hang_cases.receive_both, hang_timeout_s=3, on_hang="abort", on_output=None)
    assert (
        "deadlocked send/receive pair: rank 0 waits to receive from rank 1 (recv #0 on world from rank 1), "
        "and rank 1 waits to receive from rank 0 (recv #0 on world from rank 0)"
    ) in str(failure.value)
    ready(cluster)


def test_a_training_run_that_hangs_is_aborted_and_the_diagnosis_stored(cluster):
    from rapydli.experiments.job import TrainingJob
    from rapydli.experiments.spec import RunSpec
    from rapydli.experiments.store.runstore import open_store
    from rapydli.trainer.config import TrainConfig

    ready(cluster)
    config = TrainConfig(max_steps=20, batch_size=16, allreduce="mpi", hang_timeout_s=3, on_hang="abort")
    rows: list[dict] = []
    job = TrainingJob(
        cluster, RunSpec.of(hang_cases.LateRank, "rapydli.zoo.datasets:digits"), config, [0, 1], callbacks=[rows.append]
    ).start()
    job.wait()
    assert job.state == "failed"
    hangs = [row for row in rows if row["kind"] == "hang"]  # the live plot draws it (tests/test_live.py)
    assert (
        len(hangs) == 1
        and "rank 1 never arrived at allreduce #" in hangs[0]["diagnosis"]
        and hangs[0]["action"] == "abort"
    )
    assert "rank 1 never arrived at allreduce #" in job.error and "where rank 0 waits" in job.error
    assert "rank 1 is at: forward (hang_cases.py:" in job.error and "time.sleep(600)" in job.error
    stored = open_store().records(job.run_id)["hang"]
    assert "rank 1 never arrived at allreduce #" in str(stored)
    ready(cluster)


def test_a_pipeline_stage_left_waiting_for_an_activation_is_diagnosed(cluster, tmp_path):
    from rapydli.experiments.job import TrainingJob
    from rapydli.experiments.spec import RunSpec
    from rapydli.trainer.config import TrainConfig

    ready(cluster)
    stalled = tmp_path / "stalled"  # stage 0 writes the time its stall began
    cluster.run(_set_environment, "RAPYDLI_TEST_STALLED", str(stalled))
    config = TrainConfig(
        max_steps=20, batch_size=16, pipeline_stages=2, microbatches=2, hang_timeout_s=3, on_hang="abort"
    )
    said: list[float] = []
    job = TrainingJob(
        cluster,
        RunSpec.of(hang_cases.late_stage, "rapydli.zoo.datasets:digits"),
        config,
        [0, 1],
        callbacks=[lambda row: said.append(time.time()) if row["kind"] == "hang" else None],
    ).start()
    job.wait()
    assert job.state == "failed"
    assert "rank 1 waits to receive from rank 0 (recv #" in job.error, job.error  # stage 1, waiting for an activation
    assert "rank 0 is at: forward (hang_cases.py:" in job.error and "time.sleep(600)" in job.error, job.error
    (when,) = said
    after = when - float(stalled.read_text())
    assert after < config.hang_timeout_s + 10, f"diagnosed {after:.1f} s after the stall began"
    ready(cluster)


def _set_environment(name: str, value: str) -> None:
    import os

    os.environ[name] = value
