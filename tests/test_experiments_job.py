"""``TrainingJob``: a run polled by its owner, and its stop escalation, on real engines."""

from __future__ import annotations

import time

import pytest
from interrupt_cases import DeafToStop

import rapydli as rd
from rapydli.experiments.job import TrainingJob
from rapydli.experiments.spec import RunSpec
from rapydli.experiments.store.runstore import open_store

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


def test_a_run_that_ignores_a_stop_request_is_interrupted_after_the_grace(cluster) -> None:
    config = rd.TrainConfig(max_steps=50, batch_size=16, allreduce="mpi")
    job = TrainingJob(cluster, RunSpec.of(DeafToStop, "rapydli.zoo.datasets:digits"), config, [0, 1]).start()
    deadline = time.monotonic() + 60
    while job.start_step is None and not job.poll(0.05) and time.monotonic() < deadline:
        pass  # until the ranks start training (their first step sleeps)
    assert job.state == "running" and job.start_step is not None
    asked = time.monotonic()
    job.request_stop(grace_s=1.0)
    while not job.poll(0.05):
        assert time.monotonic() - asked < 30, "the stop request was never escalated"
    took = time.monotonic() - asked
    assert took > 1.0, "interrupted before the grace was over"
    assert job.state == "stopped", job.error
    assert "did not stop when asked; interrupted" in job.error and "ranks 0, 1 interrupted" in job.error
    assert open_store().get_run(job.run_id)["status"] == "interrupted"
    assert cluster.run(lambda: 1, timeout=10) == [1, 1]  # interrupted, not aborted: the engines live on
