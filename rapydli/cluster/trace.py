"""The collective trace: every rank's last communication operations, in a file others can read.

Each engine keeps a small ring buffer of its last :data:`CAPACITY` operations (collectives
of the :class:`~rapydli.comm.Communicator`, the pipeline's sends and receives) in a
memory-mapped file of its own. The rank writes a record when an operation starts and its
end time when it ends; the notebook reads the file at any moment, also while the rank is
blocked inside MPI, without asking the engine anything. Comparing the ranks' last
records tells which collective each rank waits in (:mod:`rapydli.cluster.hang`).

Each record: the operation's sequence number within its group (every rank of a group
numbers its collectives alike, so ``#57`` on one rank and ``#57`` on another should be
the same call), its kind (``allreduce``, ``broadcast``, ``send``, ...), the group (the
world ranks of its communicator), the bytes, the dtype, the peer of a point-to-point
operation, and wall-clock start and end (0 while it runs).

Recording lives in the cluster layer, beside :mod:`~rapydli.cluster.events`, because
both the engines (that write) and the notebook's job polling (that reads) use it; the
communicators above call :func:`begin` and :func:`end`. A process without a trace file
(a plain ``mpiexec`` run) records nothing: :func:`begin` returns at once.

Examples
--------
>>> token = begin("allreduce", "world", 4096, "float32")  # doctest: +SKIP
>>> end(token)  # doctest: +SKIP
"""

from __future__ import annotations

import mmap
import os
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAGIC = b"RDTRACE1"
CAPACITY = 256
_HEADER = struct.Struct("<8sIiQd")  # magic, capacity, rank, count (records begun), last activity (wall time)
_RECORD = struct.Struct("<Q16s24sQ8sidd")  # seq, kind, group, bytes, dtype, peer, start, end
_TAIL_AT = 16  # byte offset of ``count`` and the last activity time in the header
_TAIL = struct.Struct("<Qd")
_ACTIVE_AT = 24  # byte offset of the last activity time
_END_AT = _RECORD.size - 8  # byte offset of ``end`` in a record
_SIZE = _HEADER.size + CAPACITY * _RECORD.size
_TIME = struct.Struct("<d")


@dataclass(frozen=True)
class Record:
    """One traced operation of one rank.

    Attributes
    ----------
    index
        Its place among every operation this rank began (0, 1, ...).
    seq
        Its number within ``group``: the n-th operation of that group on this rank.
    kind, group, dtype
        What it was (``allreduce``, ``broadcast``, ``barrier``, ``reduce_scatter``,
        ``send``, ``recv``), on which group of world ranks, of which element type.
    nbytes, peer
        Bytes it carried; the other rank of a send/receive (-1 for a collective).
    start, end
        Wall-clock seconds; ``end`` is 0.0 while the operation runs.
    """

    index: int
    seq: int
    kind: str
    group: str
    nbytes: int
    dtype: str
    peer: int
    start: float
    end: float

    @property
    def running(self) -> bool:
        """True while the operation has not ended."""
        return self.end == 0.0

    def describe(self) -> str:
        """``allreduce #57 on world, 4 MiB float32`` (and the peer of a send/receive)."""
        peer = f" {'to' if self.kind == 'send' else 'from'} rank {self.peer}" if self.peer >= 0 else ""
        size = f"{_size(self.nbytes)} {self.dtype}".strip()
        return f"{self.kind} #{self.seq} on {self.group}{peer}" + (f", {size}" if size else "")


@dataclass(frozen=True)
class Trace:
    """What a rank's trace file holds now: its last operations, oldest first.

    ``count`` operations were begun in all; ``active`` is the wall time of the last begin
    or end (0.0 before any).
    """

    rank: int
    count: int
    active: float
    records: tuple[Record, ...]

    @property
    def last(self) -> Record | None:
        """The newest record, or None."""
        return self.records[-1] if self.records else None

    @property
    def waiting(self) -> Record | None:
        """The oldest operation still running (the one the rank waits in), or None."""
        return next((r for r in self.records if r.running), None)


