"""Engines as one Slurm job: the batch script, and the job's state as Slurm reports it; or as one step of an
allocation this process already runs in (:class:`SrunEngines`, launcher ``srun``).

The script asks for ``n`` tasks (with the user's ``nodes``, ``ntasks_per_node``,
``cpus_per_task``, ``gpus_per_node``, ``partition``, ``account``, ``qos``, ``timelimit``,
``constraint`` and extra ``#SBATCH`` lines), runs the ``setup`` lines (``module load ...``,
``source venv/bin/activate``), then starts one engine per task so that the engines form
**one** MPI world whatever the site's ``MpiDefault``:

* ``mpi="pmi2"`` (default): ``srun --mpi=pmi2``. A plain ``srun`` under ``MpiDefault=none``
  (the default of a fresh slurm.conf) starts N separate worlds of size 1; naming PMI-2
  makes Slurm wire the tasks up as one job. MPICH (the ``mpich`` wheel and most site
  MPICH/Intel MPI/MVAPICH builds) speaks PMI-2, srun places the ranks exactly as
  requested (``--ntasks-per-node``), starts them without an extra proxy per node, and
  ``--kill-on-bad-exit`` ends the job when one engine dies.
* ``mpi="pmix"``: ``srun --mpi=pmix``, for Open MPI 5 (which dropped PMI-2).
* ``mpi="mpiexec"``: the ``mpiexec`` of this Python's MPI inside the allocation (Hydra
  and Open MPI's launcher both read the allocation from Slurm), for sites whose srun
  has no plugin for their MPI.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
from traitlets import Integer, List, Unicode, default

from rapydli.cluster.mpi_engine import PROGRAM
from rapydli.cluster.mpirun import find_mpiexec

MPI_MODES = ("pmi2", "pmix", "mpiexec")
#: What :class:`SrunEngines` allows: its ranks are one ``srun`` step, so Slurm's own PMI wires them up.
SRUN_MPI_MODES = ("pmi2", "pmix")
#: Job states after which the job's processes are gone (``squeue``/``scontrol`` names).
ENDED = frozenset(
    {"COMPLETED", "CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
)
_TIMELIMIT = re.compile(r"^(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+(:\d{1,2}(:\d{1,2})?)?|UNLIMITED|INFINITE)$")


def check_timelimit(value: str) -> str:
    """``value`` if it is a time format sbatch accepts (``MM``, ``HH:MM:SS``, ``D-HH[:MM[:SS]]`` ...)."""
    if not _TIMELIMIT.match(value.strip()):
        raise ValueError(
            f"timelimit {value!r} is not a Slurm time: use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
        )
    return value.strip()


def sbatch_line(line: str) -> str:
    """An extra directive as a ``#SBATCH`` line (``--exclusive`` or ``#SBATCH --exclusive``)."""
    text = line.strip()
    if text.startswith("#SBATCH"):
        text = text[len("#SBATCH") :].strip()
    if not text.startswith("-") or "\n" in text:
        raise ValueError(f"sbatch line {line!r} is not an sbatch option such as '--exclusive' or '#SBATCH --mem=4G'")
    return f"#SBATCH {text}"


#: The sbatch flag of each launcher option that is one ``#SBATCH`` directive.
FLAGS = {
    "nodes": "nodes", "ntasks_per_node": "ntasks-per-node", "cpus_per_task": "cpus-per-task",
    "gpus_per_node": "gpus-per-node", "partition": "partition", "account": "account", "qos": "qos",
    "timelimit": "time", "constraint": "constraint",
}  # fmt: skip


def directives(options: Mapping[str, Any]) -> list[str]:
    """``#SBATCH --flag=value`` lines for the options of :data:`FLAGS` that are set (not 0 or empty)."""
    return [f"#SBATCH --{FLAGS[key]}={value}" for key, value in options.items() if key in FLAGS and value]


