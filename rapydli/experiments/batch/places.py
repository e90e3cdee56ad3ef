"""Where the items of a batch run: the places of a launcher that declares them (``rd.batch(..., launcher=...)``).

A launcher runs batch items when its :class:`~rapydli.cluster.launchers.LauncherSpec` names
its places (``items``: a factory here or elsewhere, ``factory(options) -> Places``):

=========  ==========================================================================
``local``  a process of its own on this machine (the default)
``ssh``    a process on another host, reached over ssh, one item per host at a time
           (options ``hosts``, ``ssh_command``; :mod:`rapydli.experiments.batch.hosts`)
``slurm``  a Slurm job of its own, one task (options: the ``slurm`` launcher's
           ``partition``, ``account``, ``qos``, ``timelimit``, ``constraint``,
           ``cpus_per_task``, ``gpus_per_node``, ``sbatch``, ``setup``;
           :mod:`rapydli.cluster.slurmprogram`)
=========  ==========================================================================

The batch's ``parallel`` bounds the items at once everywhere: with ``slurm``, the jobs of
the batch in the queue (pending or running). Items that run elsewhere (``remote``) record
into a store file of their own that the batch merges into the run store when they end
(:mod:`rapydli.experiments.store.merge`), so no two hosts write one SQLite file; their
output folder must be on a filesystem this machine shares with them (as home directories
on clusters are).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

from rapydli.cluster.launchers import LAUNCHERS, get_launcher
from rapydli.cluster.processes import Spawned, spawn_python
from rapydli.cluster.slurmprogram import check_item_options, submit_python
from rapydli.errors import ConfigError
from rapydli.experiments.batch.hosts import HostPool


class ItemProcess(Protocol):
    """A running item: :class:`~rapydli.cluster.processes.Spawned` or
    :class:`~rapydli.cluster.slurmprogram.SlurmProgram`."""

    def wait(self, timeout: float | None = None) -> int:
        """Its exit status once it ended; :class:`subprocess.TimeoutExpired` after ``timeout`` s running."""
        ...

    def kill(self) -> None:
        """End it and everything it started; return once it is gone."""
        ...

    def exit_text(self) -> str:
        """How it ended, for an item that left no result."""
        ...


class Places(Protocol):
    """Where items run: a slot to run in (a host, or None), and how to start an item there."""

    remote: bool  # items record into a store file of their own (merged when they end)

    def slot(self) -> AbstractContextManager[str | None]:
        """Lend a place for the length of a ``with`` block (blocks until one is free)."""
        ...

    def start(
        self,
        slot: str | None,
        args: Sequence[str],
        *,
        name: str,
        cwd: Path,
        env: Mapping[str, str],
        log: Path,
        timeout: float | None,
    ) -> ItemProcess:
        """Start ``python args...`` in ``slot`` with its output in ``log``."""
        ...


class LocalPlaces:
    """Items as processes of this machine, each in a session of its own."""

    remote = False

    def __init__(self, options: Mapping[str, Any]) -> None:
        if options:
            raise ConfigError(f"launcher 'local' takes no options; got {', '.join(sorted(options))}")

    @contextmanager
    def slot(self) -> Iterator[str | None]:
        yield None

    def start(
        self,
        slot: str | None,
        args: Sequence[str],
        *,
        name: str,
        cwd: Path,
        env: Mapping[str, str],
        log: Path,
        timeout: float | None,
    ) -> Spawned:
        with log.open("w") as output:  # the child keeps its own copy of the descriptor
            return Spawned(spawn_python(args, cwd=cwd, env=env, output=output))


class SlurmPlaces:
    """Items as Slurm jobs of one task each (:func:`rapydli.cluster.slurmprogram.submit_python`).

    A job's time limit is the batch's ``timeout`` (rounded up to minutes, plus one) unless
    ``timelimit`` is given, so an item ends even when the batch that submitted it died.
    """

    remote = True

    def __init__(self, options: Mapping[str, Any]) -> None:
        self.options = check_item_options(options)

    @contextmanager
    def slot(self) -> Iterator[str | None]:
        yield None

    def start(
        self,
        slot: str | None,
        args: Sequence[str],
        *,
        name: str,
        cwd: Path,
        env: Mapping[str, str],
        log: Path,
        timeout: float | None,
    ) -> ItemProcess:
        return submit_python(
            args, name=f"rapydli-batch-{name}", cwd=cwd, env=env, output=log, options=self.options, time_limit_s=timeout
        )


def HostPlaces(options: Mapping[str, Any]) -> HostPool:  # noqa: N802 - a factory of places, named like the other places
    """Items on the ``hosts`` given, reached with ``ssh_command``, one at a time per host (:class:`HostPool`)."""
    unknown = sorted(set(options) - {"hosts", "ssh_command"})
    if unknown or "hosts" not in options:
        raise ConfigError(
            f"launcher 'ssh' of a batch takes hosts (required) and ssh_command; got {', '.join(sorted(options)) or 'none'}"
        )
    hosts = options["hosts"]
    return HostPool([hosts] if isinstance(hosts, str) else list(hosts), str(options.get("ssh_command", "ssh")))


def places(launcher: str, options: Mapping[str, Any] | None = None) -> Places:
    """The places of ``launcher`` with ``options``, checked before any item runs.

    Raises
    ------
    ConfigError
        An unknown launcher or option, or a bad option value (naming what is allowed).
    """
    able = [name for name in LAUNCHERS if get_launcher(name).items]
    if launcher not in able:
        raise ConfigError(f"a batch cannot run on launcher {launcher!r}: allowed are {', '.join(able)}")
    module, _, factory = str(get_launcher(launcher).items).partition(":")
    made: Places = getattr(importlib.import_module(module), factory)(dict(options or {}))
    return made
