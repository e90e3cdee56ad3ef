"""The ``slurm`` launcher against a real Slurm 22.05 on this machine (nodes n1, n2), and its script.

The ``local_slurm`` fixture (``tests/local_slurm.py``) brings Slurm up once per session;
``MpiDefault=none`` there, as in a fresh slurm.conf. The script tests need no Slurm.
"""

from __future__ import annotations

import _thread
import signal
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from traitlets.config import Config

from rapydli.cluster import Cluster, launchers
from rapydli.cluster.slurm import SlurmEngines
from rapydli.errors import ClusterError, ConfigError, RankFailure

# -- the batch script and the options (no Slurm needed) ------------------------------------------


def _script(n: int, tmp_path, **options) -> str:
    spec = launchers.get_launcher("slurm")
    config = Config(spec.config(launchers.validate_options("slurm", options), work_dir=str(tmp_path)))
    engines = SlurmEngines(config=config, work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="abc")
    engines.program = ["python", "-m", "ipyparallel.engine"]
    return engines.script(n)


def test_slurm_script_carries_the_options_users_set(tmp_path):
    script = _script(
        4,
        tmp_path,
        nodes=2,
        ntasks_per_node=2,
        cpus_per_task=8,
        gpus_per_node=4,
        partition="gpu",
        account="dl-lab",
        qos="high",
        timelimit="01:00:00",
        constraint="a100",
        sbatch=["--exclusive", "#SBATCH --mem=0"],
        setup=["module load cuda/12", "source $HOME/venv/bin/activate"],
    )
    lines = script.splitlines()
    for expected in (
        "#SBATCH --ntasks=4",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=2",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=dl-lab",
        "#SBATCH --qos=high",
        "#SBATCH --time=01:00:00",
        "#SBATCH --constraint=a100",
        "#SBATCH --exclusive",
        "#SBATCH --mem=0",
    ):
        assert expected in lines
    # every directive precedes the first command (sbatch ignores #SBATCH lines after it),
    # the setup lines run before the engines, and srun names PMI-2 (one MPI world)
    first_command = lines.index("module load cuda/12")
    assert all(not line.startswith("#SBATCH") for line in lines[first_command:])
    assert lines[first_command + 1] == "source $HOME/venv/bin/activate"
    assert lines[-1] == "srun --mpi=pmi2 --kill-on-bad-exit=1 python -m ipyparallel.engine"
    assert (
        _script(2, tmp_path, mpi="mpiexec").splitlines()[-1].endswith('-n "$SLURM_NTASKS" python -m ipyparallel.engine')
    )


@pytest.mark.parametrize(
    "n, options, message",
    [
        (4, {"partitio": "debug"}, "no option 'partitio': allowed are account, constraint, cpus_per_task"),
        (4, {"timelimit": "1 hour"}, "timelimit '1 hour' is not a Slurm time"),
        (4, {"mpi": "openmpi"}, "'openmpi' is not one of pmi2, pmix, mpiexec"),
        (4, {"nodes": 0}, "option 'nodes' of launcher 'slurm': 0 is invalid: must be an integer >= 1"),
        (4, {"nodes": 3, "ntasks_per_node": 2}, "n=4 engines do not fill nodes=3 x ntasks_per_node=2: n must be 6"),
        (2, {"nodes": 3}, "nodes=3 is more than the n=2 engines"),
        (4, {"sbatch": "exclusive"}, "is not an sbatch option"),
        (4, {"cpus_per_task": True}, "must be int"),
    ],
)
def test_bad_slurm_options_are_refused_before_anything_starts(n, options, message):
    with pytest.raises(ConfigError, match=message):
        Cluster(n=n, launcher="slurm", **options)


