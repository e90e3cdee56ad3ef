"""cluster.where() and ``%rapydli where`` against real MPI engines: stacks asked from outside busy ranks."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output
from processes import wait_until_gone

from rapydli.cluster import Cluster
from rapydli.cluster.where import Frame, RankStacks, ThreadStack, Where, parse

pytestmark = pytest.mark.engines

#: rank 1 sleeps in user code (until the test lets it go); rank 0 waits for it in MPI_Barrier
CELL = """\
import os, time
if rank == 1:
    while not os.path.exists({flag!r}):
        time.sleep(0.05)
comm.Barrier()
rank
"""


EXPECTED = [
    "ranks 0, 2: <module> (<distributed cell>:5): comm.Barrier()",
    "rank 1: <module> (<distributed cell>:4): time.sleep(0.05)",
]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(n=3) as started:
        yield started
    assert not wait_until_gone()


def _blocked_cell(cluster: Cluster, flag: Path) -> tuple[threading.Thread, list]:
    """Run CELL on every rank in a thread of its own (the test asks where() meanwhile)."""
    outcome: list = []
    thread = threading.Thread(
        target=lambda: outcome.append(cluster.run_cell(CELL.format(flag=str(flag)), on_output=None))
    )
    thread.start()
    return thread, outcome


def _wait_for(condition, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_where_names_a_rank_in_a_barrier_and_a_sleeping_rank(cluster, tmp_path):
    flag = tmp_path / "go"
    thread, outcome = _blocked_cell(cluster, flag)
    try:

        def all_in_place():  # at first a rank may still be importing torch
            where = cluster.where()
            return where if str(where).splitlines() == EXPECTED else None

        where = _wait_for(all_in_place)
        assert "rank 0 thread" in where.text(all_threads=True)  # the engines' other threads, on request
    finally:
        flag.touch()
        thread.join(60)
    assert outcome[0][0] == 0
    assert str(cluster.where()) == "ranks 0-2: idle (no task running)"


def test_magic_where_prints_the_grouped_stacks(cluster, ipython_shell, tmp_path):
    shell = ipython_shell
    flag = tmp_path / "go"
    thread, outcome = _blocked_cell(cluster, flag)
    try:

        def grouped():
            with capture_output() as captured:
                shell.run_line_magic("rapydli", "where")  # the cluster running in this kernel
            both = (
                "ranks 0, 2: <module> (<distributed cell>:5): comm.Barrier()",
                "rank 1: <module> (<distributed cell>:4): time.sleep(0.05)",
            )
            return all(line in captured.stdout for line in both)  # rank 1 may still be importing torch at first

        assert _wait_for(grouped)
    finally:
        flag.touch()
        thread.join(60)
    assert outcome[0][0] == 0


@pytest.mark.hosts
def test_where_reaches_ranks_on_other_hosts(hosts, tmp_path):
    """Two hosts over ssh: the signal goes through the engines' nannies, the dumps come back over ssh."""
    import nshosts

    options = {"hosts": ["h1", "h2"], "ssh_command": hosts.ssh, "interface": nshosts.BRIDGE, "transport": "tcp"}
    with Cluster(n=2, launcher="ssh", **options) as remote:
        where = _where_on_two_ranks(remote, tmp_path)
        assert [where.ranks[r].host for r in (0, 1)] == ["h1", "h2"]


def _where_on_two_ranks(cluster: Cluster, tmp_path: Path) -> Where:
    """where() while rank 0 waits in a barrier and rank 1 sleeps, checked; what it answered."""
    flag = tmp_path / "go"
    thread, outcome = _blocked_cell(cluster, flag)
    try:

        def both_in_place():
            where = cluster.where()
            text = str(where)
            return where if "comm.Barrier()" in text and "time.sleep(0.05)" in text else None

        where = _wait_for(both_in_place)
        assert "rank 0: <module> (<distributed cell>:5): comm.Barrier()" in str(where)
        assert "rank 1: <module> (<distributed cell>:4): time.sleep(0.05)" in str(where)
        started = time.monotonic()
        cluster.where()
        print(f"where() answered in {time.monotonic() - started:.2f} s")
    finally:
        flag.touch()
        thread.join(60)
    assert outcome[0][0] == 0
    return where


@pytest.mark.slurm
def test_where_reaches_ranks_in_a_slurm_job(local_slurm, tmp_path):
    """A job over two Slurm nodes: the signal goes to each rank, the dumps come back (shared file system, else srun)."""
    with Cluster(n=2, launcher="slurm", nodes=2, ntasks_per_node=1) as job:
        where = _where_on_two_ranks(job, tmp_path)
        assert not any(where.ranks[r].error for r in (0, 1)), where.ranks


def test_parse_reads_a_faulthandler_dump_and_groups_ranks():
    dump = (
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "<distributed cell>", line 2 in <module>\n'
        '  File "/x/rapydli/cluster/engine.py", line 250 in run_cell\n'
    )
    threads = parse(dump)
    assert [t.task for t in threads] == [False, True]
    assert threads[1].shown() == (Frame("<distributed cell>", 2, "<module>"),)
    where = Where(
        {r: RankStacks(r, "h", threads) for r in (0, 1, 2, 4)}, sources={"<distributed cell>": ["a", "comm.Barrier()"]}
    )
    where.ranks[3] = RankStacks(3, "h", [ThreadStack("0x1", (), False)])
    assert where.text().splitlines() == [
        "ranks 0-2, 4: <module> (<distributed cell>:2): comm.Barrier()",
        "rank 3: idle (no task running)",
    ]
