"""Options of the ``ssh`` launcher: MPICH Hydra's ``mpiexec`` reaching other hosts over ssh.

Each option becomes the Hydra arguments and environment it stands for, so users name what
they mean rather than writing ``mpi_args``:

===============  =================================================================
``hosts``        ``-hosts h1,h2``: one rank per host in turn (``h1:2`` for two)
``hostfile``     ``-f FILE``: one ``name[:ranks]`` a line (Hydra's format)
``ssh_command``  ``-launcher ssh -launcher-exec PROG``: e.g. a wrapper adding ``-F config``
``interface``    ``-iface NAME``: Hydra's proxies call back on this interface's address,
                 and the ipyparallel controller listens there (so engines need not
                 resolve this machine's name); with ``transport='tcp'`` MPI uses it too,
                 or, on a host that names it otherwise, the host's interface on its network
``transport``    ``'tcp'``: MPI traffic goes over TCP (``UCX_TLS=self,tcp``; libfabric's
                 ``tcp`` provider for MPICH's ofi netmod), e.g. where hosts share a kernel
                 or no fast network exists; ``'default'``: MPI chooses
===============  =================================================================

Each rank's output lines start with its host (Hydra's ``-prepend-pattern``), so a start
that fails quotes what each host said (:mod:`rapydli.cluster.launchwatch`).

The flags are Hydra's (MPICH, Intel MPI, MVAPICH); with another site MPI, pass its own
flags in ``mpi_args`` and ``mpi_cmd``.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from rapydli.cluster.launchwatch import HOST_PATTERN
from rapydli.cluster.mpi_engine import PEER_VARIABLE, PROGRAM
from rapydli.errors import ConfigError

Config = dict[str, dict[str, Any]]
#: Environment variables a program started on another host (:func:`spawn_python`) receives from this process.
PASSED_PREFIXES = ("RAPYDLI_", "PYTHON", "OMP_", "MKL_", "UCX_", "FI_", "JUPYTER_")
PASSED_NAMES = ("PATH", "VIRTUAL_ENV", "LANG")
TRANSPORTS = ("tcp", "default")
_TCP_ENV = {"UCX_TLS": "self,tcp", "FI_PROVIDER": "tcp"}


def host_names(value: list[str]) -> list[str]:
    """Host names from the ``hosts`` option, which may hold comma-separated names."""
    return [name for item in value for name in item.split(",") if name]


def read_hostfile(path: str) -> list[str]:
    """Host names of a Hydra host file (``name[:ranks]`` a line; ``#`` comments)."""
    lines = (line.split("#", 1)[0].strip() for line in Path(path).read_text().splitlines())
    return [line.split(":", 1)[0] for line in lines if line]


def check(options: dict[str, Any]) -> None:
    """Checks across the ``ssh`` launcher's options, before any process starts."""
    if "hosts" in options and "hostfile" in options:
        raise ConfigError("the ssh launcher takes 'hosts' or 'hostfile', not both")
    if "hosts" not in options and "hostfile" not in options:
        raise ConfigError("the ssh launcher needs 'hosts' (e.g. hosts=node1,node2) or 'hostfile'")
    if "hosts" in options:
        options["hosts"] = host_names(options["hosts"])
        if not options["hosts"]:
            raise ConfigError("option 'hosts' of launcher 'ssh' names no host")
    if "hostfile" in options:
        path = options["hostfile"]
        if not os.path.isfile(path):
            raise ConfigError(f"hostfile {path!r} does not exist")
        if not read_hostfile(path):
            raise ConfigError(f"hostfile {path!r} names no host")
    if "ssh_command" in options and not shutil.which(options["ssh_command"]):
        raise ConfigError(f"ssh_command {options['ssh_command']!r} is not an executable program")
    if "interface" in options:
        interface_address(options["interface"])
    if options.get("transport", "default") not in TRANSPORTS:
        raise ConfigError(f"transport {options['transport']!r} is invalid: allowed are {', '.join(TRANSPORTS)}")


def interface_address(name: str) -> str:
    """The IPv4 address of network interface ``name`` on this machine."""
    import psutil

    interfaces = psutil.net_if_addrs()
    if name not in interfaces:
        raise ConfigError(
            f"network interface {name!r} does not exist here: available are {', '.join(sorted(interfaces))}"
        )
    for address in interfaces[name]:
        if address.family == socket.AF_INET:
            return str(address.address)
    raise ConfigError(f"network interface {name!r} has no IPv4 address")


def _mpi_args(config: Config, *args: str) -> None:
    launcher = config.setdefault("MPIEngineSetLauncher", {})
    launcher["mpi_args"] = [*args, *launcher.get("mpi_args", [])]


def _environment(config: Config) -> dict[str, str]:
    return config.setdefault("BaseLauncher", {}).setdefault("environment", {})


def _pin_tcp_to_interface(config: Config) -> None:
    """With TCP forced and an interface named, MPI's TCP traffic uses that interface only."""
    args = config.get("MPIEngineSetLauncher", {}).get("mpi_args", [])
    env = _environment(config)
    if "-iface" in args and env.get("UCX_TLS") == _TCP_ENV["UCX_TLS"]:
        name = args[args.index("-iface") + 1]
        env.update(UCX_NET_DEVICES=name, FI_TCP_IFACE=name)


def _host_list(config: Config, *args: str) -> None:
    """The hosts' arguments, and each rank's output lines prefixed with its host (what a failed start quotes per host)."""
    _mpi_args(config, *args, "-prepend-pattern", HOST_PATTERN)


def hosts(value: list[str], config: Config) -> None:
    """``hosts`` -> ``-hosts h1,h2``."""
    _host_list(config, "-hosts", ",".join(host_names(value)))


def hostfile(value: str, config: Config) -> None:
    """``hostfile`` -> ``-f FILE``."""
    _host_list(config, "-f", os.path.abspath(value))


def ssh_command(value: str, config: Config) -> None:
    """``ssh_command`` -> ``-launcher ssh -launcher-exec PROG``."""
    _mpi_args(config, "-launcher", "ssh", "-launcher-exec", shutil.which(value) or value)


def interface(value: str, config: Config) -> None:
    """``interface`` -> ``-iface NAME``; the controller listens on its address.

    The engines start through :mod:`rapydli.cluster.mpi_engine`, which on a host without
    an interface of that name pins MPI to the host's own interface on that address's network.
    """
    address = interface_address(value)
    _mpi_args(config, "-iface", value)
    config.setdefault("Cluster", {}).update(controller_ip=address, controller_location=address)
    config.setdefault("MPIEngineSetLauncher", {})["engine_cmd"] = list(PROGRAM)
    _environment(config)[PEER_VARIABLE] = address
    _pin_tcp_to_interface(config)


def transport(value: str, config: Config) -> None:
    """``transport='tcp'`` -> the environment that keeps MPI on TCP."""
    if value == "tcp":
        _environment(config).update(_TCP_ENV)
        _pin_tcp_to_interface(config)


def host_slots(options: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(host, ranks)`` of the ``hosts`` or ``hostfile`` option, in Hydra's order (1 rank where none is given)."""
    if "hosts" in options:
        entries = host_names(options["hosts"])
    else:
        lines = (line.split("#", 1)[0].strip() for line in Path(options["hostfile"]).read_text().splitlines())
        entries = [line for line in lines if line]
    slots = []
    for entry in entries:
        name, _, count = entry.partition(":")
        slots.append((name, int(count) if count.strip().isdigit() else 1))
    return slots


def reachable_engines(n: int, options: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
    """What the ``ssh`` launcher can start now: ``(engines, options, {host: why it is left out})``.

    Hosts that do not answer ``ssh HOST true`` are left out with the ranks Hydra would have
    placed there: rank ``r`` goes to the host of slot ``r mod slots``, each host's slots
    (``name:ranks``) in turn, so ``-hosts h1,h2 -n 4`` puts ranks 0 and 2 on ``h1``. The
    options returned name the hosts left (as ``hosts``, also for a ``hostfile``).

    Examples
    --------
    >>> reachable_engines(4, {"hosts": ["h1", "h2"]})  # doctest: +SKIP
    (2, {'hosts': ['h1']}, {'h2': 'no answer over ssh within 3 s'})
    """
    slots = host_slots(options)
    down = unreachable_hosts(list(dict.fromkeys(host for host, _ in slots)), options.get("ssh_command", "ssh"))
    if not down:
        return n, options, {}
    engines, hosts_left = leave_out(n, slots, set(down))
    kept = {key: value for key, value in options.items() if key not in ("hosts", "hostfile")}
    return engines, {**kept, "hosts": hosts_left}, down


def leave_out(n: int, slots: list[tuple[str, int]], down: set[str]) -> tuple[int, list[str]]:
    """``n`` ranks placed on ``slots`` as Hydra places them, less the ``down`` hosts: ``(ranks left, hosts option left)``.

    Examples
    --------
    >>> leave_out(4, [("h1", 1), ("h2", 1)], {"h2"})
    (2, ['h1'])
    >>> leave_out(6, [("h1", 2), ("h2", 2), ("h3", 2)], {"h1"})
    (4, ['h2:2', 'h3:2'])
    """
    placement = [host for host, count in slots for _ in range(count)]
    engines = sum(placement[rank % len(placement)] not in down for rank in range(n))
    return engines, [f"{host}:{count}" if count != 1 else host for host, count in slots if host not in down]


def mpiexec_arguments(options: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """``(mpiexec arguments, environment)`` for the ``ssh`` launcher's ``options``, for plain SPMD runs.

    The same translation engines get, for programs started with
    :func:`rapydli.cluster.mpirun.run` (benchmarks).
    """
    from rapydli.cluster.launchers import get_launcher, validate_options

    config = get_launcher("ssh").config(validate_options("ssh", options))
    return list(config["MPIEngineSetLauncher"].get("mpi_args", [])), dict(
        config.get("BaseLauncher", {}).get("environment", {})
    )


def spawn_python(
    host: str, args: Sequence[str], *, ssh_command: str, cwd: str, env: Mapping[str, str], output: IO[str]
) -> subprocess.Popen[bytes]:
    """Start ``python args...`` (this interpreter's path) on ``host`` in ``cwd``, with the passed part of ``env``.

    The program runs as its own process group on the host; when the ssh session ends
    (this side killed it, or this process died) a watcher on the session's stdin ends
    that group, so nothing is left behind there.
    """
    passed = {k: v for k, v in env.items() if k.startswith(PASSED_PREFIXES) or k in PASSED_NAMES}
    program = shlex.join(["env", *(f"{k}={v}" for k, v in sorted(passed.items())), "setsid", sys.executable, *args])
    script = (  # fd 3: a background job's own stdin is /dev/null
        f"cd {shlex.quote(cwd)} || exit 111; exec 3<&0; {program} & pid=$!; "
        '(cat <&3 > /dev/null; kill -TERM -- -"$pid" 2> /dev/null) > /dev/null 2>&1 & '
        'wait "$pid"'
    )
    return subprocess.Popen(
        [ssh_command, "-o", "BatchMode=yes", host, script],
        stdin=subprocess.PIPE,
        stdout=output,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


_REAP = (
    'pids="{pids}"; for i in $(seq {tries}); do alive=""; '
    'for p in $pids; do grep -q ipyparallel /proc/$p/cmdline 2>/dev/null && alive="$alive $p"; done; '
    '[ -z "$alive" ] && exit 0; sleep 0.1; done; kill -9 $alive 2>/dev/null; exit 0'
)


def reap_remote(pids_by_host: dict[str, list[int]], ssh: str = "ssh", grace: float = 5.0) -> None:
    """On each host, wait up to ``grace`` s for the engine processes ``pids`` to exit, then kill the rest.

    A pid is only killed while its command line is still an ipyparallel one (not a
    reused pid). Hosts that do not answer are skipped: their processes went with them.
    """
    tries = max(1, int(grace / 0.1))
    options = ["-o", "BatchMode=yes", "-o", "ConnectTimeout=3"]
    null = subprocess.DEVNULL
    probes = []
    for host, pids in pids_by_host.items():
        script = _REAP.format(pids=" ".join(map(str, pids)), tries=tries)
        probes.append(subprocess.Popen([ssh, *options, host, script], stdin=null, stdout=null, stderr=null))
    for probe in probes:
        try:
            probe.wait(timeout=grace + 10)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.wait()


def unreachable_hosts(hosts: list[str], ssh: str = "ssh", timeout: float = 3.0) -> dict[str, str]:
    """``{host: why}`` for the ``hosts`` that do not answer ``ssh HOST true`` (asked at once)."""
    command = ["-o", f"ConnectTimeout={max(1, int(timeout))}", "-o", "BatchMode=yes"]
    probes = {
        host: subprocess.Popen(
            [ssh, *command, host, "true"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in hosts
    }
    down = {}
    for host, probe in probes.items():
        try:
            _, err = probe.communicate(timeout=timeout + 1)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.communicate()
            down[host] = f"no answer over ssh within {timeout:g} s"
            continue
        if probe.returncode != 0:
            down[host] = f"ssh fails ({err.strip().splitlines()[-1] if err.strip() else f'exit {probe.returncode}'})"
    return down


class SessionWatch:
    """The ssh sessions ``mpiexec`` holds to each host, watched while the engines run.

    Hydra reaches every host through one ssh session that lasts as long as the job. When
    one ends while the engines run, its host is asked (``ssh HOST true``); a host that
    does not answer is lost, and the ranks there are named at once instead of after
    ipyparallel's heartbeat gives up on them (about 30 s). A session ends on a lost link
    only when ssh notices it: ``ServerAliveInterval 2`` and ``ServerAliveCountMax 2`` in
    the ssh configuration make that a few seconds.

    Parameters
    ----------
    sessions
        ``{host: pid}`` of each host's ssh session on this machine.
    ssh
        The ssh program that probes a host.
    """

    CHECK_S = 0.25  # at most one look at the sessions per this many seconds
    PROBE_S = 1.0  # how long a host whose session ended has to answer

    def __init__(self, sessions: dict[str, int], ssh: str = "ssh") -> None:
        self.sessions = sessions
        self.ssh = ssh
        self.down: dict[str, str] = {}  # host -> why, for hosts found lost
        self._asked: set[str] = set()
        self._checked_at = 0.0

    @classmethod
    def find(cls, cluster_id: str, hosts: Sequence[str], ssh: str = "ssh") -> SessionWatch:
        """The sessions to ``hosts`` among the processes of cluster ``cluster_id`` on this machine."""
        from rapydli.cluster.processes import marked

        names = {"ssh", os.path.basename(ssh)}
        sessions: dict[str, int] = {}
        for proc in marked(cluster_id):
            try:
                argv = proc.cmdline()
            except Exception:  # noqa: BLE001 - a process that ended meanwhile
                continue
            if not any(os.path.basename(arg) in names for arg in argv[:2]):
                continue
            host = next((arg for arg in argv[1:] if arg in hosts), None)
            if host is not None:
                sessions.setdefault(host, proc.pid)
        return cls(sessions, ssh)

    def lost(self) -> dict[str, str]:
        """``{host: why}`` for the hosts whose session ended and that do not answer."""
        import time

        import psutil

        now = time.monotonic()
        if now - self._checked_at < self.CHECK_S:
            return dict(self.down)
        self._checked_at = now
        ended = []
        for host, pid in self.sessions.items():
            if host in self._asked:
                continue
            try:
                alive = psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                alive = False
            if not alive:
                ended.append(host)
        if ended:
            self._asked.update(ended)
            self.down.update(unreachable_hosts(ended, self.ssh, timeout=self.PROBE_S))
        return dict(self.down)