def test_pbs_script_is_generated(tmp_path):
    """No PBS server can exist here (Debian packages none): only the generated script is checked."""
    from ipyparallel.cluster.launcher import PBSEngineSetLauncher

    spec = launchers.get_launcher("pbs")
    config = Config(spec.config(launchers.validate_options("pbs", {"queue": "batch"}), work_dir=str(tmp_path)))
    engines = PBSEngineSetLauncher(config=config, work_dir=str(tmp_path), profile_dir=str(tmp_path), cluster_id="abc")
    engines.program = ["python", "-m", "ipyparallel.engine"]
    engines.write_batch_script(4)
    script = (tmp_path / "pbs_engine.sh").read_text()
    assert "#PBS -q batch" in script
    assert "#PBS -t 1-4" in script
    assert "python -m ipyparallel.engine" in script


# -- against the real Slurm ------------------------------------------------------------------------


# 4 engines over 2 nodes, %%distributed, the rank -> node map in `%rapydli status` and training on
# them are exercised by notebooks/09-on-a-cluster.ipynb (tests/test_cluster_notebook09.py) and the
# README's examples (tests/test_readme_cluster.py), so no second 4-engine cluster is started here.


def test_magic_refuses_bad_launcher_options_naming_the_allowed(ipython_shell):
    shell = ipython_shell
    with pytest.raises(UsageError, match="no option 'partitio': allowed are"):
        shell.run_line_magic("rapydli", "start -n 2 --launcher slurm partitio=debug")
    with pytest.raises(UsageError, match="n=4 engines do not fill nodes=3"):
        shell.run_line_magic("rapydli", "start -n 4 --launcher slurm nodes=3 ntasks_per_node=2  # a comment")


@pytest.mark.slurm
def test_pending_job_is_shown_then_cancelled_at_the_timeout(local_slurm):
    cluster = Cluster(n=2, launcher="slurm", partition="down", start_timeout=6)
    failure: list[BaseException] = []
    starter = threading.Thread(target=lambda: _catch(cluster.start, failure))
    starter.start()
    job = _wait_for(lambda: cluster.status().get("job", {}).get("state") == "PENDING" and cluster.status()["job"])
    assert job["reason"] == "PartitionDown" and job["id"] in local_slurm.queue()
    starter.join(30)
    assert isinstance(failure[0], ClusterError)
    assert f"job {job['id']} was still PENDING, reason PartitionDown" in str(failure[0])
    assert job["id"] not in local_slurm.queue()


@pytest.mark.slurm
def test_magic_status_shows_a_queued_start_and_stop_cancels_it(local_slurm, ipython_shell):
    shell = ipython_shell
    with capture_output():
        shell.run_line_magic("rapydli", "start -n 2 --launcher slurm partition=down --no-wait")
    status = _wait_for(
        lambda: (s := shell.run_line_magic("rapydli", "status")).get("job", {}).get("state") == "PENDING" and s
    )
    assert status["state"] == "starting" and status["job"]["reason"] == "PartitionDown"
    assert status["job"]["id"] in local_slurm.queue()
    with capture_output():
        shell.run_line_magic("rapydli", "stop")
    assert status["job"]["id"] not in local_slurm.queue()
    assert shell.run_line_magic("rapydli", "status") == {"state": "stopped"}


@pytest.mark.slurm
def test_ctrl_c_while_pending_cancels_the_job(local_slurm):
    cluster = Cluster(n=2, launcher="slurm", partition="down", start_timeout=60)
    interrupter = threading.Thread(
        target=lambda: (
            _wait_for(lambda: cluster.status().get("job", {}).get("state") == "PENDING") and _thread.interrupt_main()
        )
    )
    interrupter.start()
    before = set(local_slurm.queue())
    with pytest.raises(KeyboardInterrupt):
        cluster.start()
    interrupter.join()
    assert set(local_slurm.queue()) <= before and cluster.status()["job"]["id"] not in local_slurm.queue()


