"""Where RaPyDLI keeps its files: ``$RAPYDLI_HOME`` (default ``~/.rapydli``), private to the user.

The run store, checkpoints without a ``checkpoint_dir``, the clusters' connection files
(whose key lets one run code on the engines) and the logs all live under it, so it is
kept ``0700`` as Jupyter keeps its runtime directory: other users of a shared machine
cannot read what is in it. Directories RaPyDLI creates elsewhere for a run's outputs (a
``checkpoint_dir``, a batch's ``--out``) are created ``0700`` too (:func:`private_dir`).
"""

from __future__ import annotations

import os
from pathlib import Path

from rapydli.settings import settings

#: The permissions of a private directory: its owner only.
PRIVATE_DIR = 0o700
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


def subdir(name: str) -> Path:
    """``home() / name``, created if missing (inside the private home)."""
    path = home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
