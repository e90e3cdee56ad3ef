"""Which filesystem holds the run store, and the journal mode used there (real mounts)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from rapydli.errors import RapydliWarning
from rapydli.experiments.store import files as storefs
from rapydli.experiments.store.runstore import RunStore

MOUNTS = """\
sysfs /sys sysfs rw 0 0
/dev/vda1 / ext4 rw 0 0
server:/export/home /home nfs4 rw,vers=4.2 0 0
10.0.0.1@tcp:/scratch /scratch lustre rw 0 0
/dev/vdb1 /scratch/local\\040disk xfs rw 0 0
"""


def test_type_is_the_longest_mount_point_holding_the_path(tmp_path: Path) -> None:
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    found = {
        p: storefs.filesystem_type(p, mounts=str(mounts))
        for p in ("/home/ann/.rapydli", "/scratch/run", "/scratch/local disk/x", "/homework", "/")
    }
    assert found == {
        "/home/ann/.rapydli": "nfs4",
        "/scratch/run": "lustre",
        "/scratch/local disk/x": "xfs",
        "/homework": "ext4",
        "/": "ext4",
    }
    assert [storefs.is_network(k) for k in ("nfs4", "lustre", "gpfs", "fuse.sshfs", "ext4", "tmpfs", "xfs")] == [
        True,
        True,
        True,
        True,
        False,
        False,
        False,
    ]


def _mount(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        pytest.skip(f"{' '.join(argv[:3])} is not possible here: {result.stderr.strip()}")


def test_a_local_mount_keeps_wal(tmp_path: Path) -> None:
    point = tmp_path / "tmpfs"
    point.mkdir()
    _mount("mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(point))
    try:
        assert storefs.filesystem_type(point / "home" / "runs.db") == "tmpfs"
        store = RunStore(point / "home" / "runs.db")
        assert (store.journal_mode, store.filesystem) == ("WAL", "tmpfs")
        assert store._read("PRAGMA journal_mode")[0][0] == "wal"
        store.close()
    finally:
        subprocess.run(["umount", str(point)], check=True)


@pytest.mark.hosts
def test_a_store_on_a_network_filesystem_drops_wal(hosts, tmp_path: Path) -> None:
    """A real network filesystem: sshfs from host h1 (NFS itself cannot be mounted here)."""
    if not shutil.which("sshfs"):
        pytest.skip("sshfs is not installed (apt-get install sshfs)")
    exported = tmp_path / "exported"
    exported.mkdir()
    point = tmp_path / "mnt"
    point.mkdir()
    _mount("sshfs", "-F", str(hosts.directory / "ssh_config"), f"h1:{exported}", str(point))
    try:
        assert storefs.filesystem_type(point) == "fuse.sshfs"
        with pytest.warns(RapydliWarning, match=r"network filesystem \(fuse.sshfs\).*set RAPYDLI_HOME to local disk"):
            store = RunStore(point / "runs.db")
        assert store.journal_mode == "DELETE" and store._read("PRAGMA journal_mode")[0][0] == "delete"
        run_id = store.create_run("train", "over-sshfs", {})
        store.log_metrics(run_id, [(1, "loss", 0.5)])
        store.finish_run(run_id)
        store.close()
        assert (exported / "runs.db").stat().st_size > 0 and not (exported / "runs.db-wal").exists()
    finally:
        for _ in range(50):  # the unmount waits for sshfs to let go of the file
            if subprocess.run(["umount", str(point)], capture_output=True, check=False).returncode == 0:
                break
            time.sleep(0.1)
