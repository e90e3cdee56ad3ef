"""Hang detection against real MPI engines: a diagnosis in the cell, then abort or keep waiting."""

from __future__ import annotations

import threading

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
    assert "mismatched collectives on world: rank 0 is in allreduce #1 on world, 4 MiB float32; rank 1 is in broadcast #1 on world, 4 MiB float32" in message
    assert "rank 1: in broadcast_ <- mismatched (hang_cases.py:22): comm.broadcast_(t, root=0)" in message  # the user's line
    assert "[rapydli] hang: no rank progressed" in capfd.readouterr().err  # shown while the cell runs
    ready(cluster)  # the aborted engines come back
    assert cluster.run(hang_cases.late, "/", hang_timeout_s=3) == [0, 1]


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
