"""Atomic training checkpoints: everything needed to continue a run exactly.

A checkpoint holds the model, the optimizer, the schedule position, the sampler
position ``(epoch, batch)`` and the RNG states of every rank (torch, numpy, python),
in one file ``<checkpoint_dir>/checkpoint.pt``. Rank 0 writes it to a temporary file in
the same directory, flushes it to disk, then renames it over the old one with
:func:`os.replace`, so a reader sees the old checkpoint or the new one, never half of
one; a failed write removes its temporary file and leaves the old checkpoint in place.

:class:`CheckpointWriter` takes the write off the training step: the step waits only
for a copy of the state in memory, a thread writes it (still atomically), and the next
checkpoint, or the end of the run, waits for the write before it.
"""

from __future__ import annotations

import copy
import logging
import os
import random
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapydli.errors import ConfigError

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 1


def checkpoint_path(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint file inside ``directory``."""
    return Path(directory) / CHECKPOINT_NAME


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and python RNG states."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_atomic(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` with :func:`torch.save` to ``path`` atomically (temp file + fsync + rename).

    Returns the path. If anything fails, the temporary file is removed, the previous
    file at ``path`` (if any) is untouched, and the error propagates.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save({"format": FORMAT_VERSION, **state}, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return target


class CheckpointWriter:
    """Writes checkpoints with :func:`save_atomic` on a background thread, one at a time.

    Attributes
    ----------
    spans
        ``(start, end)`` of every finished write, in :func:`time.perf_counter` seconds: when
        the thread was writing (``rapydli bench trainer`` sorts the steps by them).

    Examples
    --------
    >>> writer = CheckpointWriter()  # doctest: +SKIP
    >>> writer.submit({"model": model.state_dict()}, "run/checkpoint.pt")  # doctest: +SKIP
    >>> writer.wait()  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.spans: list[tuple[float, float]] = []

    def submit(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Copy ``state`` now (tensors cloned) and write the copy in the background.

        Waits for the previous write first, and raises its error if it failed.
        """
        self.wait()
        snapshot = copy.deepcopy(state)

        def write() -> None:
            started = time.perf_counter()
            try:
                save_atomic(snapshot, path)
            except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
                self._error = exc
            self.spans.append((started, time.perf_counter()))

        self._thread = threading.Thread(target=write, name="rapydli-checkpoint", daemon=True)
        self._thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed.

        With ``raise_error=False`` a failed write is logged instead (for a caller that is
        already raising an error of its own).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None and not raise_error:
            log.warning("a checkpoint write failed: %s", self._error)
            self._error = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def remove_partial_writes(directory: str | os.PathLike[str]) -> None:
    """Delete temporary files of writes that never finished (a process killed mid-write)."""
    for partial in Path(directory).glob(".*.pt.*.tmp"):
        partial.unlink(missing_ok=True)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_atomic`."""
    state = torch.load(Path(path), map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT_VERSION:
        raise ConfigError(f"{path} is not a RaPyDLI checkpoint of format {FORMAT_VERSION} (found {state.get('format')!r})")
    return state
