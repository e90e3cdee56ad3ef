"""Batch items as Slurm jobs (``rd.batch(..., launcher="slurm")``, ``rapydli batch --launcher slurm``).

Against the real local Slurm (``local_slurm``: nodes n1 and n2). Items ask for a node each
(``sbatch=--exclusive``), so two at once run on both nodes. The command line is the
README's ("Batches on Slurm"), with a test notebook and grid in place of its ``nb.ipynb``.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

import rapydli as rd
from rapydli.cluster.slurmprogram import check_item_options, item_script
from rapydli.errors import ConfigError
from rapydli.experiments.batch.places import places
from rapydli.experiments.store.runstore import open_store
from rapydli.settings import STORE_PATH

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"
RAPYDLI = [sys.executable, "-m", "rapydli"]
README = Path(__file__).resolve().parents[1] / "README.md"


def readme_command(notebook: Path, *grid: str) -> list[str]:
    """The README's ``rapydli batch ... --launcher slurm`` line with ``notebook`` and ``grid`` for its notebook and grid."""
    section = README.read_text().split("\n### Batches on Slurm\n", 1)[1].split("\n### ", 1)[0]
    line = re.search(r"^rapydli batch .*$", section, re.M).group(0)
    argv = shlex.split(line)[2:]
    while argv[1] == "--grid":  # the README's notebook, then its grid
        del argv[1:3]
    assert argv[0] == "nb.ipynb" and "--launcher" in argv, line
    return [*RAPYDLI, "batch", str(notebook), *(arg for axis in grid for arg in ("--grid", axis)), *argv[1:]]


