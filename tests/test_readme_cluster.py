"""The README's "On a cluster" examples, executed: the Slurm ones as written against the local
Slurm, the ssh ones against the namespace hosts (``tests/nshosts.py``).

The ssh examples name a site's hosts (``node1``, ``node2``) and network (``eth1``); here
they run with the namespace hosts' names (``h1``, ``h2``), their bridge (``rdnet0``) and
the fixture's ssh wrapper (``ssh_command``, which holds their keys and addresses) put in,
and nothing else changed (:func:`ssh_examples`). The 4 engines the magic example starts
over the two hosts are the suite's one 4-engine cluster on hosts: a sweep and a scaling
study run on it too.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nshosts
import pytest
from IPython.utils.capture import capture_output
from processes import wait_until_gone

import rapydli as rd
from rapydli.cluster import Cluster, current
from rapydli.cluster.registry import stop_cluster
from rapydli.zoo import datasets, models

README = Path(__file__).resolve().parents[1] / "README.md"


def section_examples(title: str) -> list[tuple[str, str]]:
    """``(language, code)`` of each fenced block in the part ``### title`` of the README's "On a cluster"."""
    text = README.read_text()
    section = text.split("\n## On a cluster\n", 1)[1].split("\n## ", 1)[0]
    section = section.split(f"\n### {title}\n", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


def cluster_examples() -> list[tuple[str, str]]:
    """The blocks of the "Slurm" part."""
    return section_examples("Slurm")


def ssh_examples(hosts: nshosts.Hosts) -> list[tuple[str, str]]:
    """The blocks of the "Hosts over ssh" part, with this machine's hosts, network and ssh wrapper put in."""
    swaps = [
        ("node1", "h1"), ("node2", "h2"),
        ("interface=eth1", f"interface={nshosts.BRIDGE} ssh_command={hosts.ssh}"),
        ('interface="eth1"', f'interface="{nshosts.BRIDGE}", ssh_command="{hosts.ssh}"'),
    ]  # fmt: skip
    blocks = []
    for language, code in section_examples("Hosts over ssh"):
        for site, here in swaps:
            code = code.replace(site, here)
        blocks.append((language, code))
    return blocks


def test_the_section_has_magic_python_and_cli_examples():
    languages = [language for language, _ in cluster_examples()]
    assert languages.count("python") >= 3 and "bash" in languages


@pytest.mark.slurm
def test_readme_cluster_examples_run_as_written(local_slurm, ipython_shell):
    before = set(local_slurm.queue())
    shell = ipython_shell
    try:
        _run_examples(shell)
    finally:  # a failed example leaves no cluster behind for later tests
        for record in Cluster.detached():
            stop_cluster(record["id"])
        if shell.run_line_magic("rapydli", "status").get("state") != "stopped":
            shell.run_line_magic("rapydli", "stop")
    assert set(local_slurm.queue()) <= before


def _run_examples(shell) -> None:
    for language, code in cluster_examples():
        if language == "python":
            with capture_output() as captured:
                result = shell.run_cell(code)
            assert result.success, f"{code}\n{result.error_in_exec or result.error_before_exec}\n{captured.stderr}"
            continue
        for line in code.strip().splitlines():
            argv = line.split("#")[0].split()
            assert argv[0] == "rapydli"
            done = subprocess.run([sys.executable, "-m", "rapydli", *argv[1:]], capture_output=True, text=True,
                                  env=dict(os.environ), timeout=300)  # fmt: skip
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            if argv[1:3] == ["cluster", "status"]:
                assert "slurm" in done.stdout and "RUNNING" in done.stdout


# -- Hosts over ssh: the README's examples, then a sweep and a scaling study on their cluster -------------


@pytest.fixture(scope="module")
def readme_hosts(hosts, ipython_shell, tmp_path_factory):
    """The shell after the README's ssh examples ran: the magic's 4 engines over h1, h2 are up."""
    shell = ipython_shell
    workdir = tmp_path_factory.mktemp("readme-ssh")
    (workdir / "hosts.txt").write_text("h1:4\nh2:4\n")  # the hostfile the README's example names
    before = os.getcwd()
    os.chdir(workdir)
    shell.user_ns["rd"] = rd
    try:
        for language, code in ssh_examples(hosts):
            assert language == "python", code
            with capture_output() as captured:
                result = shell.run_cell(code)
            assert result.success, f"{code}\n{result.error_in_exec or result.error_before_exec}\n{captured.stderr}"
        yield shell
    finally:
        os.chdir(before)
        shell.run_line_magic("rapydli", "stop")
    assert not wait_until_gone(), "cluster stop left processes behind here"
    for host in hosts.hosts:
        deadline = time.monotonic() + 10
        while host.pids() != [host.sshd.pid] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert host.pids() == [host.sshd.pid], f"processes left on {host.name}: {host.commands()}"


@pytest.mark.hosts
@pytest.mark.engines
def test_readme_ssh_examples_run_on_the_hosts(readme_hosts, hosts) -> None:
    status = readme_hosts.run_line_magic("rapydli", "status")
    code = next(code for _, code in ssh_examples(hosts) if "%rapydli status" in code)
    claimed = ast.literal_eval(
        re.search(r"'rank_hosts': (\{.*?\})", code).group(1)
    )  # the comment beside %rapydli status
    assert status["state"] == "running" and status["launcher"] == "ssh"
    assert status["rank_hosts"] == claimed == {0: "h1", 1: "h2", 2: "h1", 3: "h2"}
    made = readme_hosts.user_ns["cluster"]  # the examples' clusters are made (options checked), not started
    assert isinstance(made, Cluster) and made.n == 8 and made.options == {"hostfile": "hosts.txt"}


@pytest.mark.hosts
@pytest.mark.engines
def test_a_sweep_runs_its_2_rank_trials_side_by_side_across_the_hosts(readme_hosts) -> None:
    config = rd.TrainConfig(
        batch_size=16, optimizer="sgd", max_steps=6, eval_every=6, epochs=1, allreduce="mpi", seed=0
    )
    result = rd.sweep(
        models.mlp,
        datasets.digits,
        config,
        {"lr": rd.loguniform(0.01, 0.3)},
        trials=2,
        workers_per_trial=2,
        pruner="none",
        cluster=current(),
        live=False,
    )
    assert (result.table["state"] == "COMPLETE").all(), result.table[["state", "error"]].to_string()
    assert list(result.table["ranks"]) == ["0,1", "2,3"]
    trials = [rd.run(run_id) for run_id in result.table["run_id"]]
    assert [trial.records["hosts"] for trial in trials] == [["h1", "h2"], ["h1", "h2"]]  # each trial spans both hosts
    first, second = (trial.info for trial in trials)
    assert first["started"] < second["ended"] and second["started"] < first["ended"], (first, second)  # side by side


@pytest.mark.hosts
@pytest.mark.engines
def test_a_scaling_study_records_the_hosts(readme_hosts) -> None:
    result = rd.scaling_study(
        models.mlp,
        datasets.digits,
        rd.TrainConfig(batch_size=32, allreduce="mpi"),
        workers=[1, 2, 4],
        steps=5,
        repeats=1,
        cluster=current(),
        live=False,
    )
    assert list(result.table["workers"]) == [1, 2, 4]
    assert list(result.table["hosts"]) == ["h1", "h1, h2", "h1, h2"]
    recorded = rd.run(result.run_id).records["table"]
    assert [row["hosts"] for row in recorded] == ["h1", "h1, h2", "h1, h2"]
    points = rd.runs(kind="train")
    point_runs = points[points["parent"] == result.run_id]
    assert sorted(tuple(rd.run(run_id).records["hosts"]) for run_id in point_runs["id"]) == [
        ("h1",),
        ("h1", "h2"),
        ("h1", "h2"),
    ]
