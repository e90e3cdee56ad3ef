"""Where every rank is: the Python stack of each thread of each engine, asked from outside it.

An engine blocked in MPI, in C code, or busy in a long cell cannot answer a request, so
the stacks are not asked of the engine: at set-up each engine registers
:mod:`faulthandler` on :data:`WHERE_SIGNAL` with a file of its own (:func:`install`), and
the notebook sends the signal to the engine process and reads what the signal handler
wrote (:func:`collect`). faulthandler writes from the C signal handler, without waiting
for the interpreter, so a rank inside ``MPI_Barrier`` answers as fast as an idle one.

:class:`Where` groups the ranks whose task threads stand on the same line::

    ranks 0, 2-3: comm.Barrier()  <module> (<distributed cell>:4)
    rank 1: time.sleep(30)  load (data.py:12) <- <module> (<distributed cell>:3)
"""

from __future__ import annotations

import faulthandler
import linecache
import os
import re
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rapydli.cluster import trace

WHERE_SIGNAL = signal.SIGUSR2
WITHIN_S = 3.0  # how long collect() waits for the ranks' dumps
_files: list[IO[str]] = []  # this engine's open dump file (kept open: faulthandler writes to its descriptor)

#: Frames of the machinery around a task (the engine's event loop, ipyparallel, IPython):
#: left out of what is shown, so a stack begins at the user's task.
_MACHINERY = (
    "/ipyparallel/", "/ipykernel/", "/IPython/", "/zmq/", "/tornado/", "/asyncio/", "/traitlets/",
    "/jupyter_client/", "/threading.py", "/selectors.py", "/concurrent/futures/", "/queue.py", "/runpy.py",
    "rapydli/cluster/engine.py", "/psutil/",
)  # fmt: skip
_TASK = re.compile(r"rapydli/cluster/engine\.py$")
_THREAD = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def install(directory: str | os.PathLike[str], rank: int) -> dict[str, str]:
    """Register the stack dump on :data:`WHERE_SIGNAL` and open the rank's trace (engine side).

    Returns the files the notebook reads: ``{"stacks_file": ..., "trace_file": ...}``.
    """
    import socket

    if not _files:
        path = Path(directory) / f"{socket.gethostname()}-{os.getpid()}.stacks"
        _files.append(open(path, "a"))  # noqa: SIM115 - open for the life of the engine
        faulthandler.register(WHERE_SIGNAL, file=_files[0], all_threads=True, chain=False)
    return {"stacks_file": _files[0].name, "trace_file": trace.open_trace(directory, rank)}


@dataclass(frozen=True)
class Frame:
    """One Python frame: file, line number, function."""

    file: str
    line: int
    function: str

    def where(self) -> str:
        """``function (file:line)`` with the file shortened."""
        return f"{self.function} ({_short(self.file)}:{self.line})"


@dataclass(frozen=True)
class ThreadStack:
    """One thread's stack, innermost frame first; ``task`` for the thread running the rank's task."""

    ident: str
    frames: tuple[Frame, ...]
    task: bool

    def shown(self) -> tuple[Frame, ...]:
        """The frames worth showing: those of the task (innermost first), the machinery around it left out."""
        shown = []
        for frame in self.frames:
            if _TASK.search(frame.file) and frame.function in ("run_task", "run_cell"):
                break  # the task's own frames end here; the engine's follow
            if not any(m in frame.file for m in _MACHINERY):
                shown.append(frame)
        return tuple(shown)


@dataclass
class RankStacks:
    """What one rank answered: its threads, or why it did not."""

    rank: int
    host: str
    threads: list[ThreadStack] = field(default_factory=list)
    error: str = ""

    @property
    def task(self) -> ThreadStack | None:
        """The thread running the rank's task (None when the engine is idle or did not answer)."""
        return next((t for t in self.threads if t.task), None)


