"""``choose_cluster`` / ``ensure_cluster`` / ``ready``: which cluster a call uses, and making it usable.

The rule (given, else the one this process holds, else a new one the call stops) is
checked without starting anything where it can be; a held cluster, one still starting
and one whose engine died are real clusters of real MPI engines.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from processes import session_cluster_pids, wait_until_gone

from rapydli.cluster import Cluster, choose_cluster, current, ensure_cluster
from rapydli.cluster.processes import marked
from rapydli.errors import ConfigError


def test_the_given_cluster_is_used_and_a_new_one_when_none_is_held() -> None:
    assert current() is None
    given = Cluster(n=2)
    chosen, owned = choose_cluster(given, n=4, start=False)
    assert chosen is given and not owned
    chosen, owned = choose_cluster(None, n=3, start=False)
    assert chosen is not given and chosen.n == 3 and owned
    chosen, owned = choose_cluster(None, n=1, need=2, start=False)
    assert chosen.n == 2 and owned  # a new cluster is as large as the call needs
    assert not session_cluster_pids(), "choosing with start=False started something"


def test_a_given_cluster_too_small_is_refused_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="this needs 3 engines and the cluster given has 2: stop it"):
        choose_cluster(Cluster(n=2), need=3)
    assert not session_cluster_pids()


@pytest.mark.engines
def test_the_held_cluster_is_reused_too_small_refused_and_left_running() -> None:
    held = Cluster(n=2).start()
    try:
        assert current() is held
        chosen, owned = choose_cluster(None, n=4)
        assert chosen is held and not owned
        with pytest.raises(ConfigError, match="this needs 3 engines and the cluster running in this kernel has 2"):
            choose_cluster(None, need=3)
        with ensure_cluster(None) as used:
            assert used is held
        assert held.running, "a cluster the call did not start was stopped"
    finally:
        held.stop()
    assert current() is None and not wait_until_gone()


@pytest.mark.engines
def test_a_new_cluster_is_stopped_when_the_call_ends() -> None:
    assert current() is None
    with ensure_cluster(None, n=1) as made:
        cluster_id = made.status()["cluster_id"]
        assert made.running and current() is made
        assert marked(cluster_id), "the new cluster's processes carry its id"
    assert made.status()["state"] == "stopped" and current() is None
    deadline = time.monotonic() + 10
    while marked(cluster_id) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not marked(cluster_id), "the call's own cluster left processes behind"


@pytest.mark.engines
def test_a_starting_cluster_is_waited_for_and_a_degraded_one_restarted(capsys: pytest.CaptureFixture[str]) -> None:
    held = Cluster(n=2).start(wait=False)  # %rapydli start --no-wait
    try:
        assert held.status()["state"] == "starting" and current() is held
        chosen, owned = choose_cluster(None)
        assert chosen is held and not owned and held.running
        assert "waiting for the 2 engines of the cluster being started" in capsys.readouterr().out
        cluster_id = held.status()["cluster_id"]

        os.kill(held.run(os.getpid, targets=[1])[0], signal.SIGKILL)  # an engine dies (OOM kill, segfault)
        deadline = time.monotonic() + 30
        while held.status()["state"] != "degraded" and time.monotonic() < deadline:
            time.sleep(0.2)
        assert held.status()["state"] == "degraded" and current() is held
        chosen, owned = choose_cluster(None)
        assert chosen is held and not owned
        # MPI takes the other rank down after the first: one or both are named
        assert "of the cluster had died; restarting 2 fresh engines" in capsys.readouterr().out
        assert held.running and held.status()["cluster_id"] == cluster_id
        assert held.run(lambda: 1) == [1, 1]
    finally:
        held.stop()
    assert not wait_until_gone()
