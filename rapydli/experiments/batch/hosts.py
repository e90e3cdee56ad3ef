"""Batch items on other hosts, reached over ssh (``rd.batch(..., hosts=["n1", "n2"])``).

Each item runs on a free host (one item per host at a time), in the same working
directory, which must be on a filesystem the hosts share (as home directories on a
cluster are). Its results go to a store file of its own that this process merges into
the run store when the item ends (:mod:`rapydli.experiments.store.merge`), so no two hosts
write one SQLite file. The ssh session is the item's lifeline: when it ends (timeout,
Ctrl-C, this process killed) the item's whole process group on the host is ended too
(:func:`rapydli.cluster.sshhosts.spawn_python`).
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rapydli.cluster.processes import Spawned
from rapydli.cluster.sshhosts import spawn_python
from rapydli.errors import ConfigError


class HostPool:
    """Hosts free to take an item; :meth:`slot` lends one for the length of a ``with`` block."""

    remote = True  # items record into a store file of their own

    def __init__(self, hosts: Sequence[str], ssh_command: str = "ssh") -> None:
        names = [h for item in hosts for h in str(item).split(",") if h]
        if not names:
            raise ConfigError("hosts names no host: give host names, e.g. hosts=['node1', 'node2']")
        self.hosts = names
        self.ssh_command = ssh_command
        self._free: queue.Queue[str] = queue.Queue()
        for name in names:
            self._free.put(name)

    @contextmanager
    def slot(self) -> Iterator[str | None]:
        name = self._free.get()
        try:
            yield name
        finally:
            self._free.put(name)

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
        """Start ``python args...`` on host ``slot`` in ``cwd`` (see :func:`rapydli.cluster.sshhosts.spawn_python`)."""
        if slot is None:
            raise ValueError("an item on hosts needs the host that slot() lent")
        with log.open("w") as output:
            return Spawned(spawn_python(slot, args, ssh_command=self.ssh_command, cwd=str(cwd), env=env, output=output))