@dataclass
class Where:
    """Every asked rank's stacks, and its collective trace when it has one.

    ``str(where)`` (also what the notebook shows) groups the ranks whose task threads
    stand on the same line; :meth:`text` with ``all_threads=True`` lists every thread.
    """

    ranks: dict[int, RankStacks]
    traces: dict[int, trace.Trace] = field(default_factory=dict)
    sources: dict[str, list[str]] = field(default_factory=dict)

    def text(self, all_threads: bool = False) -> str:
        """The grouped summary; ``all_threads`` adds each rank's other threads."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for rank, stacks in sorted(self.ranks.items()):
            groups.setdefault(self._signature(stacks), []).append(rank)
        lines = []
        for ranks in groups.values():
            stacks = self.ranks[ranks[0]]
            lines.append(f"{format_ranks(ranks)}: {self._describe(stacks)}")
            waiting = {r: self.traces[r].waiting for r in ranks if r in self.traces}
            waits = {w.describe() for w in waiting.values() if w is not None}
            if len(waits) == 1:
                lines.append(f"    waiting in {waits.pop()}")
        if all_threads:
            for rank, stacks in sorted(self.ranks.items()):
                for thread in stacks.threads:
                    if not thread.task:
                        chain = " <- ".join(f.where() for f in thread.frames[:8]) or "(no Python frame)"
                        lines.append(f"  rank {rank} thread {thread.ident}: {chain}")
        return "\n".join(lines)

    def describe(self, rank: int) -> str:
        """Where ``rank``'s task stands: its source line and call chain (as in :meth:`text`)."""
        stacks = self.ranks.get(rank)
        return self._describe(stacks) if stacks is not None else "not asked"

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:
        printer.text(self.text())

    def _signature(self, stacks: RankStacks) -> tuple[Any, ...]:
        if stacks.error:
            return ("error", stacks.error)
        task = stacks.task
        return ("task", task.shown()) if task is not None else ("idle",)

    def _describe(self, stacks: RankStacks) -> str:
        if stacks.error:
            return stacks.error
        task = stacks.task
        if task is None:
            return "idle (no task running)"
        frames = task.shown()
        if not frames:
            return "in the engine, outside the task"
        # library frames by their public names, innermost first, down to the user's frame and its line
        user = next((f for f in frames if not _library(f.file)), frames[-1])
        names: list[str] = []
        for frame in frames[: frames.index(user)]:
            if not frame.function.startswith(("_", "<")) and (not names or names[-1] != frame.function):
                names.append(frame.function)
        code = self._source(user)
        chain = f"in {' <- '.join(names)} <- " if names else ""
        return f"{chain}{user.where()}{': ' + code if code else ''}"

    def _source(self, frame: Frame) -> str:
        lines = self.sources.get(frame.file)
        if lines is not None:
            return lines[frame.line - 1].strip() if 0 < frame.line <= len(lines) else ""
        return linecache.getline(frame.file, frame.line).strip()


def parse(text: str) -> list[ThreadStack]:
    """The threads of one faulthandler dump (``all_threads=True``), innermost frame first."""
    threads: list[ThreadStack] = []
    ident, frames = "", list[Frame]()

    def close() -> None:
        if ident:
            task = any(_TASK.search(f.file) and f.function in ("run_task", "run_cell") for f in frames)
            threads.append(ThreadStack(ident, tuple(frames), task))

    for line in text.splitlines():
        header = _THREAD.match(line)
        if header:
            close()
            ident, frames = header.group(2), []
            continue
        frame = _FRAME.match(line)
        if frame and ident:
            frames.append(Frame(frame.group(1), int(frame.group(2)), frame.group(3)))
    close()
    return threads


#: Where a file lies and what of it to read: ``(host, path, offset)``.
FileSpan = tuple[str, str, int]
#: Reads many files' bytes from their offsets at once (one answer per span, in order; ``b""`` for a
#: file that is not there). A reader for other hosts asks each host once per call.
Reader = Callable[[Sequence[FileSpan]], list[bytes]]


def collect(
    engines: dict[int, dict[str, Any]],
    send: Callable[[Sequence[int]], None],
    read: Reader,
    within: float = WITHIN_S,
) -> dict[int, RankStacks]:
    """Signal the ranks of ``engines`` (rank -> its set-up info) and read their dumps back.

    ``send(ranks)`` delivers :data:`WHERE_SIGNAL` to those ranks' engine processes;
    ``read(spans)`` returns the files' bytes (each look reads every rank still awaited in one
    call: one ssh per host, not one per rank). A rank whose dump is not complete within
    ``within`` seconds is reported as not answering.
    """
    ranks = list(engines)
    lengths = read([(engines[r]["host"], engines[r]["stacks_file"], 0) for r in ranks])
    offsets = {rank: len(data) for rank, data in zip(ranks, lengths)}
    send(sorted(engines))
    deadline = time.monotonic() + within
    seen: dict[int, bytes] = {}
    done: dict[int, RankStacks] = {}
    while len(done) < len(engines) and time.monotonic() < deadline:
        time.sleep(0.02)
        waiting = [rank for rank in ranks if rank not in done]
        for rank, data in zip(
            waiting, read([(engines[r]["host"], engines[r]["stacks_file"], offsets[r]) for r in waiting])
        ):
            if data and data.endswith(b"\n") and data == seen.get(rank):  # unchanged since the last look: complete
                done[rank] = RankStacks(rank, engines[rank]["host"], parse(data.decode(errors="replace")))
            seen[rank] = data
    for rank, info in engines.items():
        if rank not in done:
            done[rank] = RankStacks(
                rank, info["host"], error=f"no answer within {within:g} s (host {info['host']}, pid {info['pid']})"
            )
    return dict(sorted(done.items()))


def _read_here(path: str, offset: int) -> bytes:
    try:
        with open(path, "rb") as file:
            file.seek(offset)
            return file.read()
    except FileNotFoundError:
        return b""


