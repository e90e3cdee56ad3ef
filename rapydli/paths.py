"""Where RaPyDLI keeps its files: ``$RAPYDLI_HOME`` (default ``~/.rapydli``)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """``$RAPYDLI_HOME`` or ``~/.rapydli`` (not created here)."""
    return Path(os.environ.get("RAPYDLI_HOME") or Path.home() / ".rapydli").expanduser()


def subdir(name: str) -> Path:
    """``home() / name``, created if missing."""
    path = home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
