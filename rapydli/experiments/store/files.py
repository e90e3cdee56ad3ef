"""The filesystem under the run store, and the SQLite journal mode that is safe on it.

SQLite's WAL mode keeps its index in shared memory beside the file; processes on
different hosts cannot share it, so WAL over NFS, Lustre, GPFS and the like corrupts or
loses writes. On such a filesystem the store uses the rollback journal instead (one
writer at a time, through the filesystem's locks), and work that runs on other hosts
writes its own store file that the owner merges (:mod:`rapydli.experiments.store.merge`),
so only one host writes the shared file. Clusters' home directories are usually such
filesystems: setting ``RAPYDLI_HOME`` to local disk keeps WAL's concurrency.
"""

from __future__ import annotations

import os
from pathlib import Path

#: Filesystem types (as in ``/proc/mounts``) on which SQLite's WAL mode is unsafe.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "cifs", "smb3", "smbfs", "beegfs", "ceph", "glusterfs",
    "fuse.glusterfs", "fuse.sshfs", "fuse.beegfs", "fuse.cephfs", "panfs", "pvfs2", "orangefs",
    "afs", "9p", "virtiofs", "wekafs", "fuse.s3fs", "fuse.rclone",
})  # fmt: skip


def _unescape(field: str) -> str:
    """A ``/proc/mounts`` field with its octal escapes (``\\040`` for a space) decoded."""
    return field.encode().decode("unicode_escape") if "\\" in field else field


def filesystem_type(path: str | os.PathLike[str], mounts: str = "/proc/mounts") -> str:
    """Type of the filesystem holding ``path`` (which need not exist yet), e.g. ``ext4``, ``nfs4``.

    Read from ``/proc/mounts`` (the longest mount point containing the path); ``unknown``
    where that file does not exist (not Linux).
    """
    target = Path(path).resolve()  # a path not yet created lies on the mount holding its parents
    try:
        lines = Path(mounts).read_text().splitlines()
    except OSError:
        return "unknown"
    best, kind = "", "unknown"
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = str(target) == point or str(target).startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):  # a later mount on the same point hides earlier ones
            best, kind = point, fields[2]
    return kind


def is_network(kind: str) -> bool:
    """True for a network or cluster filesystem type (``nfs4``, ``lustre``, ``fuse.sshfs``...)."""
    return kind in NETWORK_FILESYSTEMS or kind.startswith("nfs")


def journal_mode(directory: str | os.PathLike[str]) -> tuple[str, str]:
    """``(journal mode, filesystem type)`` for a store in ``directory``: WAL on local disk, DELETE on a network one."""
    kind = filesystem_type(directory)
    return ("DELETE" if is_network(kind) else "WAL"), kind