def read_local(spans: Sequence[FileSpan]) -> list[bytes]:
    """A :data:`Reader` for files on this machine (or a file system it shares with the hosts)."""
    return [_read_here(path, offset) for _, path, offset in spans]


def read_remote(run_on: Callable[[str], list[str]]) -> Reader:
    """A :data:`Reader` for files on other hosts: ``run_on(host)`` is the command line that runs a shell
    command on that host (ssh, or Slurm's ``srun`` into the job's allocation).

    A file that is also here (a file system the hosts share, as a home directory often is) is read
    here. The others are read with one command per host per call: ``tail -c`` of each file, base64
    on its own line, so any bytes come back intact and in order.
    """
    import base64
    import shlex
    import socket
    import subprocess

    local = socket.gethostname()

    def reader(spans: Sequence[FileSpan]) -> list[bytes]:
        found: list[bytes] = [b""] * len(spans)
        by_host: dict[str, list[int]] = {}
        for i, (host, path, offset) in enumerate(spans):
            if host == local or os.path.exists(
                path
            ):  # the name holds the host and pid: a file here is the host's (shared file system)
                found[i] = _read_here(path, offset)
            else:
                by_host.setdefault(host, []).append(i)
        for host, indices in by_host.items():
            script = "; ".join(
                f"tail -c +{spans[i][2] + 1} {shlex.quote(spans[i][1])} 2>/dev/null | base64 | tr -d '\\n'; echo"
                for i in indices
            )
            try:
                done = subprocess.run([*run_on(host), script], capture_output=True, timeout=2 * WITHIN_S, check=False)  # noqa: S603
            except subprocess.TimeoutExpired:
                continue  # the host answers too slowly: its ranks are reported as not answering
            lines = done.stdout.decode(errors="replace").splitlines() if done.returncode == 0 else []
            for i, line in zip(indices, lines):
                found[i] = base64.b64decode(line.strip()) if line.strip() else b""
        return found

    return reader


def read_ssh(ssh_command: str) -> Reader:
    """A :data:`Reader` through ``ssh_command`` (:func:`read_remote`)."""
    import shlex

    return read_remote(lambda host: [*shlex.split(ssh_command), host])


def read_slurm(job_id: str) -> Reader:
    """A :data:`Reader` through Slurm (:func:`read_remote`): ``srun`` a step into job ``job_id`` on the
    node (``--overlap``: beside the engines, taking none of their CPUs)."""
    return read_remote(
        lambda host: [
            "srun",
            f"--jobid={job_id}",
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            f"--nodelist={host}",
            "--quiet",
            "sh",
            "-c",
        ]
    )


def _library(path: str) -> bool:
    """True for a file of RaPyDLI, an installed package or Python itself (not the user's code)."""
    return any(m in path for m in ("/rapydli/", "/site-packages/", "/dist-packages/", "/lib/python3", "<frozen"))


def _short(path: str) -> str:
    """``rapydli/comm/x.py`` for a file of a package, the name alone for other long paths."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.split(marker, 1)[1]
    if "/rapydli/" in path:
        return "rapydli/" + path.rsplit("/rapydli/", 1)[1]
    return path if path.startswith("<") else os.path.basename(path)


def format_ranks(ranks: Iterable[int]) -> str:
    """``rank 3`` or ``ranks 0-2, 5``."""
    ordered = sorted(ranks)
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][-1] + 1:
            runs[-1].append(rank)
        else:
            runs.append([rank])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"{'ranks' if len(ordered) > 1 else 'rank'} {text}"


def where_of_record(record: dict[str, Any], within: float = WITHIN_S) -> Where:
    """:class:`Where` of a detached cluster from its record alone (``rapydli cluster start``, the panel's).

    No client is connected, so nothing waits on the engines: the ones on this machine get
    the signal straight away and their dumps are read here. A rank on another host cannot be
    signalled without the cluster's client, and says so (``cluster.where()`` in the
    notebook that holds the cluster asks it through the engines' nannies).
    """
    import socket

    local = socket.gethostname()
    engines = {int(rank): info for rank, info in record.get("engines", {}).items() if "stacks_file" in info}
    here = {rank: info for rank, info in engines.items() if info.get("host") == local}

    def send(ranks: Sequence[int]) -> None:
        for rank in ranks:
            try:
                os.kill(here[rank]["pid"], WHERE_SIGNAL)
            except ProcessLookupError:
                pass

    stacks = collect(here, send, read_local, within) if here else {}
    for rank, info in engines.items():
        if rank not in here:
            stacks[rank] = RankStacks(
                rank,
                info.get("host", "?"),
                error=f"on host {info.get('host')}: ask from the notebook "
                "that attached the cluster (cluster.where(), %rapydli where)",
            )
    return Where(dict(sorted(stacks.items())))