class _Recorder:
    """The open trace file of this process and its per-group sequence numbers."""

    def __init__(self, path: Path, rank: int) -> None:
        self.path = path
        with open(path, "w+b") as file:
            file.truncate(_SIZE)
            self.map = mmap.mmap(file.fileno(), _SIZE)
        _HEADER.pack_into(self.map, 0, MAGIC, CAPACITY, rank, 0, 0.0)
        self.count = 0
        self.seqs: dict[str, int] = {}
        self.names: dict[str, bytes] = {}  # kinds, groups, dtypes as stored
        self.lock = threading.Lock()

    def begin(self, kind: str, group: str, nbytes: int, dtype: str, peer: int, channel: str) -> int:
        names = self.names
        kind_b, group_b, dtype_b = (
            names.get(kind) or self._name(kind),
            names.get(group) or self._name(group),
            names.get(dtype) or self._name(dtype),
        )
        now = time.time()
        with self.lock:
            index = self.count
            self.count = index + 1
            seq = self.seqs.get(channel, 0)
            self.seqs[channel] = seq + 1
            _RECORD.pack_into(
                self.map,
                _HEADER.size + (index % CAPACITY) * _RECORD.size,
                seq,
                kind_b,
                group_b,
                nbytes,
                dtype_b,
                peer,
                now,
                0.0,
            )
            _TAIL.pack_into(self.map, _TAIL_AT, index + 1, now)  # after the record: a reader never sees it half-written
        return index

    def _name(self, text: str) -> bytes:
        self.names[text] = encoded = text.encode()[:24]
        return encoded

    def end(self, index: int) -> None:
        now = time.time()
        with self.lock:
            if self.count - index <= CAPACITY:  # not yet overwritten by a newer operation
                _TIME.pack_into(self.map, _HEADER.size + (index % CAPACITY) * _RECORD.size + _END_AT, now)
            _TIME.pack_into(self.map, _ACTIVE_AT, now)


_recorder: list[_Recorder] = []


def open_trace(directory: str | os.PathLike[str], rank: int) -> str:
    """Start recording this process's operations into a file in ``directory``; returns its path.

    Called once per engine at set-up; a second call keeps the file already open.
    """
    if not _recorder:
        import socket

        path = Path(directory) / f"{socket.gethostname()}-{os.getpid()}.trace"
        _recorder.append(_Recorder(path, rank))
    return str(_recorder[0].path)


def begin(kind: str, group: str, nbytes: int = 0, dtype: str = "", peer: int = -1, channel: str = "") -> int:
    """Record that an operation starts; returns the token :func:`end` takes (-1 when not recording).

    Operations are numbered per ``channel`` (default: the group): collectives count per
    group, and a point-to-point operation passes its own channel (:func:`p2p_channel`),
    so the n-th send from rank a to rank b has the number of b's n-th receive from a.
    """
    if not _recorder:
        return -1
    return _recorder[0].begin(kind, group, nbytes, dtype, peer, channel or group)


def p2p_channel(group: str, source: int, dest: int) -> str:
    """The numbering channel of messages from ``source`` to ``dest`` (ranks within ``group``)."""
    return f"{group}:{source}>{dest}"


def end(token: int) -> None:
    """Record that the operation of ``token`` (from :func:`begin`) ended."""
    if token >= 0 and _recorder:
        _recorder[0].end(token)


def new_task() -> None:
    """Number operations from 0 again: each task's n-th collective on a group is ``#n`` on every rank."""
    if _recorder:
        with _recorder[0].lock:
            _recorder[0].seqs.clear()


def recording() -> bool:
    """True when this process records its operations (an engine of a RaPyDLI cluster)."""
    return bool(_recorder)


_labels: dict[tuple[int, int], str] = {}


def group_label(mpi_comm: Any) -> str:
    """A name for ``mpi_comm``'s group that every member computes alike: ``world`` or ``ranks 0,2``."""
    key = (mpi_comm.py2f(), mpi_comm.Get_size())
    label = _labels.get(key)
    if label is None:
        label = _labels[key] = _label(mpi_comm)
    return label


def _label(mpi_comm: Any) -> str:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if mpi_comm.Get_size() == world.Get_size():
        return "world"
    group, world_group = mpi_comm.Get_group(), world.Get_group()
    try:
        ranks = MPI.Group.Translate_ranks(group, list(range(mpi_comm.Get_size())), world_group)
    finally:
        group.Free()
        world_group.Free()
    return "ranks " + ",".join(map(str, ranks))


def read(data: bytes | mmap.mmap) -> Trace:
    """The :class:`Trace` in a trace file's bytes (all of them: :func:`read_file` reads the file)."""
    magic, capacity, rank, count, active = _HEADER.unpack_from(data, 0)
    if magic != MAGIC:
        raise ValueError("not a RaPyDLI trace file")
    records = []
    for index in range(max(0, count - capacity), count):
        seq, kind, group, nbytes, dtype, peer, start, stop = _RECORD.unpack_from(
            data, _HEADER.size + (index % capacity) * _RECORD.size
        )
        records.append(Record(index, seq, _text(kind), _text(group), nbytes, _text(dtype), peer, start, stop))
    return Trace(rank, count, active, tuple(records))


def read_file(path: str | os.PathLike[str]) -> Trace:
    """The trace in the file at ``path`` (read without locking: the rank may be writing it)."""
    return read(Path(path).read_bytes())


def size() -> int:
    """Bytes of one trace file."""
    return _SIZE


def group_ranks(group: str, world_size: int) -> Sequence[int]:
    """The world ranks a :func:`group_label` names."""
    if group == "world":
        return range(world_size)
    return [int(r) for r in group.removeprefix("ranks ").split(",") if r]


def _text(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode(errors="replace")


def _size(nbytes: int) -> str:
    if nbytes <= 0:
        return ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:.3g} {unit}"
    return f"{nbytes} B"