@pytest.mark.slurm
def test_cli_status_and_the_server_show_a_pending_job(local_slurm):
    import os
    import subprocess
    import sys

    from rapydli.server.manager import ClusterManager

    rapydli = [sys.executable, "-m", "rapydli"]
    starting = subprocess.Popen([*rapydli, "cluster", "start", "-n", "2", "--launcher", "slurm", "--timeout", "30", "partition=down"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))  # fmt: skip
    manager = ClusterManager()
    entry = manager.start(2, "slurm", {"partition": "down", "start_timeout": 30})
    try:
        shown = _wait_for(lambda: "PENDING (PartitionDown)" in (out := _cli_status(rapydli)) and out)
        assert "starting" in shown and "slurm" in shown
        job = _wait_for(
            lambda: (
                (manager.get(entry["id"]).describe()["job"] or {}).get("state") == "PENDING"
                and manager.get(entry["id"]).describe()["job"]
            )
        )
        assert job["reason"] == "PartitionDown" and manager.get(entry["id"]).describe()["state"] == "starting"
    finally:
        starting.send_signal(signal.SIGINT)  # Ctrl-C of the command: its job is cancelled
        _, err = starting.communicate(timeout=60)
        manager.stop(entry["id"])
    assert starting.returncode == 130, err
    assert _cli_status(rapydli).strip() == "no clusters"
    assert local_slurm.run("squeue", "-h", "-t", "PENDING", "-o", "%i").stdout.split() == []


def _cli_status(rapydli: list[str]) -> str:
    import os
    import subprocess

    return subprocess.run(
        [*rapydli, "cluster", "status"], capture_output=True, text=True, env=dict(os.environ), timeout=60
    ).stdout


@pytest.mark.slurm
def test_a_job_ended_from_outside_is_reported_with_its_id_and_ranks(local_slurm):
    with Cluster(n=2, launcher="slurm", nodes=2, ntasks_per_node=1) as cluster:
        job_id = cluster.status()["job"]["id"]
        for end_it, state in (
            (lambda job: local_slurm.run("scancel", job), "CANCELLED"),
            (
                lambda job: local_slurm.run("scontrol", "update", "nodename=n2", "state=down", "reason=test"),
                "NODE_FAIL",
            ),
        ):
            task = cluster.submit(time.sleep, 120, on_output=None)
            time.sleep(0.5)
            end_it(job_id)
            ended = time.monotonic()
            with pytest.raises(RankFailure) as failure:
                task.wait()
            assert time.monotonic() - ended < 10
            assert f"ranks 0, 1 lost: job {job_id} ended ({state}" in str(failure.value)
            assert not cluster.running
            if state == "CANCELLED":  # restart: the lost job leaves the queue, a new job starts
                cluster.restart()
                assert job_id not in local_slurm.queue()
                assert cluster.run(lambda: 1, on_output=None) == [1, 1]
                job_id = cluster.status()["job"]["id"]
    local_slurm.run("scontrol", "update", "nodename=n2", "state=resume", check=False)  # in case it is still down
    assert job_id not in local_slurm.queue()


