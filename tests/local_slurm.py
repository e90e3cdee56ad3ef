"""A real Slurm 22.05 on this machine, for tests and benchmarks: two nodes, all under one directory.

Debian's ``slurmctld``, ``slurmd`` and ``munge`` started directly (no systemd): a private
``munged`` (its own socket), ``slurmctld``, and one ``slurmd -N nI`` per node, all on
127.0.0.1 with free ports. Configuration, state, spool, logs and pid files live under
the directory given; :meth:`LocalSlurm.down` ends the daemons by pid. Partitions:

* ``debug`` (default): nodes ``n1`` and ``n2``, up;
* ``down``: the same nodes, state DOWN, so a job sent there stays pending with reason
  ``PartitionDown`` (a queued job, deterministically).

Clients find it through ``SLURM_CONF`` (:meth:`LocalSlurm.environ`). Job ids start at a
random number: MPICH names its shared-memory segments after the job and step, and a
segment left in ``/dev/shm`` by a killed job of an earlier instance (whose ids also
started at 1) makes ``MPI_Init`` fail with "Out of memory".

As a program: ``python tests/local_slurm.py up DIR`` brings it up and prints the
``export SLURM_CONF=...`` line; ``python tests/local_slurm.py down DIR`` stops it.
"""

from __future__ import annotations

import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
NODES = ("n1", "n2")
CPUS_PER_NODE = 4  # more than this machine's cores (config_overrides): 4 ranks and a batch job fit at once
PORT_ATTEMPTS = 3  # bring-ups tried, each with newly picked free ports


class SlurmUnavailable(RuntimeError):
    """Slurm cannot exist here (not root, packages not installable); the reason is the message."""


