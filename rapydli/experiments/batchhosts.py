"""Batch items on other hosts, reached over ssh (``rd.batch(..., hosts=["n1", "n2"])``).

Each item runs on a free host (one item per host at a time), in the same working
directory, which must be on a filesystem the hosts share (as home directories on a
cluster are). Its results go to a store file of its own that this process merges into
the run store when the item ends (:mod:`rapydli.experiments.storemerge`), so no two hosts
write one SQLite file. The ssh session is the item's lifeline: when it ends (timeout,
Ctrl-C, this process killed) the item's whole process group on the host is ended too.
"""

from __future__ import annotations

import queue
import shlex
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import IO

from rapydli.errors import ConfigError

#: Environment variables an item on another host receives from this process.
PASSED_PREFIXES = ("RAPYDLI_", "PYTHON", "OMP_", "MKL_", "UCX_", "FI_", "JUPYTER_")
PASSED_NAMES = ("PATH", "VIRTUAL_ENV", "LANG")


class HostPool:
    """Hosts free to take an item; :meth:`host` lends one for the length of a ``with`` block."""

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
    def host(self) -> Iterator[str]:
        name = self._free.get()
        try:
            yield name
        finally:
            self._free.put(name)

    def spawn(self, host: str, args: Sequence[str], *, cwd: str, env: Mapping[str, str], output: IO[str]) -> subprocess.Popen[bytes]:
        """Start ``python args...`` on ``host`` in ``cwd`` with the passed part of ``env``."""
        passed = {k: v for k, v in env.items() if k.startswith(PASSED_PREFIXES) or k in PASSED_NAMES}
        item = shlex.join(["env", *(f"{k}={v}" for k, v in sorted(passed.items())), "setsid", sys.executable, *args])
        # the item runs as its own process group; when ssh's stdin closes (the session ended) it is ended
        # (fd 3: a background job's own stdin is /dev/null)
        script = (
            f"cd {shlex.quote(cwd)} || exit 111; exec 3<&0; {item} & pid=$!; "
            '(cat <&3 > /dev/null; kill -TERM -- -"$pid" 2> /dev/null) > /dev/null 2>&1 & '
            'wait "$pid"'
        )
        return subprocess.Popen(
            [self.ssh_command, "-o", "BatchMode=yes", host, script],
            stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT, start_new_session=True,
        )
