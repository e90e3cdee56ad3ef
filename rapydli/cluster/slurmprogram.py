"""A program run as a Slurm job of its own (a batch item on a compute node).

:func:`submit_python` writes a one-task batch script (the ``#SBATCH`` lines of the options
users set, their extra ``sbatch`` lines, the ``setup`` lines, then ``exec python ARGS``),
submits it with the environment given (``--export=ALL``: the job starts with it) and
returns a :class:`SlurmProgram`, which is waited for as a process is, except that the
``timeout`` of :meth:`SlurmProgram.wait` counts the time the job runs, not the time it
waits in the queue, and that ending it is ``scancel``: every process of the job, on
whichever node it runs.

Options are the ``slurm`` launcher's (:data:`ITEM_OPTIONS`, checked by
:func:`check_item_options`), less those that shape an MPI job of several tasks.
"""

from __future__ import annotations

import math
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rapydli.cluster import slurm
from rapydli.cluster.batchjob import BatchJob
from rapydli.errors import ClusterError, ConfigError

#: The ``slurm`` launcher options a one-task job takes.
ITEM_OPTIONS = (
    "partition",
    "account",
    "qos",
    "timelimit",
    "constraint",
    "cpus_per_task",
    "gpus_per_node",
    "sbatch",
    "setup",
)
POLL_S = 0.5  # between scheduler queries while a program's job is in the queue


def check_item_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` checked as the ``slurm`` launcher's, restricted to :data:`ITEM_OPTIONS`.

    Raises
    ------
    ConfigError
        An option a one-task job does not take, or a bad value (naming what is allowed).
    """
    from rapydli.cluster.launchers import validate_options

    for key in options:
        if key not in ITEM_OPTIONS:
            raise ConfigError(
                f"a Slurm job of one batch item has no option {key!r}: allowed are {', '.join(sorted(ITEM_OPTIONS))}"
            )
    return validate_options("slurm", options)


def item_script(
    args: Sequence[str],
    *,
    name: str,
    cwd: str | os.PathLike[str],
    output: str | os.PathLike[str],
    options: Mapping[str, Any],
    time_limit_s: float | None = None,
) -> str:
    """The batch script that runs ``python args...`` (this interpreter) as one task in ``cwd``.

    ``time_limit_s`` (when the options set no ``timelimit``) becomes the job's time limit,
    rounded up to whole minutes plus one, so the job ends even if nobody cancels it.
    """
    head = [f"--job-name={name}", "--ntasks=1", f"--chdir={cwd}", f"--output={output}", "--export=ALL"]
    timed = dict(options)
    if time_limit_s is not None and not timed.get("timelimit"):
        timed["timelimit"] = str(math.ceil(time_limit_s / 60) + 1)
    lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in head), *slurm.directives(timed), *timed.get("sbatch", []),
             *timed.get("setup", []), f"exec {shlex.join([sys.executable, *args])}"]  # fmt: skip
    return "\n".join(lines) + "\n"


def submit_python(
    args: Sequence[str],
    *,
    name: str,
    cwd: str | os.PathLike[str],
    env: Mapping[str, str],
    output: str | os.PathLike[str],
    options: Mapping[str, Any],
    time_limit_s: float | None = None,
) -> SlurmProgram:
    """Submit ``python args...`` as a Slurm job of one task; see :func:`item_script`.

    The script is written beside ``output`` (``<output>.sbatch``); ``env`` is the job's environment.

    Raises
    ------
    ClusterError
        ``sbatch`` refused the job (its message is included).
    """
    script = Path(f"{output}.sbatch")
    script.write_text(item_script(args, name=name, cwd=cwd, output=output, options=options, time_limit_s=time_limit_s))
    done = subprocess.run(
        ["sbatch", "--parsable", str(script)], env=dict(env), cwd=cwd, capture_output=True, text=True, timeout=60
    )
    job_id = done.stdout.strip().split(";")[0]
    if done.returncode != 0 or not job_id:
        raise ClusterError(f"sbatch refused job {name}: {done.stderr.strip() or done.stdout.strip()}")
    return SlurmProgram(job_id, Path(output))


class SlurmProgram:
    """A submitted one-task job, waited for and ended as a process is.

    Parameters
    ----------
    job_id
        The job's Slurm id.
    output
        The job's output file (its tail is shown when it ends without a result).
    """

    def __init__(self, job_id: str, output: Path) -> None:
        self.output = output
        self.job = BatchJob(job_id, slurm.job_state, ["scancel"], self._tail)
        self.returncode: int | None = None
        self.running_since: float | None = None  # monotonic time it was first seen running

    @property
    def job_id(self) -> str:
        return self.job.job_id

    def _tail(self, lines: int) -> str:
        try:
            return "\n".join(self.output.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def poll(self) -> int | None:
        """Ask Slurm once; the exit status once the job has left the queue, else None."""
        state = self.job.refresh()
        if self.running_since is None and (state.state == "RUNNING" or state.ended):
            self.running_since = time.monotonic()
        if state.in_queue:
            return None
        self.returncode = _exit_status(state)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait until the job has left the queue; its exit status.

        Raises
        ------
        subprocess.TimeoutExpired
            The job has been running for more than ``timeout`` seconds (queue time does not count).
        """
        while (code := self.poll()) is None:
            if (
                timeout is not None
                and self.running_since is not None
                and time.monotonic() - self.running_since > timeout
            ):
                raise subprocess.TimeoutExpired(f"Slurm job {self.job_id}", timeout)
            time.sleep(POLL_S)
        return code

    def kill(self) -> None:
        """``scancel`` the job and return once it has left the queue (idempotent)."""
        self.job.cancel()
        self.poll()

    def exit_text(self) -> str:
        """How the job ended, e.g. ``Slurm job 12 ended FAILED (exit 1) on n2``."""
        state = self.job.state
        where = f" on {state.nodes}" if state.nodes else ""
        return f"Slurm job {self.job_id} ended {state.state} (exit {self.returncode}){where}"


def _exit_status(state: slurm.JobState) -> int:
    """A job's exit status as a process's: the status, or minus the signal that ended it."""
    status, _, signal = state.exit_code.partition(":")
    if signal.isdigit() and int(signal):
        return -int(signal)
    if status.isdigit():
        return int(status)
    return 0 if state.state == "COMPLETED" else 1