class SlurmEngines(SlurmEngineSetLauncher):
    """ipyparallel's Slurm engine launcher, writing RaPyDLI's batch script (one MPI world)."""

    # how ipyparallel names the class in a cluster file; a dotted path that it can import back
    # when another process attaches (its default "module:Class" form only resolves entry points)
    entrypoint_name = "rapydli.cluster.slurm.SlurmEngines"

    nodes = Integer(0, config=True, help="number of nodes (0: Slurm decides)")
    ntasks_per_node = Integer(0, config=True, help="engines per node (0: Slurm decides)")
    cpus_per_task = Integer(0, config=True, help="CPUs per engine (0: Slurm's default)")
    gpus_per_node = Integer(0, config=True, help="GPUs per node")
    constraint = Unicode("", config=True, help="node features, e.g. 'a100'")
    sbatch = List(Unicode(), config=True, help="extra '#SBATCH' lines")
    setup = List(Unicode(), config=True, help="shell lines run before the engines")
    mpi = Unicode("pmi2", config=True, help="how the engines form one MPI world: pmi2, pmix or mpiexec")

    @default("engine_cmd")
    def _engine_cmd_default(self) -> list[str]:
        return list(PROGRAM)  # MPI initialised before the engine starts

    def script(self, n: int) -> str:
        """The batch script that starts ``n`` engines."""
        head = [
            f"--job-name=rapydli-{self.cluster_id}",
            f"--ntasks={n}",
            f"--output={self.output_file}",
            "--export=ALL",
        ]
        options = {
            "nodes": self.nodes, "ntasks_per_node": self.ntasks_per_node, "cpus_per_task": self.cpus_per_task,
            "gpus_per_node": self.gpus_per_node, "partition": self.queue, "account": self.account, "qos": self.qos,
            "timelimit": self.timelimit, "constraint": self.constraint,
        }  # fmt: skip
        lines = ["#!/bin/bash", *(f"#SBATCH {d}" for d in head), *directives(options), *self.sbatch, *self.setup]
        program = shlex.join(self.program + self.program_args)
        if self.mpi == "mpiexec":
            lines.append(f'{shlex.quote(find_mpiexec())} -n "$SLURM_NTASKS" {program}')
        else:
            lines.append(f"srun --mpi={self.mpi} --kill-on-bad-exit=1 {program}")
        return "\n".join(lines) + "\n"

    def stop(self) -> str:
        """``scancel`` the job; a job that already ended is stopped too (scancel then fails).

        Without a job (``sbatch`` failed, e.g. Slurm is not configured here) nothing is
        cancelled: sbatch's error is the one the user sees, not scancel's about a job that
        never existed.
        """
        if not self.job_id:
            self.notify_stop({"job_id": None, "output": ""})
            return ""
        try:
            return super().stop()
        except (subprocess.CalledProcessError, OSError) as exc:  # OSError: no scancel on this machine
            self.notify_stop({"job_id": self.job_id, "output": str(exc)})
            return ""

    def write_batch_script(self, n: int = 1) -> None:
        """Write :meth:`script` to ``batch_file`` (replaces ipyparallel's template rendering)."""
        self.n = n
        path = Path(self.batch_file)
        path.write_text(self.script(n))
        path.chmod(0o700)


class SrunEngines(MPIEngineSetLauncher):
    """The engines as one ``srun`` step of the Slurm allocation this process runs in (``salloc``, or a batch job's
    script): ``srun --mpi=pmi2 -n N`` starts them as one MPI world on the allocation's nodes, at once, with no job
    queued. Stopping them ends the step (``srun`` passes its SIGTERM on); the allocation stays the user's."""

    entrypoint_name = "rapydli.cluster.slurm.SrunEngines"

    mpi = Unicode("pmi2", config=True, help=f"how the engines form one MPI world: {' or '.join(SRUN_MPI_MODES)}")

    @default("mpi_cmd")
    def _mpi_cmd_default(self) -> list[str]:
        return ["srun", f"--mpi={self.mpi}", "--kill-on-bad-exit=1"]

    @default("engine_cmd")
    def _engine_cmd_default(self) -> list[str]:
        return list(PROGRAM)  # MPI initialised before the engine starts


