"""Reading the engines' stack and trace files on hosts that share no file system with the notebook.

``cluster.where()`` and the hang watch read files the engines write on their own hosts. Where
the notebook sees the same file system (a shared home), they read them directly; elsewhere
through ssh (ssh hosts) or ``srun`` into the job (Slurm), one command per host for all of its
files. Here the reader runs in a mount namespace of its own where the files' directory is an
empty tmpfs, so it cannot see what the hosts see, as on a cluster without a shared file
system; the hosts (namespace hosts with sshd, or the local Slurm's nodes) read the real files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

#: The reader, run where ``DIR`` is hidden: reads the spans in argv[2] (JSON) with the reader
#: argv[1] names and prints the bytes back as JSON (latin-1 text).
READER = """\
import json, os, sys
from rapydli.cluster import where
spans = [tuple(s) for s in json.loads(sys.argv[3])]
assert not any(os.path.exists(path) for _, path, _ in spans), "the directory is not hidden"
kind, arg = sys.argv[1], sys.argv[2]
read = where.read_ssh(arg) if kind == "ssh" else where.read_slurm(arg)
print(json.dumps([data.decode("latin-1") for data in read(spans)]))
"""

#: Bytes a dump may hold: every byte value, and lines.
PAYLOAD = bytes(range(256)) + b'\nThread 0x1 (most recent call first):\n  File "x.py", line 3 in f\n'


def _files(folder: Path) -> list[tuple[str, int, bytes]]:
    """Two files per host's worth of spans: (path, offset, the bytes expected from there)."""
    first, second = folder / "stacks-1", folder / "trace-1"
    first.write_bytes(PAYLOAD)
    second.write_bytes(b"0123456789")
    return [(str(first), 0, PAYLOAD), (str(second), 4, b"456789"), (str(folder / "missing"), 0, b"")]


def _read_hidden(
    folder: Path, kind: str, arg: str, spans: list[tuple[str, str, int]], env: dict[str, str]
) -> list[bytes]:
    """Run READER in a private mount namespace where ``folder`` is an empty tmpfs."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a private mount namespace")
    script = f'mount -t tmpfs rd-hidden "{folder}" && exec "{sys.executable}" -c "$0" "$@"'
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, READER, kind, arg, json.dumps(spans)],
                          capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return [text.encode("latin-1") for text in json.loads(done.stdout)]


def _counting(tool: Path, real: str, log: Path) -> Path:
    """A wrapper of ``real`` at ``tool`` that appends a line to ``log`` at each call."""
    tool.write_text(f'#!/bin/sh\necho call >> "{log}"\nexec {real} "$@"\n')
    tool.chmod(0o755)
    return tool


@pytest.mark.hosts
def test_files_on_ssh_hosts_without_a_shared_file_system_are_read_with_one_ssh_per_host(hosts, tmp_path: Path) -> None:
    folder = tmp_path / "on-hosts"
    folder.mkdir()
    expected = _files(folder)
    calls = tmp_path / "calls"
    ssh = _counting(tmp_path / "ssh", hosts.ssh, calls)
    spans = [(host, path, offset) for host in ("h1", "h2") for path, offset, _ in expected]
    got = _read_hidden(folder, "ssh", str(ssh), spans, dict(os.environ))
    assert got == [want for _ in ("h1", "h2") for _, _, want in expected]
    assert len(calls.read_text().splitlines()) == 2  # one ssh per host, for its three files


@pytest.mark.slurm
def test_files_on_slurm_nodes_without_a_shared_file_system_are_read_through_srun(local_slurm, tmp_path: Path) -> None:
    folder = tmp_path / "on-nodes"
    folder.mkdir()
    folder.chmod(0o755)
    tmp_path.chmod(0o755)  # slurmd runs the step as this user; the path must be reachable
    expected = _files(folder)
    job = (
        local_slurm.run("sbatch", "--parsable", "-N1", "-n1", f"--output={tmp_path / 'job.out'}", "--wrap", "sleep 300")
        .stdout.strip()
        .split(";")[0]
    )
    try:
        deadline = time.monotonic() + 60
        node = ""
        while time.monotonic() < deadline:
            state, node = (local_slurm.run("squeue", "-h", "-j", job, "-o", "%T %N").stdout.split() + ["", ""])[:2]
            if state == "RUNNING":
                break
            time.sleep(0.2)
        assert node, f"job {job} never ran"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        calls = tmp_path / "calls"
        _counting(bin_dir / "srun", shutil.which("srun") or "srun", calls)
        env = {**os.environ, **local_slurm.environ(), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
        got = _read_hidden(folder, "slurm", job, [(node, path, offset) for path, offset, _ in expected], env)
        assert got == [want for _, _, want in expected]
        assert len(calls.read_text().splitlines()) == 1  # one srun for the node's three files
    finally:
        local_slurm.run("scancel", job, check=False)
