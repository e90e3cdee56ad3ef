"""Where RaPyDLI keeps its files: ``$RAPYDLI_HOME`` (default ``~/.rapydli``), private to the user.

The run store, checkpoints without a ``checkpoint_dir``, the clusters' connection files
(whose key lets one run code on the engines) and the logs all live under it, so it is
kept ``0700`` as Jupyter keeps its runtime directory: other users of a shared machine
cannot read what is in it. Directories RaPyDLI creates elsewhere for a run's outputs (a
``checkpoint_dir``, a batch's ``--out``) are created ``0700`` too (:func:`private_dir`), and so
are its folders in a home others share (:func:`subdir`); the run store is ``0600``
(:func:`private_file`) wherever it is.
"""

from __future__ import annotations

import os
from pathlib import Path

from rapydli.settings import settings

#: The permissions of a private directory and of a private file: their owner's only.
PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600
_private: set[Path] = set()  # homes already made private in this process


def home() -> Path:
    """``$RAPYDLI_HOME`` or ``~/.rapydli``, created private (``0700``) if missing.

    An existing home of this user that others may enter is made ``0700`` once per
    process; one owned by another user (a shared setup) is left as it is.
    """
    path = settings().home
    if path not in _private:
        private_dir(path, tighten=True)
        _private.add(path)
    return path


def private_dir(path: str | os.PathLike[str], tighten: bool = False) -> Path:
    """Directory ``path``, created (with its parents) ``0700`` if missing.

    With ``tighten``, an existing directory of this user that group or others may use
    is made ``0700``; without it, an existing directory is left as the user made it.
    """
    target = Path(path)
    if not target.is_dir():
        target.mkdir(parents=True, exist_ok=True)
        target.chmod(PRIVATE_DIR)  # mkdir's mode is masked by the umask
    elif tighten:
        found = target.stat()
        if found.st_uid == os.getuid() and found.st_mode & 0o077:
            target.chmod(PRIVATE_DIR)
    return target


def private_file(path: str | os.PathLike[str]) -> Path:
    """File ``path``, created empty ``0600`` if missing (its folder by :func:`private_dir`); one of this user that group
    or others may read is made ``0600``. SQLite gives a database's ``-wal`` and ``-shm`` files the database's mode."""
    target = Path(path)
    if not target.parent.is_dir():
        private_dir(target.parent)
    try:
        os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE))
    except FileExistsError:
        found = target.stat()
        if found.st_uid == os.getuid() and found.st_mode & 0o077:
            target.chmod(PRIVATE_FILE)
    return target


def subdir(name: str) -> Path:
    """``home() / name``, created ``0700`` if missing: private even where the home is a folder others share (which
    :func:`home` leaves as its owner made it)."""
    return private_dir(home() / name)
