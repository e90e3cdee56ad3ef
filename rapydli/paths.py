"""Where RaPyDLI keeps its files: ``$RAPYDLI_HOME`` (default ``~/.rapydli``)."""

from __future__ import annotations

from pathlib import Path

from rapydli.settings import settings


def home() -> Path:
    """``$RAPYDLI_HOME`` or ``~/.rapydli`` (not created here)."""
    return settings().home


def subdir(name: str) -> Path:
    """``home() / name``, created if missing."""
    path = home() / name
    path.mkdir(parents=True, exist_ok=True)
    return path