def test_item_jobs_take_the_slurm_options_of_one_task() -> None:
    options = check_item_options(
        {"partition": "debug", "cpus_per_task": 4, "sbatch": "--exclusive", "setup": "module load x"}
    )
    script = item_script(["-m", "mod", "spec.json"], name="rapydli-batch-nb-abc", cwd="/w", output="/w/log", options=options,
                         time_limit_s=90)  # fmt: skip
    lines = script.splitlines()
    for expected in (
        "#SBATCH --job-name=rapydli-batch-nb-abc",
        "#SBATCH --ntasks=1",
        "#SBATCH --chdir=/w",
        "#SBATCH --output=/w/log",
        "#SBATCH --partition=debug",
        "#SBATCH --cpus-per-task=4",
        "#SBATCH --time=3",
        "#SBATCH --exclusive",
    ):
        assert expected in lines, script
    assert lines[-2:] == ["module load x", f"exec {sys.executable} -m mod spec.json"]
    assert "#SBATCH --time=00:05:00" in item_script(
        ["x"], name="n", cwd="/", output="o", options={"timelimit": "00:05:00"}, time_limit_s=90
    )
    for options, message in [
        (
            {"nodes": 2},
            "a Slurm job of one batch item has no option 'nodes': allowed are account, constraint, cpus_per_task",
        ),
        ({"timelimit": "soon"}, "timelimit 'soon' is not a Slurm time"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_item_options(options)
    with pytest.raises(ConfigError, match="a batch cannot run on launcher 'pbs': allowed are local, slurm, ssh"):
        places("pbs")
    with pytest.raises(ConfigError, match="cannot be combined with launcher='slurm'"):
        rd.batch(NOTEBOOKS / "params.ipynb", {"x": 1}, hosts=["h1"], launcher="slurm", progress=False)


class QueueWatch:
    """Samples the queue's jobs of one batch (by job name) until stopped."""

    def __init__(self, slurm, prefix: str) -> None:
        self.slurm, self.prefix = slurm, prefix
        self.most_in_queue = 0
        self.running_together: set[str] = set()  # the nodes of the most jobs seen running at once
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.is_set():
            lines = self.slurm.run("squeue", "-h", "-o", "%i %T %N %j", check=False).stdout.splitlines()
            jobs = [line.split() for line in lines if line.split()[-1].startswith(self.prefix)]
            self.seen |= {job[0] for job in jobs}
            self.most_in_queue = max(self.most_in_queue, len(jobs))
            running = {job[2] for job in jobs if job[1] == "RUNNING" and len(job) == 4}
            if len(running) > len(self.running_together):
                self.running_together = running
            time.sleep(0.1)

    def stop(self) -> QueueWatch:
        self._stop.set()
        self._thread.join()
        return self


@pytest.mark.slurm
@pytest.mark.notebook
def test_items_as_jobs_on_both_nodes_record_every_row_once(local_slurm, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(STORE_PATH, raising=False)
    xs = [1, 2, 3, 4]
    watch = QueueWatch(local_slurm, "rapydli-batch-host_records-")
    try:
        summary = rd.batch(
            NOTEBOOKS / "host_records.ipynb",
            {"x": xs, "n": 20},
            parallel=2,
            launcher="slurm",
            launcher_options={"partition": "debug", "sbatch": ["--exclusive"]},
            out=tmp_path / "out",
            progress=False,
            timeout=240,
        )
    finally:
        watch.stop()
    assert (summary["status"] == "finished").all(), summary[["status", "error"]].to_string()
    assert len(watch.seen) == len(xs) and watch.most_in_queue == 2  # --parallel bounds the batch's jobs in the queue
    assert watch.running_together == {"n1", "n2"}  # two items at once, one on each node
    assert set(summary["node"]) == {"n1", "n2"}
    assert not watch.seen & set(local_slurm.queue())

    store = open_store()
    items = {row["run_id"]: row["x"] for _, row in summary.iterrows()}
    assert sorted(store.get_run(r)["status"] for r in items) == ["finished"] * len(xs)
    for run_id, x in items.items():
        records = store.records(run_id)
        assert {name: rec["value"] for name, rec in records.items() if name.startswith("r")} == {
            f"r{i}": x * 100 + i for i in range(20)
        }
    children = [run for run in store.list_runs(kind="train")[0] if run["parent"] in items]
    assert sorted(c["name"] for c in children) == [f"child-{x}" for x in xs]
    for child in children:
        steps = [m["step"] for m in store.metrics(child["id"])]
        assert steps == list(range(20)), steps  # every row arrived, none twice
    assert not any(Path(c["cwd"], ".rapydli-runs.db-journal").exists() for c in children)


def _batch_jobs(slurm, prefix: str) -> list[list[str]]:
    lines = slurm.run("squeue", "-h", "-o", "%i %T %j", check=False).stdout.splitlines()
    return [line.split() for line in lines if line.split()[-1].startswith(prefix)]


@pytest.mark.slurm
@pytest.mark.notebook
def test_cli_reports_a_failing_items_cell_and_ctrl_c_leaves_an_empty_queue(local_slurm, tmp_path: Path) -> None:
    env = {**os.environ, "RAPYDLI_HOME": str(tmp_path / "home")}
    command = readme_command(NOTEBOOKS / "params.ipynb", "x=-1,2")
    assert command[command.index("--parallel") + 1] == "2"  # two items at once: the Ctrl-C below finds two running jobs
    failing = subprocess.run(
        [*command, "--out", str(tmp_path / "failing")], capture_output=True, text=True, env=env, timeout=240
    )
    assert failing.returncode == 1, failing.stderr
    where = 'in code cell 3 (In [4]), line 5: raise ValueError("x must be positive")'
    assert "1 of 2 items failed" in failing.stderr and f"{where}\n  ValueError: x must be positive" in failing.stderr, (
        failing.stderr
    )

    out = tmp_path / "cancelled"
    batch = subprocess.Popen([*readme_command(NOTEBOOKS / "params.ipynb", "x=1,2,3", "sleep=120"), "--out", str(out)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    prefix = "rapydli-batch-params-"
    deadline = time.monotonic() + 120
    kernels: dict[psutil.Process, Path] = {}
    # both jobs running, and their items' processes started on the nodes (a job is RUNNING a moment before its script)
    while [job[1] for job in _batch_jobs(local_slurm, prefix)] != ["RUNNING", "RUNNING"] or len(
        set(kernels.values())
    ) < 2:
        assert time.monotonic() < deadline and batch.poll() is None, (
            batch.stderr.read() if batch.poll() is not None else ""
        )
        time.sleep(0.2)
        kernels = {p: folder for p in psutil.process_iter() if (folder := _item_folder(p, out)) is not None}
    batch.send_signal(signal.SIGINT)  # Ctrl-C of the command
    _, err = batch.communicate(timeout=60)
    assert batch.returncode == 130, err
    assert _batch_jobs(local_slurm, prefix) == []  # the third item was never submitted, the two running were cancelled
    gone, alive = psutil.wait_procs(list(kernels), timeout=10)
    assert not alive, [p.cmdline() for p in alive]


def _item_folder(proc: psutil.Process, out: Path) -> Path | None:
    """The item folder of ``out`` that ``proc`` runs in (an item's process or its kernel), else None."""
    try:
        cwd = Path(proc.cwd())
    except (psutil.Error, OSError):
        return None
    parts = cwd.relative_to(out).parts if cwd.is_relative_to(out) else ()
    return out.joinpath(*parts[:2]) if len(parts) >= 2 else None  # out/<notebook stem>/<item key>
