"""Where and with what a run ran: git commit, library versions.

Read without starting processes or importing heavy libraries: the git commit comes from
the ``.git`` files, versions from package metadata (or the already-imported module).
"""

from __future__ import annotations

import os
import platform
import sys
from importlib import metadata
from pathlib import Path

#: What :func:`git_commit` records for a run started outside any git checkout.
NOT_A_REPOSITORY = "not a git repository"


def git_commit(path: str | os.PathLike[str] | None = None) -> str | None:
    """Commit of the git checkout containing ``path`` (default cwd), read from ``.git`` files.

    :data:`NOT_A_REPOSITORY` when no folder from ``path`` up holds a ``.git``; ``None`` when
    the checkout's ``HEAD`` cannot be read or its branch has no commit yet.
    """
    here = Path(path or os.getcwd()).resolve()
    for folder in (here, *here.parents):
        dotgit = folder / ".git"
        if dotgit.is_file():  # worktree or submodule: "gitdir: <path>"
            text = dotgit.read_text().strip()
            if not text.startswith("gitdir:"):
                return None
            gitdir = (folder / text.split(":", 1)[1].strip()).resolve()
        elif dotgit.is_dir():
            gitdir = dotgit
        else:
            continue
        return _read_head(gitdir)
    return NOT_A_REPOSITORY


def _read_head(gitdir: Path) -> str | None:
    try:
        head = (gitdir / "HEAD").read_text().strip()
    except OSError:
        return None
    if not head.startswith("ref:"):
        return head or None
    ref = head.split(":", 1)[1].strip()
    common = gitdir
    commondir = gitdir / "commondir"
    if commondir.is_file():
        common = (gitdir / commondir.read_text().strip()).resolve()
    for base in (gitdir, common):
        ref_file = base / ref
        if ref_file.is_file():
            return ref_file.read_text().strip() or None
    packed = common / "packed-refs"
    if packed.is_file():
        for line in packed.read_text().splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == ref:
                return parts[0]
    return None  # a branch without commits yet


def versions() -> dict[str, str | None]:
    """Versions of python, torch, mpi4py, the MPI library and rapydli (without importing torch/MPI)."""

    def dist(name: str) -> str | None:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    from rapydli.version import __version__

    mpi_library = None
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:  # only when this process already initialised MPI
        mpi_library = mpi.Get_library_version().strip().splitlines()[0]
    elif dist("mpich"):
        mpi_library = f"MPICH {dist('mpich')} (wheel)"
    torch = sys.modules.get("torch")
    return {
        "python": platform.python_version(),
        "torch": getattr(torch, "__version__", None) or dist("torch"),
        "mpi4py": dist("mpi4py"),
        "mpi": mpi_library,
        "rapydli": __version__,
    }
