"""A start that fails says why: the engines' launcher process watched while a start waits.

ipyparallel's wait for engines knows nothing of the process that starts them. An
``mpiexec`` that exits at once (a bad flag in ``mpi_args``, a host ssh cannot reach, a
Hydra proxy that finds no interface of the name given) left a local or ssh start waiting
its whole ``start_timeout``, to end with "engines not ready", without a word of what
``mpiexec`` said. :func:`wait_for_engines` also watches that process: the start fails as
soon as it exits, quoting its output (``mpiexec``'s stderr and the engines' log lines,
which ipyparallel writes to one file per engine set). A start that times out quotes the
same output. The ssh launcher prefixes each rank's lines with its host
(:data:`HOST_PATTERN`), so the quote is grouped by host. Batch launchers (Slurm) have
their own watch, :mod:`rapydli.cluster.batchjob`.
"""

from __future__ import annotations

import re
import time
from typing import Any

import psutil

from rapydli.errors import ClusterError

#: Hydra's ``-prepend-pattern`` the ssh launcher passes: each rank's output line starts with its host and rank.
HOST_PATTERN = "[host %h rank %r] "
_PREFIXED = re.compile(r"^\[host (?P<host>\S+) rank \d+\] ")
#: Lines of the launcher's output a failed start quotes: the first few and the last.
HEAD_LINES, TAIL_LINES = 5, 15
#: How often the wait looks at the launcher process and the registered engines.
POLL_S = 0.1


def wait_for_engines(ipp_cluster: Any, client: Any, n: int, timeout: float) -> None:
    """Wait until ``n`` engines have registered with ``client``'s controller.

    Raises
    ------
    ClusterError
        The engines' launcher process exited first (within :data:`POLL_S` of its exit), or
        ``timeout`` seconds passed; the message quotes what the launcher wrote.
    """
    deadline = time.monotonic() + timeout
    while True:
        if len(client.ids) >= n:
            return
        gone = [launcher for launcher in _engine_launchers(ipp_cluster) if _exited(launcher)]
        if gone:
            time.sleep(POLL_S)  # the output of a process that just exited may still be on its way to the file
            if len(client.ids) >= n:  # every engine came up, and mpiexec ended after
                return
            ended = f"the engines' launcher ({_command(gone[0])}) exited{_exit_code(gone[0])}"
            raise ClusterError(f"{ended} after {len(client.ids)} of {n} engines registered{said(ipp_cluster)}")
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"{n - len(client.ids)} of {n} engines not ready in {timeout:g} seconds{said(ipp_cluster)}"
            )
        time.sleep(POLL_S)


def said(ipp_cluster: Any) -> str:
    """What the engines' launchers wrote, as the tail of an error message ('' if nothing).

    The first :data:`HEAD_LINES` and last :data:`TAIL_LINES` lines of each engine set's
    output; lines prefixed with their host (:data:`HOST_PATTERN`) are grouped per host.
    """
    parts = []
    for launcher in _engine_launchers(ipp_cluster):
        lines = _output(launcher).splitlines()
        if not lines:
            continue
        if len(lines) > HEAD_LINES + TAIL_LINES:
            lines = [
                *lines[:HEAD_LINES],
                f"... ({len(lines) - HEAD_LINES - TAIL_LINES} lines left out)",
                *lines[-TAIL_LINES:],
            ]
        parts.append(_by_host(lines))
    if not parts:
        return "; the launcher wrote nothing"
    return "; the launcher wrote:\n" + "\n".join(parts)


def _by_host(lines: list[str]) -> str:
    groups: dict[str, list[str]] = {}
    for line in lines:
        match = _PREFIXED.match(line)
        key = f"host {match['host']}" if match else ""
        groups.setdefault(key, []).append(line[match.end() :] if match else line)
    if list(groups) == [""]:
        return "\n".join(f"  {line}" for line in groups[""])
    return "\n".join(
        ("  " + "\n  ".join(text) if key == "" else f"  {key}:\n" + "\n".join(f"    {line}" for line in text))
        for key, text in groups.items()
    )


def _engine_launchers(ipp_cluster: Any) -> list[Any]:
    return [
        launcher
        for launcher in (getattr(ipp_cluster, "engines", None) or {}).values()
        if getattr(launcher, "process", None) is not None
    ]


def _exited(launcher: Any) -> bool:
    if getattr(launcher, "state", "") == "after":  # ipyparallel saw it end
        return True
    try:
        return bool(launcher.process.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _exit_code(launcher: Any) -> str:
    code = (getattr(launcher, "stop_data", None) or {}).get("exit_code")
    return f" with status {code}" if code is not None else ""


def _command(launcher: Any) -> str:
    args = list(getattr(launcher, "args", None) or [])
    return str(args[0]).rsplit("/", 1)[-1] if args else "mpiexec"


def _output(launcher: Any) -> str:
    """What the launcher's process wrote so far. Once it has ended, ipyparallel reads its file and removes it
    (``get_output(remove=True)``), keeping the text: ``get_output()`` answers from that, or reads the file first."""
    if _exited(launcher):
        return str(launcher.get_output() or "")
    return _read(getattr(launcher, "output_file", "") or "")


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as file:
            return file.read()
    except OSError:
        return ""
