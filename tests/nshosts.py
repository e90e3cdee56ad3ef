"""Real separate hosts on this machine: network namespaces on a bridge, each with an sshd.

``up(directory)`` creates hosts ``h1`` and ``h2``: a network namespace each, joined to the
bridge ``rdnet0`` (10.77.0.1/24 on this side) by a veth pair whose namespace end is
``eth0``: the interface the launcher options name (``rdnet0``, this machine's) does not
exist on the hosts, as a login node's interface is rarely a compute node's. Each host
has its own hostname, its own ``/etc/hosts`` (a private file bind-mounted over it, naming
the hosts and this machine's name at the bridge address), its own sysfs, and an ``sshd``
listening on its address only, with its own host key and root's key from ``directory``.
``directory/ssh`` is an ssh wrapper (``ssh -F directory/ssh_config``) that reaches them by
name, for MPICH's ``mpiexec -launcher-exec``.

``down(hosts)`` kills every process of the namespaces (by pid), deletes them and the
bridge. A lock file serialises test sessions on one machine; leftovers of a session that
died are removed first.

All hosts share one kernel, CPU set, filesystem and pid space: they are separate for
networking (MPI traffic crosses the veth links when forced onto TCP), name resolution and
ssh, not for timing.

Run as a script to keep hosts up for a benchmark::

    python tests/nshosts.py up /tmp/hosts   # prints the launcher options, then waits
    # Ctrl-C (or SIGTERM) tears them down
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

BRIDGE = "rdnet0"
#: The hosts' own end of their link: named otherwise than the bridge, as a cluster node's ``eth0`` is not the notebook machine's interface.
HOST_IFACE = "eth0"
SUBNET = "10.77.0"
BRIDGE_ADDR = f"{SUBNET}.1"
NAMES = ("h1", "h2")
LOCK = Path("/run/lock/rapydli-nshosts.lock")
PACKAGES = {"sshd": "openssh-server", "ssh": "openssh-client", "ip": "iproute2", "nsenter": "util-linux"}
OPTIONAL = {"sshfs": "sshfs"}  # a network filesystem for the run-store tests; installed along when possible


class Unavailable(RuntimeError):
    """The hosts cannot exist here (not root, no packages); the message says why."""


@dataclass
class Host:
    """One namespace host: its name, address, and the veth end on this side."""

    name: str
    address: str
    veth: str
    sshd: subprocess.Popen[bytes] | None = None

    def pids(self) -> list[int]:
        """Every process running in this host's network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False).stdout
        return [int(p) for p in out.split()]

    def commands(self) -> dict[int, str]:
        """Command line of every process of the host, by pid."""
        found = {}
        for pid in self.pids():
            try:
                found[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
            except OSError:
                pass
        return found

    def link_bytes(self) -> int:
        """Bytes that crossed the host's link so far, both ways (counted on this side's veth end)."""
        stats = Path(f"/sys/class/net/{self.veth}/statistics")
        return int((stats / "rx_bytes").read_text()) + int((stats / "tx_bytes").read_text())

    def kill(self) -> list[int]:
        """Kill every process of the host, as if it died; returns their pids."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids


@dataclass
class Hosts:
    """Hosts that are up, and what reaches them."""

    directory: Path
    hosts: list[Host] = field(default_factory=list)
    lock_fd: int = -1

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    @property
    def ssh(self) -> str:
        """The ssh wrapper, for ``mpiexec -launcher-exec``."""
        return str(self.directory / "ssh")

    def launcher_options(self) -> dict[str, object]:
        """Options of the ``ssh`` launcher that reach these hosts with MPI traffic on TCP."""
        return {"hosts": self.names, "ssh_command": self.ssh, "interface": BRIDGE, "transport": "tcp"}

    def host(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def ensure_packages() -> None:
    """Install openssh when root and missing; :class:`Unavailable` when the hosts cannot exist."""
    if os.geteuid() != 0:
        raise Unavailable("namespace hosts need root (ip netns, mounts, sshd)")
    missing = sorted(
        {pkg for tool, pkg in PACKAGES.items() if not (shutil.which(tool) or Path(f"/usr/sbin/{tool}").exists())}
    )
    if missing and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        extra = [pkg for tool, pkg in OPTIONAL.items() if not shutil.which(tool)]
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True, env=env, check=False)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing, *extra], capture_output=True, env=env, check=False)
        missing = sorted(
            {pkg for tool, pkg in PACKAGES.items() if not (shutil.which(tool) or Path(f"/usr/sbin/{tool}").exists())}
        )
    if missing:
        raise Unavailable(f"packages {', '.join(missing)} are missing and could not be installed with apt-get")
    probe = _run("ip", "netns", "add", "rdprobe", check=False)
    _run("ip", "netns", "del", "rdprobe", check=False)
    if probe.returncode != 0:
        raise Unavailable(f"network namespaces cannot be created here: {probe.stderr.strip()}")


def _remove_leftovers(names: tuple[str, ...]) -> None:
    for name in names:
        if Path(f"/run/netns/{name}").exists():
            for pid in Host(name, "", "").pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            _run("ip", "netns", "del", name, check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        _run("ip", "link", "del", BRIDGE, check=False)


_HOST_SCRIPT = """
set -e
mkdir -p {dir}/cg-{name}
mount --rbind /sys/fs/cgroup {dir}/cg-{name}
mount -t sysfs sysfs /sys
mount --move {dir}/cg-{name} /sys/fs/cgroup
mount --bind {dir}/hosts /etc/hosts
hostname {name}
exec /usr/sbin/sshd -D -e -f {dir}/sshd_config-{name}
"""


def up(directory: str | os.PathLike[str], names: tuple[str, ...] = NAMES, timeout: float = 20.0) -> Hosts:
    """Bring up ``names`` as hosts with their state in ``directory``; see the module docstring."""
    ensure_packages()
    directory = Path(directory).resolve()
    directory.mkdir(parents=True, exist_ok=True)
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # another session's hosts go down first
    hosts = Hosts(directory, lock_fd=lock_fd)
    try:
        _remove_leftovers(names)
        _write_files(directory, names)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{BRIDGE_ADDR}/24", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        for index, name in enumerate(names):
            host = Host(name, f"{SUBNET}.{11 + index}", f"rdv{name}")
            hosts.hosts.append(host)
            _run("ip", "netns", "add", name)
            _run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", HOST_IFACE, "netns", name)
            _run("ip", "link", "set", host.veth, "master", BRIDGE, "up")
            inside = ("ip", "netns", "exec", name, "ip")
            _run(*inside, "addr", "add", f"{host.address}/24", "dev", HOST_IFACE)
            _run(*inside, "link", "set", HOST_IFACE, "up")
            _run(*inside, "link", "set", "lo", "up")
            _run(*inside, "route", "add", "default", "via", BRIDGE_ADDR)
            _start_sshd(directory, host)
        _wait_for_ssh(hosts, timeout)
    except BaseException:
        down(hosts)
        raise
    return hosts


def _start_sshd(directory: Path, host: Host) -> None:
    """Start the host's sshd in its namespace, with its own hostname, /etc/hosts and sysfs."""
    script = _HOST_SCRIPT.format(dir=directory, name=host.name)
    with open(directory / f"sshd-{host.name}.log", "ab") as log:
        host.sshd = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{host.name}",
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )


def revive(hosts: Hosts, name: str, timeout: float = 20.0) -> None:
    """Boot a host that was killed again: its sshd runs anew in the same namespace."""
    host = hosts.host(name)
    if host.sshd is not None:
        host.sshd.wait()
    _start_sshd(hosts.directory, host)
    _wait_for_ssh(Hosts(hosts.directory, [host]), timeout)


def _write_files(directory: Path, names: tuple[str, ...]) -> None:
    key = directory / "id_ed25519"
    if not key.exists():
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
    addresses = {name: f"{SUBNET}.{11 + i}" for i, name in enumerate(names)}
    lines = ["127.0.0.1 localhost", f"{BRIDGE_ADDR} {socket.gethostname()}"]
    lines += [f"{address} {name}" for name, address in addresses.items()]
    (directory / "hosts").write_text("\n".join(lines) + "\n")
    (directory / "authorized_keys").write_text((directory / "id_ed25519.pub").read_text())
    known = []
    for name, address in addresses.items():
        host_key = directory / f"host_key-{name}"
        if not host_key.exists():
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(host_key))
        known.append(
            f"{name},{address} {(directory / f'host_key-{name}.pub').read_text().split(' ')[0]} "
            f"{(directory / f'host_key-{name}.pub').read_text().split(' ')[1]}"
        )
        (directory / f"sshd_config-{name}").write_text(
            f"ListenAddress {address}\nHostKey {host_key}\nUsePAM no\nPermitRootLogin prohibit-password\n"
            f"PasswordAuthentication no\nKbdInteractiveAuthentication no\nStrictModes no\n"
            f"AuthorizedKeysFile {directory}/authorized_keys\nPidFile none\nMaxStartups 100\nMaxSessions 100\n"
            "AcceptEnv *\nPermitUserEnvironment no\nLogLevel ERROR\nSubsystem sftp internal-sftp\n"
        )
    (directory / "known_hosts").write_text("\n".join(known) + "\n")
    config = [f"Host {name}\n  HostName {address}\n" for name, address in addresses.items()]
    config.append(
        f"Host *\n  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n  BatchMode yes\n"
        f"  UserKnownHostsFile {directory}/known_hosts\n  StrictHostKeyChecking yes\n  LogLevel ERROR\n"
        "  ConnectTimeout 5\n  ServerAliveInterval 2\n  ServerAliveCountMax 2\n"
    )
    (directory / "ssh_config").write_text("".join(config))
    wrapper = directory / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec ssh -F {directory}/ssh_config "$@"\n')
    wrapper.chmod(0o755)
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory


def _wait_for_ssh(hosts: Hosts, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for host in hosts.hosts:
        while True:
            result = _run(hosts.ssh, host.name, "hostname", check=False)
            if result.returncode == 0 and result.stdout.strip() == host.name:
                break
            if time.monotonic() > deadline:
                log = (hosts.directory / f"sshd-{host.name}.log").read_text(errors="replace")
                raise RuntimeError(
                    f"host {host.name} not reachable over ssh within {timeout} s: {result.stderr.strip()}\n{log}"
                )
            time.sleep(0.1)


def down(hosts: Hosts) -> None:
    """Kill every process of the hosts by pid, delete the namespaces and the bridge."""
    for host in hosts.hosts:
        if not Path(f"/run/netns/{host.name}").exists():
            continue
        for _ in range(50):  # processes may fork while being killed (sshd sessions)
            if not host.kill():
                break
            time.sleep(0.05)
        _run("ip", "netns", "del", host.name, check=False)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        _run("ip", "link", "del", BRIDGE, check=False)
    for host in hosts.hosts:
        if host.sshd is not None:
            host.sshd.kill()
            host.sshd.wait()
    if hosts.lock_fd >= 0:
        os.close(hosts.lock_fd)
        hosts.lock_fd = -1


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "up":
        print("usage: python tests/nshosts.py up DIRECTORY", file=sys.stderr)
        return 2
    hosts = up(argv[1])
    print(json.dumps(hosts.launcher_options()), flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        down(hosts)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
