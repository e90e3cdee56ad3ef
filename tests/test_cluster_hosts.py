"""The ``ssh`` launcher on two real hosts (network namespaces with sshd, see ``nshosts``).

One rank per host, MPI traffic forced onto TCP so it crosses the hosts' links; the cells,
``rd.train``, and a host dying in the middle of a collective.
"""

from __future__ import annotations

import re
import socket
import subprocess
import threading
import time
import uuid

import nshosts
import pytest
from hosts_cases import allreduce_on_host, train_matches_one_process
from IPython.utils.capture import capture_output
from processes import wait_until_gone

import rapydli as rd
from rapydli.cluster import current, launchers, sshhosts
from rapydli.cluster.mpi_engine import PEER_VARIABLE
from rapydli.errors import ConfigError, RankFailure


def test_bad_ssh_options_fail_before_anything_starts(tmp_path) -> None:
    empty = tmp_path / "hostfile"
    empty.write_text("# nobody\n")
    for options, message in [
        ({}, "needs 'hosts'"),
        ({"hosts": "a", "hostfile": str(empty)}, "not both"),
        ({"hostfile": str(tmp_path / "missing")}, "does not exist"),
        ({"hostfile": str(empty)}, "names no host"),
        ({"hosts": "a,b", "interface": "nosuch0"}, "interface 'nosuch0' does not exist here: available are"),
        ({"hosts": "a", "transport": "udp"}, "allowed are tcp, default"),
        ({"hosts": "a", "ssh_command": str(tmp_path / "nossh")}, "not an executable"),
    ]:
        with pytest.raises(ConfigError, match=message):
            rd.Cluster(n=2, launcher="ssh", **options)