def _catch(fn, errors: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the test thread
        errors.append(exc)


def _wait_for(condition, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


@pytest.mark.parametrize(
    "line, cause",
    [
        (
            "slurmstepd-n1: error: *** JOB 14 ON n1 CANCELLED AT 2026-11-24T10:45:24 DUE TO NODE FAILURE, SEE SLURMCTLD LOG FOR DETAILS ***",
            "NODE_FAIL",
        ),
        ("slurmstepd: error: *** JOB 9 ON n1 CANCELLED AT 2026-11-24T11:02:03 DUE TO TIME LIMIT ***", "TIMEOUT"),
        ("slurmstepd: error: *** STEP 9.0 ON n2 CANCELLED AT 2026-11-24T11:02:03 ***", "CANCELLED"),
        ("srun: error: n2: task 1: Exited with exit code 1", None),
    ],
)
def test_why_a_completing_job_ended_is_read_from_slurmstepd(line, cause):
    """While a job completes Slurm says only COMPLETING; slurmstepd's line in its output says why."""
    from rapydli.cluster.slurm import ending_cause

    assert ending_cause(f"engine log\n{line}\nmore") == cause


def test_slurm_not_configured_shows_sbatch_error_only(tmp_path, monkeypatch, capfd):
    """Slurm's programs present but no usable slurm.conf: sbatch's own error and one ClusterError, and no
    `scancel` for a job that was never submitted (it used to add its own fatal lines, after a minute of retries)."""
    from local_slurm import SlurmUnavailable, ensure_packages

    try:
        ensure_packages()
    except SlurmUnavailable as exc:
        pytest.skip(f"no Slurm programs: {exc}")
    conf = tmp_path / "slurm.conf"
    conf.write_text("")  # as on a login node whose admin has not set Slurm up: no ClusterName, no controller
    monkeypatch.setenv("SLURM_CONF", str(conf))
    with pytest.raises(ClusterError, match="sbatch"):
        Cluster(n=1, launcher="slurm", start_timeout=30).start()
    printed = capfd.readouterr()
    text = printed.out + printed.err
    assert "sbatch: fatal" in text or "sbatch: error" in text, text
    assert "scancel" not in text and "Traceback" not in text, text


# -- launcher "srun": a step of the allocation this process runs in ---------------------------------


def test_srun_outside_an_allocation_or_beyond_its_tasks_is_refused_before_anything_starts(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    with pytest.raises(
        ConfigError,
        match=r"^launcher 'srun' starts the engines in the Slurm allocation this process runs in, and SLURM_JOB_ID is "
        r"not set here: start Jupyter inside one \(salloc -n 2 jupyter lab\), or use launcher='slurm' to submit a job$",
    ):
        Cluster(n=2, launcher="srun")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    with pytest.raises(
        ConfigError, match=r"the Slurm allocation 7 holds 2 tasks \(SLURM_NTASKS=2\): n=4 engines do not fit"
    ):
        Cluster(n=4, launcher="srun")
    with pytest.raises(ConfigError, match="mpi"):
        Cluster(n=2, launcher="srun", mpi="openmpi")


_INSIDE = """
import json, os, subprocess, time
from rapydli.cluster import Cluster

job = os.environ["SLURM_JOB_ID"]
steps = lambda: subprocess.run(["squeue", "-h", "-s", "-j", job, "-o", "%i"], capture_output=True, text=True).stdout.split()
with Cluster(n=2, launcher="srun") as cluster:
    seen = cluster.run(
        lambda: (__import__("mpi4py.MPI").MPI.COMM_WORLD.Get_rank(), os.environ["SLURM_JOB_ID"], os.environ["SLURM_STEP_ID"]),
        on_output=None,
    )
    queue = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
    running = steps()
deadline = time.monotonic() + 30
while any(step.startswith(job + ".") and not step.endswith((".extern", ".interactive")) for step in steps()):
    assert time.monotonic() < deadline, steps()
    time.sleep(0.2)
print("RESULT", json.dumps({"job": job, "seen": seen, "queue": queue, "running": running}))
"""


@pytest.mark.slurm
def test_srun_inside_salloc_starts_the_engines_as_a_step_of_it_and_stopping_them_leaves_it(local_slurm, tmp_path):
    """Jupyter inside `salloc`: no job is queued, the engines are one MPI world in one step of the allocation, and
    stopping them ends that step only (the allocation ends when its command does, as salloc's always do)."""
    import json
    import subprocess
    import sys

    script = tmp_path / "inside.py"
    script.write_text(_INSIDE)
    before = set(local_slurm.queue())
    done = subprocess.run(
        ["salloc", "-n", "2", "--nodes=2", "--job-name=rapydli-test-srun", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    job = result["job"]
    assert [rank for rank, _, _ in result["seen"]] == [0, 1]  # one MPI world
    assert {(j, s) for _, j, s in result["seen"]} == {(job, result["seen"][0][2])}  # one step of the allocation
    assert set(result["queue"]) - before == {job}  # nothing else was submitted
    assert f"{job}.{result['seen'][0][2]}" in result["running"]
    assert job not in local_slurm.queue()
