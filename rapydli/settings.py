"""The one place that reads RaPyDLI's ``RAPYDLI_*`` environment variables.

:func:`settings` reads the environment each time it is called (a test, a batch item or an
engine may set a variable after import) and validates every value, so a typo such as
``RAPYDLI_COMM_WAIT=spinn`` fails with the variable's name and the allowed values instead
of being ignored.

=============================  ==========================================================
``RAPYDLI_HOME``               where files live (default ``~/.rapydli``): run store,
                               caches, compiled kernels, cluster profiles
``RAPYDLI_STORE``              ``on`` (default) or ``off``: record runs in the run store
``RAPYDLI_HEARTBEAT_TIMEOUT``  seconds after which a run of another host that stopped
                               beating is shown as lost (default 900)
``RAPYDLI_COMM_AUTOTUNE``      ``1`` (default) or ``0``: ``allreduce="auto"`` measures the
                               algorithms once per cluster (``0``: MPI's own until measured)
``RAPYDLI_COMM_WAIT``          ``polite`` (default: a waiting rank yields its core) or ``spin``
``RAPYDLI_BATCH_ITEM``         set by ``rapydli batch`` for a notebook it runs: the item's run id
``RAPYDLI_PARENT_RUN``         set by ``rapydli batch``: runs the notebook creates belong to it
``RAPYDLI_NOTEBOOK_DIR``       set by ``rapydli batch``: the notebook's own directory
``RAPYDLI_STORE_PATH``         the run store file of this process (default ``$RAPYDLI_HOME/runs.db``;
                               a batch item on another host writes its own, merged by the owner)
``RAPYDLI_TRACKERS``           trackers every run of this process is also logged to, comma-separated
                               (``mlflow,tensorboard``; added to ``TrainConfig.trackers``): for batches
``RAPYDLI_TENSORBOARD_DIR``    where the ``tensorboard`` tracker writes event files (default
                               ``$RAPYDLI_HOME/tensorboard``)
=============================  ==========================================================
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from rapydli.errors import ConfigError
from rapydli.registry import tracker_names

HOME = "RAPYDLI_HOME"
STORE = "RAPYDLI_STORE"
HEARTBEAT_TIMEOUT = "RAPYDLI_HEARTBEAT_TIMEOUT"
COMM_AUTOTUNE = "RAPYDLI_COMM_AUTOTUNE"
COMM_WAIT = "RAPYDLI_COMM_WAIT"
BATCH_ITEM = "RAPYDLI_BATCH_ITEM"
PARENT_RUN = "RAPYDLI_PARENT_RUN"
NOTEBOOK_DIR = "RAPYDLI_NOTEBOOK_DIR"
STORE_PATH = "RAPYDLI_STORE_PATH"
TRACKERS = "RAPYDLI_TRACKERS"
TENSORBOARD_DIR = "RAPYDLI_TENSORBOARD_DIR"

_TRUE = {"1", "on", "true", "yes"}
_FALSE = {"0", "off", "false", "no"}


@dataclass(frozen=True)
class Settings:
    """RaPyDLI's settings as read from the environment (see the module docstring)."""

    home: Path
    store: bool
    heartbeat_timeout_s: float
    comm_autotune: bool
    comm_wait: str
    batch_item: str | None
    parent_run: str | None
    notebook_dir: str | None
    store_path: Path | None
    trackers: tuple[str, ...] = ()
    tensorboard_dir: Path | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """Read and validate the ``RAPYDLI_*`` variables of ``environ``."""
        wait = environ.get(COMM_WAIT, "polite").strip().lower() or "polite"
        if wait not in ("polite", "spin"):
            raise ConfigError(f"{COMM_WAIT}={environ[COMM_WAIT]!r} is invalid: 'polite' or 'spin'")
        timeout = environ.get(HEARTBEAT_TIMEOUT, "900")
        try:
            heartbeat = float(timeout)
        except ValueError:
            heartbeat = -1.0
        if not heartbeat > 0:
            raise ConfigError(f"{HEARTBEAT_TIMEOUT}={timeout!r} is invalid: a number of seconds > 0")
        return cls(
            home=Path(environ.get(HOME) or Path.home() / ".rapydli").expanduser(),
            store=_flag(environ, STORE, default=True),
            heartbeat_timeout_s=heartbeat,
            comm_autotune=_flag(environ, COMM_AUTOTUNE, default=True),
            comm_wait=wait,
            batch_item=environ.get(BATCH_ITEM) or None,
            parent_run=environ.get(PARENT_RUN) or None,
            notebook_dir=environ.get(NOTEBOOK_DIR) or None,
            store_path=Path(environ[STORE_PATH]).expanduser() if environ.get(STORE_PATH) else None,
            trackers=tracker_names(environ.get(TRACKERS, ""), TRACKERS),
            tensorboard_dir=Path(environ[TENSORBOARD_DIR]).expanduser() if environ.get(TENSORBOARD_DIR) else None,
        )


def settings() -> Settings:
    """The settings of this process now (the environment is read on every call)."""
    return Settings.from_environ()


@contextmanager
def home_at(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Point ``RAPYDLI_HOME`` at ``path`` for the duration (this process and what it starts), then restore it.

    A benchmark that must start from empty caches uses it; the run store, caches and
    compiled kernels are all under the home.
    """
    previous = os.environ.get(HOME)
    os.environ[HOME] = os.fspath(path)
    try:
        yield settings().home
    finally:
        if previous is None:
            os.environ.pop(HOME, None)
        else:
            os.environ[HOME] = previous


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    text = environ.get(name, "").strip().lower()
    if not text:
        return default
    if text in _TRUE | _FALSE:
        return text in _TRUE
    raise ConfigError(f"{name}={environ[name]!r} is invalid: one of {', '.join(sorted(_TRUE | _FALSE))}")