def test_ssh_options_become_hydra_arguments_and_environment(tmp_path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnode2:2 # fast ones\n")
    options = launchers.validate_options(
        "ssh", {"hostfile": str(hostfile), "ssh_command": "ssh", "interface": "lo", "transport": "tcp"}
    )
    config = launchers.get_launcher("ssh").config(options)
    args = config["MPIEngineSetLauncher"]["mpi_args"]
    assert args[args.index("-f") + 1] == str(hostfile)
    assert args[args.index("-iface") + 1] == "lo" and "-launcher-exec" in args
    assert config["Cluster"] == {"controller_ip": "127.0.0.1", "controller_location": "127.0.0.1"}
    assert config["BaseLauncher"]["environment"] == {
        "UCX_TLS": "self,tcp",
        "FI_PROVIDER": "tcp",
        "UCX_NET_DEVICES": "lo",
        "FI_TCP_IFACE": "lo",
        PEER_VARIABLE: "127.0.0.1",
    }
    assert config["MPIEngineSetLauncher"]["engine_cmd"][1:] == [
        "-m",
        "rapydli.cluster.mpi_engine",
    ]  # names the hosts' own interface
    assert launchers.validate_options("ssh", {"hosts": "h1,h2"})["hosts"] == ["h1", "h2"]


def test_a_restart_leaves_out_the_ranks_hydra_placed_on_hosts_that_are_down(tmp_path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:2 # two ranks\nh2:2\n\nh3\n")
    slots = sshhosts.host_slots({"hostfile": str(hostfile)})
    assert slots == [("h1", 2), ("h2", 2), ("h3", 1)] == sshhosts.host_slots({"hosts": ["h1:2,h2:2", "h3"]})
    assert sshhosts.leave_out(2, [("h1", 1), ("h2", 1)], {"h2"}) == (1, ["h1"])
    assert sshhosts.leave_out(4, [("h1", 1), ("h2", 1)], {"h2"}) == (2, ["h1"])  # h1 h2 h1 h2
    assert sshhosts.leave_out(7, slots, {"h2"}) == (5, ["h1:2", "h3"])  # h1 h1 h2 h2 h3 h1 h1
    assert sshhosts.leave_out(2, [("h1", 1), ("h2", 1)], {"h1", "h2"}) == (0, [])
    with pytest.raises(ConfigError, match=r"min_engines=3 is invalid: an integer in 1..2"):
        rd.Cluster(n=2).restart(min_engines=3)


@pytest.mark.hosts
def test_hosts_are_separate(hosts) -> None:
    for host in hosts.hosts:
        result = subprocess.run(
            [hosts.ssh, host.name, f"hostname; ip -4 -br addr show {nshosts.HOST_IFACE}; cat /etc/hosts"],
            capture_output=True,
            text=True,
            check=True,
        )
        name, address = result.stdout.splitlines()[:2]
        assert name == host.name and f"{host.address}/24" in address
        assert f"{host.address} {host.name}" in result.stdout
    with open("/etc/hosts") as own:
        assert "10.77.0.11" not in own.read()  # this machine's file is untouched


@pytest.fixture(scope="module")
def ip(hosts, ipython_shell):
    shell = ipython_shell
    options = f"hosts=h1,h2 ssh_command={hosts.ssh} interface={nshosts.BRIDGE} transport=tcp"
    with capture_output():
        shell.run_line_magic("rapydli", f"start {options} -n 2 --launcher ssh")
    yield shell
    shell.run_line_magic("rapydli", "stop")
    assert not wait_until_gone(), "cluster stop left processes behind here"
    for host in hosts.hosts:  # and on the hosts: only their sshd remains (sessions end as ssh closes)
        deadline = time.monotonic() + 10
        while host.pids() != [host.sshd.pid] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert host.pids() == [host.sshd.pid], f"processes left on {host.name}: {host.commands()}"


def cell(ip, code: str, line: str = ""):
    with capture_output() as captured:
        value = ip.run_cell_magic("distributed", line, code)
    return value, captured


def _mpi_interfaces() -> tuple[str, str]:
    import os

    return os.environ["FI_TCP_IFACE"], os.environ["UCX_NET_DEVICES"]


@pytest.mark.hosts
@pytest.mark.engines
def test_distributed_cell_spans_the_hosts_over_tcp(ip, hosts) -> None:
    status = ip.run_line_magic("rapydli", "status")
    assert status["rank_hosts"] == {0: "h1", 1: "h2"} and status["launcher"] == "ssh"
    # the options name this machine's interface, which the hosts do not have: MPI was pinned to theirs
    for host in hosts.names:
        interfaces = subprocess.run(
            [hosts.ssh, host, "ls /sys/class/net"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert nshosts.BRIDGE not in interfaces and nshosts.HOST_IFACE in interfaces, interfaces
    assert current().run(_mpi_interfaces) == [(nshosts.HOST_IFACE, nshosts.HOST_IFACE)] * 2
    before = [h.link_bytes() for h in hosts.hosts]
    ip.user_ns["allreduce_on_host"] = allreduce_on_host
    value, captured = cell(
        ip,
        "import socket\nprint(socket.gethostname())\nallreduce_on_host(4 << 20)",
        "--gather --push allreduce_on_host",
    )
    assert value == [("h1", 2.0), ("h2", 2.0)]
    assert "[rank 1] h2" in captured.stdout
    crossed = [h.link_bytes() - b for h, b in zip(hosts.hosts, before)]
    assert all(c > 4 << 20 for c in crossed), f"bytes on the links: {crossed}"


@pytest.mark.hosts
@pytest.mark.engines
def test_training_across_hosts_matches_one_process(ip) -> None:
    results = current().run(train_matches_one_process)  # the magic's cluster
    assert [r["host"] for r in results] == ["h1", "h2"]
    assert all(r["difference"] < 1e-5 for r in results), results
    assert results[0]["table_hosts"] == ["h1", "h2"]
    assert results[0]["measured"] == ["mpi", "ring"]  # shm is off: the ranks share no node
    model, data = "rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits"
    with pytest.raises(ConfigError, match="'shm' needs every rank on one node; these ranks run on h1, h2"):
        rd.train(model, data, rd.TrainConfig(max_steps=1, allreduce="shm"), cluster=current(), progress=False)
    result = rd.train(
        model, data, rd.TrainConfig(max_steps=4, batch_size=16, allreduce="auto"), cluster=current(), progress=False
    )
    assert (result.history["world_size"].dropna() == 2).all()


#: How soon a lost host must fail the cell (the issue's bound; generous: see the report of each run).
REPORTED_WITHIN_S = 10.0


def _lose_h2_mid_collective(ip, tmp_path, lose) -> tuple[RankFailure, float]:
    """Run a cell looping over Allreduce on both hosts, call ``lose()`` once it runs; the failure and its delay."""
    started = tmp_path / "started"
    code = (
        "import numpy as np, pathlib\n"
        "data = np.ones(1 << 16, dtype=np.float32); out = np.empty_like(data)\n"
        "comm.Allreduce(data, out)\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        "while True:\n    comm.Allreduce(data, out)\n"
    )
    lost_at: list[float] = []

    def lose_h2() -> None:
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        lost_at.append(time.monotonic())
        lose()

    loser = threading.Thread(target=lose_h2)
    loser.start()
    try:
        with pytest.raises(RankFailure) as failure:
            cell(ip, code, "--timeout 60")
    finally:
        loser.join()
    return failure.value, time.monotonic() - lost_at[0]


class _Capture:
    """Every frame crossing the hosts' bridge (a raw packet socket on this side), gathered in a thread."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
        self.sock.bind((nshosts.BRIDGE, 0))
        self.sock.settimeout(0.1)
        self.frames: list[bytes] = []
        self.running = True
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while self.running:
            try:
                self.frames.append(self.sock.recv(1 << 16))
            except TimeoutError:
                continue

    def seen(self, marker: bytes, timeout: float = 10.0) -> bool:
        """Wait until ``marker`` has crossed the bridge (True), or ``timeout`` passed (False)."""
        deadline = time.monotonic() + timeout
        while marker not in b"".join(self.frames) and time.monotonic() < deadline:
            time.sleep(0.05)
        return marker in b"".join(self.frames)

    def stop(self) -> bytes:
        self.running = False
        self.thread.join()
        self.sock.close()
        return b"".join(self.frames)


@pytest.mark.hosts
@pytest.mark.engines
def test_what_a_cell_sends_to_the_hosts_is_encrypted(ip, hosts) -> None:
    assert current()._client.curve_serverkey, "the controller listens on the bridge without CurveZMQ"
    secret, clear = "rapydli-secret-" + uuid.uuid4().hex, "rapydli-in-clear-" + uuid.uuid4().hex
    capture = _Capture()
    try:
        value, captured = cell(ip, f"text = {secret!r}\nprint(text)\ntext.upper()", "--gather")
        with socket.create_connection((hosts.host("h1").address, 22), timeout=5) as plain:  # the control: a marker
            plain.sendall(clear.encode() + b"\r\n")  # sent in clear to the host's sshd is seen by the capture
            plain.recv(256)
        assert capture.seen(clear.encode()), "the capture does not see what crosses the bridge"
    finally:
        wire = capture.stop()
    assert value == [secret.upper()] * 2 and secret in captured.stdout
    assert secret.encode() not in wire and secret.upper().encode() not in wire, "the cell crossed the bridge in clear"


@pytest.mark.hosts
@pytest.mark.engines
@pytest.mark.parametrize(
    ("options", "within_s", "quoted"),
    [
        ({"mpi_args": ["-no-such-flag"]}, 5, ["unrecognized argument no-such-flag"]),  # mpiexec exits at once
        ({"hosts": ["h1", "h9"]}, 20, ["Could not resolve hostname h9"]),  # ssh cannot reach a host
        # MPI_Init aborts on every host: what each host's MPI said, under the host's name
        (
            {"mpi_args": ["-genv", "UCX_TLS", "nosuchtl"]},
            20,
            ["host h1:", "host h2:", "transport 'nosuchtl' is not available"],
        ),
    ],
    ids=["bad-mpiexec-flag", "unknown-host", "mpi-init-fails"],
)
def test_a_start_that_cannot_succeed_fails_within_seconds_quoting_what_was_said(
    hosts, options, within_s, quoted
) -> None:
    cluster = rd.Cluster(n=2, launcher="ssh", start_timeout=120, **{**hosts.launcher_options(), **options})
    before = {host.name: set(host.pids()) for host in hosts.hosts}  # sshd, and the module's cluster if it runs
    started = time.monotonic()
    with pytest.raises(rd.ClusterError) as failure:
        cluster.start()
    elapsed = time.monotonic() - started
    message = str(failure.value)
    print(f"start failed after {elapsed:.1f} s: {message}")
    assert re.search(
        r"the engines' launcher \(mpiexec\) exited( with status \d+)? after 0 of 2 engines registered; the launcher wrote:",
        message,
    ), message
    assert all(text in message for text in quoted), message
    assert elapsed < within_s, f"the failed start took {elapsed:.1f} s"
    assert cluster.status()["state"] == "failed"
    for host in hosts.hosts:  # nothing of this start is left on the hosts
        deadline = time.monotonic() + 10
        while set(host.pids()) - before[host.name] and time.monotonic() < deadline:
            time.sleep(0.1)
        left = set(host.pids()) - before[host.name]
        assert not left, f"processes left on {host.name}: {[host.commands().get(pid) for pid in left]}"


@pytest.mark.hosts
@pytest.mark.engines
def test_a_host_dying_mid_collective_is_named_then_restart_works(ip, hosts, tmp_path) -> None:
    failure, elapsed = _lose_h2_mid_collective(ip, tmp_path, hosts.host("h2").kill)
    message = str(failure)
    assert message.startswith("rank 1 died: host h2 down"), message
    assert failure.failures.keys() == {1}
    print(f"host death reported {elapsed:.1f} s after the kill")
    assert elapsed <= REPORTED_WITHIN_S, f"host death reported {elapsed:.1f} s after the kill"

    nshosts.revive(hosts, "h2")
    with capture_output():
        status = ip.run_line_magic("rapydli", "restart")
    assert status["state"] == "running" and status["rank_hosts"] == {0: "h1", 1: "h2"}
    ip.user_ns["allreduce_on_host"] = allreduce_on_host
    value, _ = cell(ip, "allreduce_on_host(1 << 10)", "--gather --push allreduce_on_host")
    assert value == [("h1", 2.0), ("h2", 2.0)]


@pytest.mark.hosts
@pytest.mark.engines
def test_a_host_whose_link_goes_down_mid_collective_is_named_then_restart_works(ip, hosts, tmp_path) -> None:
    h2 = hosts.host("h2")
    link = ["ip", "link", "set", h2.veth]
    try:
        failure, elapsed = _lose_h2_mid_collective(ip, tmp_path, lambda: subprocess.run([*link, "down"], check=True))
    finally:
        subprocess.run([*link, "up"], check=True)
    message = str(failure)
    assert message.startswith("rank 1 died: host h2 down"), message
    assert failure.failures.keys() == {1}
    print(f"link loss reported {elapsed:.1f} s after the link went down")
    assert elapsed <= REPORTED_WITHIN_S, f"link loss reported {elapsed:.1f} s after the link went down"

    with capture_output():
        status = ip.run_line_magic("rapydli", "restart")
    assert status["state"] == "running" and status["rank_hosts"] == {0: "h1", 1: "h2"}
    ip.user_ns["allreduce_on_host"] = allreduce_on_host
    value, _ = cell(ip, "allreduce_on_host(1 << 10)", "--gather --push allreduce_on_host")
    assert value == [("h1", 2.0), ("h2", 2.0)]
