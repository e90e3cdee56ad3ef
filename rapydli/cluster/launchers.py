"""Launchers by name: how a :class:`~rapydli.cluster.Cluster`'s MPI engines are started.

Each launcher maps onto ipyparallel's own launchers; RaPyDLI only names them, declares
which options each accepts (an allow-list: the REST server and the magics pass user
input through here) and turns validated options into ipyparallel configuration.

=========  ==========================================================================
``local``  ``mpiexec -n N`` on this machine (the default)
``ssh``    ``mpiexec -n N -hosts h1,h2`` (MPICH's Hydra reaches the hosts over ssh), so
           ``COMM_WORLD`` spans every host; see :mod:`rapydli.cluster.sshhosts`
``slurm``  an ``sbatch`` job whose ``srun --mpi=pmi2`` starts the N ranks as one MPI
           world (:mod:`rapydli.cluster.slurm`)
``srun``   one ``srun --mpi=pmi2`` step of the Slurm allocation this process runs in
           (Jupyter inside ``salloc`` or a batch job): no job is queued, the engines
           start at once on the allocation's nodes (:class:`~rapydli.cluster.slurm.SrunEngines`)
``pbs``    a ``qsub`` job whose ``mpiexec`` starts the N ranks (untested against a real
           PBS server: only its generated script is tested)
=========  ==========================================================================

Launchers are registered by name in :data:`LAUNCHERS`; other packages add theirs (a
:class:`LauncherSpec`) in the ``rapydli.launchers`` entry-point group, and every front end
(``Cluster(launcher=...)``, ``%rapydli start --launcher``, ``rapydli cluster start``, the
server) accepts them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rapydli.cluster import slurm, sshhosts, where
from rapydli.cluster.mpirun import find_mpiexec
from rapydli.errors import ConfigError
from rapydli.registry import Registry


@dataclass(frozen=True)
class Option:
    """One launcher option: its type, where it goes in ipyparallel's config, and help.

    ``check`` normalises a value of the right type or raises ``ValueError`` saying what
    is allowed; ``lines`` marks a list option whose string form is one line (not split
    at spaces).
    """

    kind: type
    help: str
    trait: str | None = None  # "LauncherClass.trait"; None when `apply` handles it
    apply: Callable[[Any, dict[str, Any]], None] | None = None
    check: Callable[[Any], Any] | None = None
    lines: bool = False


@dataclass(frozen=True)
class BatchQueue:
    """What a launcher whose engines are one batch job can do with that job (a capability of :class:`LauncherSpec`).

    Its holder's start waits while the job is queued, shows its state (``status()["job"]``,
    the panel, ``rapydli cluster status``), cancels it on Ctrl-C, a timeout or ``stop()``, and
    quotes its output when it ends before its engines are ready
    (:mod:`rapydli.cluster.batchjob`).
    """

    job_id: Callable[[Any], str | None]  # the ipyparallel cluster -> the id its submission printed (None: not yet)
    state: Callable[[str], Any]  # job id -> its state now (``describe()``: id, state, reason, nodes)
    cancel: tuple[str, ...]  # the command that cancels a job, its id appended
    output: Callable[[Any, int], str]  # (the ipyparallel cluster, lines) -> the last lines the job printed
    reader: Callable[[str], Any]  # job id -> how files on the job's nodes are read from here (``where.Reader``)


@dataclass(frozen=True)
class Allocation:
    """What a launcher that starts engines inside an allocation this process already holds needs (a capability of
    :class:`LauncherSpec`): no job is submitted, and stopping the engines leaves the allocation to its owner.

    A cluster checks it when it is made, before anything starts (:meth:`check`); its tasks read
    files on the allocation's nodes with :attr:`reader`.
    """

    scheduler: str  # "Slurm", for messages
    job_variable: str  # set in every process of an allocation, to its id (SLURM_JOB_ID)
    tasks_variable: str  # the tasks it holds, when it was asked for a number of them (SLURM_NTASKS)
    get_one: str  # how to get one, for the message where there is none
    otherwise: str  # the launcher that submits a job instead
    reader: Callable[[str], Any]  # allocation id -> how files on its nodes are read from here (``where.Reader``)

    def current(self) -> str | None:
        """The id of the allocation this process runs in, or ``None``."""
        return os.environ.get(self.job_variable) or None

    def check(self, launcher: str, n: int) -> None:
        """Refuse ``n`` engines where there is no allocation, or where it holds fewer tasks (:class:`ConfigError`)."""
        job = self.current()
        if job is None:
            raise ConfigError(
                f"launcher {launcher!r} starts the engines in the {self.scheduler} allocation this process runs in, and "
                f"{self.job_variable} is not set here: start Jupyter inside one ({self.get_one.format(n=n)}), or use "
                f"launcher={self.otherwise!r} to submit a job"
            )
        tasks = os.environ.get(self.tasks_variable, "")
        if tasks.isdigit() and n > int(tasks):
            raise ConfigError(
                f"the {self.scheduler} allocation {job} holds {tasks} tasks ({self.tasks_variable}={tasks}): n={n} "
                f"engines do not fit; start at most {tasks}, or ask for {n} ({self.get_one.format(n=n)})"
            )


@dataclass(frozen=True)
class LauncherSpec:
    """A named way to start engines, and what it can do beyond starting them.

    Capabilities (what code outside this module asks of a launcher, never its name):
    ``queue`` (:class:`BatchQueue`: the engines are one batch job, watched while queued);
    ``allocation`` (:class:`Allocation`: the engines start inside the allocation this process runs in, no job
    submitted); ``on_this_machine`` (every process of its clusters runs here: a stop ends them all at once);
    ``over_ssh`` (engines on hosts reached by ssh: the sessions are watched while tasks run,
    the engines' processes there are reaped at stop; its ``ssh_command`` option names the
    program); ``items`` (where :func:`rapydli.batch` runs a notebook per item with this
    launcher: ``"module:factory"`` of its places, loaded when used); ``ipp_names``
    (ipyparallel's own engine-launcher names read as this launcher, for clusters started
    without RaPyDLI's record).
    """

    name: str
    engines: str
    controller: str
    description: str
    options: Mapping[str, Option] = field(default_factory=dict)
    queue: BatchQueue | None = None
    allocation: Allocation | None = None
    on_this_machine: bool = False
    over_ssh: bool = False
    items: str | None = None
    ipp_names: tuple[str, ...] = ()
    listen_all: bool = False  # engines on other hosts must reach the controller
    batch_class: str | None = None  # ipyparallel class writing a batch script, if any
    check: Callable[[dict[str, Any]], None] | None = None  # checks across options, after each one's own
    threads_option: str | None = None  # the option that sets each engine's cores, if any
    check_size: Callable[[int, Mapping[str, Any]], None] | None = None  # n against the options
    # what can start now: (n, options) -> (engines, options, {host: why left out}); None: all n
    reachable: Callable[[int, dict[str, Any]], tuple[int, dict[str, Any], dict[str, str]]] | None = None
    form: tuple[str, ...] = ()  # options a start form shows as fields, in order (the rest: key=value)

    def config(self, options: Mapping[str, Any], work_dir: str | None = None) -> dict[str, dict[str, Any]]:
        """ipyparallel configuration (``{"Class": {"trait": value}}``) for validated ``options``.

        ``work_dir`` receives the batch script of batch launchers (ipyparallel would write
        it into the current directory).
        """
        config: dict[str, dict[str, Any]] = {}
        if self.batch_class and work_dir:
            config[self.batch_class] = {"batch_file_name": f"{work_dir}/{self.name}_engine.sh"}
        for key, value in options.items():  # plain traits first, so hooks can extend them
            trait_path = self.options[key].trait
            if trait_path:
                cls, trait = trait_path.split(".")
                config.setdefault(cls, {})[trait] = value
        for key, value in options.items():
            hook = self.options[key].apply
            if hook:
                hook(value, config)
        if self.engines == "mpi":  # the mpiexec of this Python, which need not be on PATH (a venv kernel)
            config.setdefault("MPIEngineSetLauncher", {}).setdefault("mpi_cmd", [find_mpiexec()])
        return config


def _one_of(value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {', '.join(allowed)}")
    return value


def _count(help_text: str, trait: str, minimum: int = 1) -> Option:
    def check(value: int) -> int:
        if value < minimum:
            raise ValueError(f"{value} is invalid: must be an integer >= {minimum}")
        return value

    return Option(int, help_text, trait, check=check)


def _tasks_fit(n: int, options: Mapping[str, Any]) -> None:
    nodes, per_node = options.get("nodes"), options.get("ntasks_per_node")
    if nodes and per_node and nodes * per_node != n:
        raise ConfigError(
            f"n={n} engines do not fill nodes={nodes} x ntasks_per_node={per_node}: n must be {nodes * per_node}"
        )
    if nodes and nodes > n:
        raise ConfigError(f"nodes={nodes} is more than the n={n} engines: at least one engine per node")


_MPI_ARGS = Option(list, "extra arguments for mpiexec, e.g. ['-bind-to', 'core']", "MPIEngineSetLauncher.mpi_args")
_MPI_CMD = Option(list, "the mpiexec command, e.g. ['mpiexec'] or ['srun']", "MPIEngineSetLauncher.mpi_cmd")

#: The launcher a cluster uses when none is named.
DEFAULT_LAUNCHER = "local"
#: The launcher ``rd.batch(hosts=...)`` and ``rapydli batch --hosts`` mean.
HOSTS_LAUNCHER = "ssh"

_SLURM_QUEUE = BatchQueue(
    job_id=slurm.engine_job_id,
    state=slurm.job_state,
    cancel=("scancel",),
    output=slurm.output_tail,
    reader=where.read_slurm,
)

LAUNCHERS = Registry(
    "launcher",
    {
        spec.name: spec
        for spec in (
            LauncherSpec(
                "local",
                engines="mpi",
                controller="local",
                description="mpiexec on this machine",
                options={"mpi_args": _MPI_ARGS, "mpi_cmd": _MPI_CMD},
                on_this_machine=True,
                items="rapydli.experiments.batch.places:LocalPlaces",
            ),
            LauncherSpec(
                "ssh",
                engines="mpi",
                controller="local",
                description="mpiexec across hosts reached over ssh",
                options={
                    "hosts": Option(list, "host names, e.g. ['node1', 'node2'] or 'node1,node2'", apply=sshhosts.hosts),
                    "hostfile": Option(str, "a file of hosts, one 'name[:ranks]' a line", apply=sshhosts.hostfile),
                    "ssh_command": Option(
                        str, "the ssh program mpiexec runs to reach the hosts", apply=sshhosts.ssh_command
                    ),
                    "interface": Option(
                        str, "network interface MPI and the engines use, e.g. 'ib0'", apply=sshhosts.interface
                    ),
                    "transport": Option(
                        str, "'tcp' forces MPI traffic onto TCP; 'default' lets MPI choose", apply=sshhosts.transport
                    ),
                    "mpi_args": _MPI_ARGS,
                    "mpi_cmd": _MPI_CMD,
                },
                listen_all=True,
                check=sshhosts.check,
                reachable=sshhosts.reachable_engines,
                form=("hosts",),
                over_ssh=True,
                items="rapydli.experiments.batch.places:HostPlaces",
                ipp_names=("ssh", "sshproxy"),
            ),
            LauncherSpec(
                "slurm",
                engines="rapydli.cluster.slurm.SlurmEngines",
                controller="local",
                description="an sbatch job; srun --mpi=pmi2 starts the ranks as one MPI world",
                batch_class="SlurmEngines",
                options={
                    "nodes": _count("number of nodes", "SlurmEngines.nodes"),
                    "ntasks_per_node": _count("engines per node", "SlurmEngines.ntasks_per_node"),
                    "cpus_per_task": _count("CPUs (and threads) per engine", "SlurmEngines.cpus_per_task"),
                    "gpus_per_node": _count("GPUs per node", "SlurmEngines.gpus_per_node", minimum=0),
                    "partition": Option(str, "Slurm partition", "SlurmEngines.queue"),
                    "account": Option(str, "Slurm account", "SlurmEngines.account"),
                    "qos": Option(str, "Slurm QoS", "SlurmEngines.qos"),
                    "timelimit": Option(
                        str, "time limit, e.g. '01:00:00'", "SlurmEngines.timelimit", check=slurm.check_timelimit
                    ),
                    "constraint": Option(str, "node features, e.g. 'a100'", "SlurmEngines.constraint"),
                    "sbatch": Option(
                        list,
                        "extra '#SBATCH' lines, e.g. '--exclusive'",
                        "SlurmEngines.sbatch",
                        lines=True,
                        check=lambda lines: [slurm.sbatch_line(line) for line in lines],
                    ),
                    "setup": Option(
                        list,
                        "shell lines run before the engines, e.g. 'module load cuda'",
                        "SlurmEngines.setup",
                        lines=True,
                    ),
                    "mpi": Option(
                        str,
                        f"how ranks form one MPI world: {', '.join(slurm.MPI_MODES)}",
                        "SlurmEngines.mpi",
                        check=lambda mode: _one_of(mode, slurm.MPI_MODES),
                    ),
                },
                listen_all=True,
                threads_option="cpus_per_task",
                check_size=_tasks_fit,
                form=("partition", "nodes", "timelimit"),
                queue=_SLURM_QUEUE,
                items="rapydli.experiments.batch.places:SlurmPlaces",
                ipp_names=("slurm",),
            ),
            LauncherSpec(
                "srun",
                engines="rapydli.cluster.slurm.SrunEngines",
                controller="local",
                description="a step of the Slurm allocation this process runs in (salloc): no job queued",
                options={
                    "mpi": Option(
                        str,
                        f"how ranks form one MPI world: {', '.join(slurm.SRUN_MPI_MODES)}",
                        "SrunEngines.mpi",
                        check=lambda mode: _one_of(mode, slurm.SRUN_MPI_MODES),
                    ),
                    "mpi_args": Option(
                        list, "extra arguments for srun, e.g. ['--cpu-bind=cores']", "SrunEngines.mpi_args"
                    ),
                },
                allocation=Allocation(
                    "Slurm",
                    "SLURM_JOB_ID",
                    "SLURM_NTASKS",
                    get_one="salloc -n {n} jupyter lab",
                    otherwise="slurm",
                    reader=where.read_slurm,
                ),
                listen_all=True,
            ),
            LauncherSpec(
                "pbs",
                engines="pbs",
                controller="local",
                description="a qsub job; mpiexec starts the ranks",
                batch_class="PBSEngineSetLauncher",
                options={
                    "queue": Option(str, "PBS queue", "PBSEngineSetLauncher.queue"),
                    "batch_template": Option(str, "a full PBS script template", "PBSEngineSetLauncher.batch_template"),
                },
                listen_all=True,
                form=("queue",),
            ),
        )
    },
    group="rapydli.launchers",
)


def get_launcher(name: str) -> LauncherSpec:
    """The launcher called ``name``; :class:`ConfigError` listing the known ones otherwise."""
    if name not in LAUNCHERS:
        raise ConfigError(f"unknown launcher {name!r}: allowed are {', '.join(LAUNCHERS)}")
    spec: LauncherSpec = LAUNCHERS.load(name)
    return spec


def launcher_of(engine_class: str) -> str:
    """The launcher an ipyparallel cluster file's engine class names (its own class name if none does).

    >>> launcher_of("mpi"), launcher_of("sshproxy"), launcher_of("rapydli.cluster.slurm.SlurmEngines")
    ('local', 'ssh', 'slurm')
    """
    for name in LAUNCHERS:
        spec = get_launcher(name)
        if engine_class == spec.engines or engine_class in spec.ipp_names:
            return name
    return engine_class


def queue_of(launcher: object) -> BatchQueue | None:
    """The :class:`BatchQueue` of the launcher called ``launcher`` (None: not a batch launcher, or unknown)."""
    return get_launcher(launcher).queue if isinstance(launcher, str) and launcher in LAUNCHERS else None


def validate_options(launcher: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """Check ``options`` against ``launcher``'s allow-list and types; return them normalised.

    List options accept a list of strings or one space-separated string.

    Examples
    --------
    >>> validate_options("local", {"mpi_args": "-bind-to core"})
    {'mpi_args': ['-bind-to', 'core']}
    """
    spec = get_launcher(launcher)
    checked: dict[str, Any] = {}
    for key, value in options.items():
        if key not in spec.options:
            allowed = ", ".join(sorted(spec.options)) or "none"
            raise ConfigError(f"launcher {launcher!r} has no option {key!r}: allowed are {allowed}")
        option = spec.options[key]
        kind = option.kind
        if kind is list:
            if isinstance(value, str):
                value = [value] if option.lines else value.split()
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise ConfigError(f"option {key!r} of launcher {launcher!r} must be a list of strings, got {value!r}")
            value = list(value)
        elif not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise ConfigError(
                f"option {key!r} of launcher {launcher!r} must be {kind.__name__}, got {type(value).__name__}"
            )
        if option.check is not None:
            try:
                value = option.check(value)
            except ValueError as exc:
                raise ConfigError(f"option {key!r} of launcher {launcher!r}: {exc}") from None
        checked[key] = value
    if spec.check is not None:
        spec.check(checked)
    return checked