@dataclass(frozen=True)
class JobState:
    """A Slurm job as ``scontrol show job`` reports it.

    Attributes
    ----------
    job_id
        The job's id.
    state
        ``PENDING``, ``RUNNING``, ``COMPLETING``, ``TIMEOUT``, ``CANCELLED``, ...; ``GONE``
        when Slurm no longer knows the job.
    reason
        Why it waits or ended (``Resources``, ``Priority``, ``PartitionDown``, ``None`` ...).
    nodes
        The nodes it runs on (Slurm's compact form, e.g. ``n[1-2]``), empty while pending.
    completing
        Its processes are being ended; it stays in the queue until they are.
    exit_code
        Slurm's ``ExitCode`` (``status:signal``, e.g. ``1:0``) once the job ended, else ``""``.
    """

    job_id: str
    state: str
    reason: str = ""
    nodes: str = ""
    completing: bool = False
    exit_code: str = ""

    @property
    def ended(self) -> bool:
        """True once the job is over: its processes are ending or gone (or Slurm forgot it)."""
        return self.completing or self.state in ENDED or self.state == "GONE"

    @property
    def in_queue(self) -> bool:
        """True while ``squeue`` lists it (pending, running or completing)."""
        return self.completing or not self.ended

    def describe(self) -> dict[str, Any]:
        """JSON-ready ``{"id", "state", "reason", "nodes"}``."""
        return {"id": self.job_id, "state": self.state, "reason": self.reason, "nodes": self.nodes}


def job_state(job_id: str) -> JobState:
    """Ask Slurm for job ``job_id``'s state (``scontrol -o show job``).

    While a job completes, ``scontrol`` says only ``COMPLETING``: :func:`ending_cause`
    reads why from the job's output.
    """
    done = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, timeout=30)
    if done.returncode != 0 or "JobState=" not in done.stdout:
        return JobState(job_id, "GONE")
    fields = dict(token.split("=", 1) for token in done.stdout.split() if "=" in token)
    nodes = fields.get("NodeList", "")
    state = fields["JobState"]
    ended = state in ENDED or state == "COMPLETING"
    return JobState(
        job_id,
        state,
        fields.get("Reason", ""),
        "" if nodes == "(null)" else nodes,
        state == "COMPLETING",
        fields.get("ExitCode", "") if ended else "",
    )


_CANCELLED = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z ]+))?")
_CAUSES = {None: "CANCELLED", "TIME LIMIT": "TIMEOUT", "NODE FAILURE": "NODE_FAIL", "PREEMPTION": "PREEMPTED"}


def ending_cause(output: str) -> str | None:
    """Why slurmstepd ended a job, from the ``*** JOB 12 ON n1 CANCELLED AT ... ***`` line it writes
    into the job's output: ``CANCELLED``, ``TIMEOUT``, ``NODE_FAIL``, ``PREEMPTED`` (None if absent)."""
    found = _CANCELLED.search(output)
    if found is None:
        return None
    cause = found.group(1).strip() if found.group(1) else None
    return _CAUSES.get(cause, f"CANCELLED ({cause.lower()})" if cause else "CANCELLED")


def engine_job_id(ipp_cluster: Any) -> str | None:
    """The Slurm job id of an ipyparallel cluster's engine set, once submitted."""
    for engine_set in getattr(ipp_cluster, "engines", {}).values():
        job_id = getattr(engine_set, "job_id", "")
        if job_id:
            return str(job_id)
    return None


def output_tail(ipp_cluster: Any, lines: int = 20) -> str:
    """The last ``lines`` of the engine job's output file (what the job printed before ending)."""
    for engine_set in getattr(ipp_cluster, "engines", {}).values():
        path = Path(getattr(engine_set, "output_file", "") or "/nonexistent")
        if path.is_file():
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""