def ensure_packages() -> None:
    """Install Debian's Slurm and munge packages when missing (needs root and apt)."""
    if all(shutil.which(cmd) for cmd in ("slurmctld", "slurmd", "sbatch", "munged")):
        return
    if os.geteuid() != 0:
        raise SlurmUnavailable("a local Slurm needs root (to run slurmd and install packages)")
    if not shutil.which("apt-get"):
        raise SlurmUnavailable(f"Slurm is not installed and there is no apt-get to install {' '.join(PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SlurmUnavailable(f"{' '.join(command)} failed: {done.stderr[-2000:]}")


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


@dataclass
class LocalSlurm:
    """A running local Slurm: its directory, configuration file and daemon pids."""

    root: Path
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    def environ(self) -> dict[str, str]:
        """The variables Slurm's client commands need (``SLURM_CONF``)."""
        return {"SLURM_CONF": str(self.conf)}

    # -- bring-up --------------------------------------------------------------------------

    def up(self, timeout: float = 30.0) -> LocalSlurm:
        """Write the configuration, start munged, slurmctld and the slurmds; wait for idle nodes."""
        ensure_packages()
        if os.geteuid() != 0:
            raise SlurmUnavailable("a local Slurm needs root (slurmd runs jobs as their users)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.root.chmod(0o755)  # munged runs as the munge user and must reach its socket
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(exist_ok=True)
        munge = pwd.getpwnam("munge")
        os.chown(self.root / "munge", munge.pw_uid, munge.pw_gid)
        self._start_munge()
        env = {**os.environ, **self.environ()}
        for attempt in range(1, PORT_ATTEMPTS + 1):
            self._write_conf()
            try:
                self.pids["slurmctld"] = self._daemon(["slurmctld", "-f", str(self.conf)], "slurmctld", env)
                for node in NODES:
                    self.pids[f"slurmd-{node}"] = self._daemon(
                        ["slurmd", "-f", str(self.conf), "-N", node], f"slurmd.{node}", env
                    )
                break
            except RuntimeError as exc:
                # a port found free was taken (by any process's connection) before the daemon bound it:
                # end the daemons started so far and try again with other ports and a fresh state
                _end([pid for name, pid in self.pids.items() if name != "munged"])
                self.pids = {name: pid for name, pid in self.pids.items() if name == "munged"}
                if "Address already in use" not in str(exc) or attempt == PORT_ATTEMPTS:
                    raise
                shutil.rmtree(self.root / "state")
                (self.root / "state").mkdir()
        self._wait_idle(timeout)
        return self

    def _start_munge(self) -> None:
        socket_path = self.root / "munge" / "munge.socket"
        pid_file = self.root / "munge" / "munged.pid"
        subprocess.run(
            [
                "runuser",
                "-u",
                "munge",
                "--",
                "munged",
                f"--socket={socket_path}",
                f"--pid-file={pid_file}",
                f"--log-file={self.root / 'munge' / 'munged.log'}",
                f"--seed-file={self.root / 'munge' / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        self.pids["munged"] = int(pid_file.read_text())

    def _write_conf(self) -> None:
        host = socket.gethostname().split(".")[0]
        ctl_port, *node_ports = _free_ports(1 + len(NODES))
        r = self.root
        port_list = ",".join(map(str, node_ports))
        self.conf.write_text(
            f"""ClusterName=rapydli-test
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctl_port}
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
KillWait=5
MinJobAge=300
FirstJobId={random.randrange(1_000, 60_000_000)}
SchedulerType=sched/backfill
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
NodeName=n[1-{len(NODES)}] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{port_list}] CPUs={CPUS_PER_NODE} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=n[1-{len(NODES)}] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
PartitionName=down Nodes=n[1-{len(NODES)}] MaxTime=INFINITE State=DOWN
"""
        )
        for node in NODES:
            (self.root / "spool" / node).mkdir(exist_ok=True)

    def _daemon(self, argv: list[str], name: str, env: dict[str, str]) -> int:
        """Start a Slurm daemon (it forks into the background) and return the pid from its pid file."""
        pid_file = self.root / f"{name}.pid"
        pid_file.unlink(missing_ok=True)
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr}\n{self._log_tail(name)}")
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text().strip():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} wrote no pid file\n{self._log_tail(name)}")
            time.sleep(0.05)
        return int(pid_file.read_text())

    def _log_tail(self, name: str) -> str:
        log = self.root / "log" / f"{name}.log"
        return log.read_text()[-3000:] if log.exists() else ""

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states = ""
        while time.monotonic() < deadline:
            states = self.run("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t", check=False).stdout
            if states.split() and all(line.split()[1] == "idle" for line in states.strip().splitlines()):
                return
            time.sleep(0.1)
        raise RuntimeError(f"nodes not idle after {timeout} s: {states!r}\n{self._log_tail('slurmctld')}")

    # -- use -------------------------------------------------------------------------------

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command (``squeue``, ``scontrol`` ...) against this Slurm."""
        return subprocess.run(argv, env={**os.environ, **self.environ()}, capture_output=True, text=True, check=check)

    def queue(self) -> list[str]:
        """Job ids in the queue (any state squeue shows: pending, running, completing)."""
        return self.run("squeue", "-h", "-o", "%i").stdout.split()

    def down(self, timeout: float = 20.0) -> None:
        """Cancel every job and wait for the queue to empty, end the daemons by pid, then end
        any process still carrying this Slurm's ``SLURM_CONF`` (job steps whose processes
        outlived a cancel: proctrack/linuxproc loses what re-parents itself)."""
        if "slurmctld" in self.pids:
            self.run("scancel", "--full", "-u", "root", check=False)
            deadline = time.monotonic() + timeout
            while self.run("squeue", "-h", "-o", "%i", check=False).stdout.split() and time.monotonic() < deadline:
                time.sleep(0.2)
        _end(list(self.pids.values()))
        self.pids.clear()
        _end(self._leftovers(), grace=2.0)

    def _leftovers(self) -> list[int]:
        """Processes (not this one or its ancestors) whose environment names this Slurm's configuration."""
        mine = f"SLURM_CONF={self.conf}".encode()
        spared = {os.getpid()}
        parent = os.getppid()
        while parent > 1:
            spared.add(parent)
            try:
                parent = int(Path(f"/proc/{parent}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                break
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in spared:
                continue
            try:
                if mine in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                continue
        return found


def _end(pids: list[int], grace: float = 5.0) -> None:
    """SIGTERM ``pids`` together, wait up to ``grace`` seconds, SIGKILL those left."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
            alive.append(pid)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _exists(pid)]
        time.sleep(0.05)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("up", "down"):
        print("usage: local_slurm.py up|down DIR", file=sys.stderr)
        return 2
    root = Path(argv[1]).resolve()
    slurm = LocalSlurm(root)
    if argv[0] == "up":
        slurm.up()
        (root / "pids").write_text("\n".join(f"{k} {v}" for k, v in slurm.pids.items()))
        print(f"export SLURM_CONF={slurm.conf}")
    else:
        for line in (root / "pids").read_text().splitlines():
            name, pid = line.split()
            slurm.pids[name] = int(pid)
        slurm.down()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
