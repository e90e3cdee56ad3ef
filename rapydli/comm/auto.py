"""``auto``: per message size, the algorithm that measured fastest on this cluster.

The measurement runs once per cluster (all ranks together: ``mpi`` against ``ring``, and
``shm`` when every rank shares one node, on float32 messages from 4 B up to ``max_bytes``,
interleaved, the slowest rank's median per size; another algorithm replaces ``mpi`` only
when more than 10 % faster, so noise does not flip sizes where they tie) and is cached as JSON in ``$RAPYDLI_HOME/comm/`` under a key made of the world
size, the sorted host names and the MPI library, so a new cluster shape or MPI measures
afresh. A message size between two measured sizes takes the nearer one (log scale).

Before a measurement exists (or with ``RAPYDLI_COMM_AUTOTUNE=0``) the fallback is MPI's
own ``Allreduce``, the vendor-tuned choice. ``float16``/``bfloat16`` go to ``ring`` where
the table says ``mpi``: MPI has no datatype for them and its user-defined-op path is slower.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rapydli.comm.base import Algorithm
from rapydli.comm.mpi import MPIAlgorithm
from rapydli.comm.ring import RingAlgorithm
from rapydli.comm.shm import COMPILED_MAX_BYTES, SharedMemoryAlgorithm
from rapydli.comm.tensors import HALF_DTYPES, host_zeros
from rapydli.comm.waiting import SPIN, Pace
from rapydli.paths import home
from rapydli.settings import settings

if TYPE_CHECKING:
    from mpi4py import MPI

#: Algorithms ``auto`` chooses among on CPU tensors (``shm`` only where every rank shares a node).
CANDIDATES: tuple[str, ...] = ("mpi", "ring", "shm")
#: Largest message measured when ``auto`` measures on its own (the benchmark goes further).
QUICK_MAX_BYTES = 16 << 20
#: Another algorithm replaces the default (``mpi``) only when faster by more than this, so
#: noise does not flip sizes where they tie; a tie-break costs at most this much speed,
#: and ``auto`` is meant to stay within 0.95x of the best. 2 ranks of a 2-core host: with a
#: 3 % margin, ring picked at 1 MiB ran 20 % slower than mpi in the same benchmark; with
#: 10 %, auto kept mpi at 1-16 MiB where the prepared ring led by 9-27 % in the benchmark,
#: because the table, timed in one of this host's slow spells, had it only 1-6 % ahead
#: (auto/best 0.79-0.89 there, in two runs).
MARGIN = 0.05
_FORMAT = 3  # 2: shm is a candidate; 3: timed on freshly written data


@dataclass
class AutoTable:
    """Measured times per message size and the algorithm picked for each.

    Attributes
    ----------
    key
        What the measurement is valid for: world size, hosts, MPI library.
    sizes
        Message sizes in bytes, ascending.
    times
        Algorithm name -> seconds per allreduce at each size (slowest rank's median; None
        where the algorithm is not offered).
    choices
        Fastest algorithm at each size.
    source
        ``"measured"`` (this run), ``"cache"`` (read from disk) or ``"fallback"``.
    path
        The cache file, if any.
    """

    key: dict[str, Any]
    sizes: list[int] = field(default_factory=list)
    times: dict[str, list[float | None]] = field(default_factory=dict)
    choices: list[str] = field(default_factory=list)
    source: str = "fallback"
    path: str | None = None

    def pick(self, nbytes: int) -> str:
        """The algorithm for a message of ``nbytes`` (nearest measured size, log scale)."""
        if not self.sizes:
            return "mpi"
        index = bisect.bisect_left(self.sizes, nbytes)
        if index == len(self.sizes):
            return self.choices[-1]
        if index > 0 and math.log2(max(nbytes, 1) / self.sizes[index - 1]) < math.log2(
            self.sizes[index] / max(nbytes, 1)
        ):
            index -= 1
        return self.choices[index]


def cluster_key(comm: MPI.Comm) -> dict[str, Any]:
    """World size, sorted host names and MPI library: what a measurement depends on (collective)."""
    from mpi4py import MPI

    hosts = sorted(comm.allgather(socket.gethostname()))
    return {
        "format": _FORMAT,
        "world_size": comm.Get_size(),
        "hosts": hosts,
        "mpi": MPI.Get_library_version().strip().splitlines()[0],
    }


def cache_path(key: dict[str, Any]) -> Path:
    """Where the measurement for ``key`` is cached."""
    digest = hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return home() / "comm" / f"allreduce-auto-{digest}.json"


def message_sizes(max_bytes: int) -> list[int]:
    """4 B, 16 B, 64 B, ... (powers of 4) up to ``max_bytes``, plus ``max_bytes`` itself."""
    sizes = [4]
    while sizes[-1] * 4 <= max_bytes:
        sizes.append(sizes[-1] * 4)
    if sizes[-1] != max_bytes and max_bytes > 4:
        sizes.append(max_bytes)
    return sizes


def repetitions(nbytes: int) -> int:
    """Timed repetitions at a size: many for latency-bound sizes, at least 5 for large ones."""
    return max(5, min(30, int(64e6 / max(nbytes, 1))))


def measure(comm: MPI.Comm, max_bytes: int = QUICK_MAX_BYTES, candidates: tuple[str, ...] = CANDIDATES) -> AutoTable:
    """Time each candidate at each size on all ranks of ``comm`` (collective); pick the fastest.

    Each runs as the communicator runs a repeated call: its prepared call where it has one.
    """
    shm = SharedMemoryAlgorithm(comm)
    algorithms: dict[str, Algorithm] = {"mpi": MPIAlgorithm(comm), "ring": RingAlgorithm(comm), "shm": shm}
    candidates = tuple(name for name in candidates if name != "shm" or shm.usable)
    table = AutoTable(key=cluster_key(comm), sizes=message_sizes(max_bytes), source="measured")
    table.times = {name: [] for name in candidates}
    for nbytes in table.sizes:
        names = tuple(name for name in candidates if name != "shm" or nbytes <= COMPILED_MAX_BYTES)
        tensor = host_zeros(max(1, nbytes // 4), torch.float32)  # the memory gradient buckets use
        reps = repetitions(nbytes)
        local = np.zeros((len(names), reps))
        calls = [_call(algorithms[name], tensor) for name in names]
        for call in calls:  # warm-up: connections, scratch buffers
            call()
        for rep in range(reps):
            for i in range(len(names))[:: 1 if rep % 2 else -1]:  # each goes first every other rep
                # freshly written data, as a tensor just computed has (and as the bench times
                # it); without it the sums also doubled up to inf over the reps
                tensor.fill_(1.0)
                comm.Barrier()
                start = time.perf_counter()
                calls[i]()
                local[i, rep] = time.perf_counter() - start
        slowest = np.empty_like(local)
        from mpi4py import MPI

        comm.Allreduce(local, slowest, op=MPI.MAX)
        medians = np.median(slowest, axis=1)
        for name in candidates:  # None: not offered at this size
            table.times[name].append(float(medians[names.index(name)]) if name in names else None)
        table.choices.append(_fastest(names, medians))
    return table


def _call(algorithm: Algorithm, tensor: torch.Tensor) -> Callable[[], object]:
    """A repeated ``sum`` of ``tensor`` as the communicator would run it."""
    return algorithm.prepare(tensor, "sum") or (lambda: algorithm.allreduce_(tensor, "sum"))


def _fastest(candidates: tuple[str, ...], seconds: np.ndarray) -> str:
    """The fastest candidate; the first (the default) unless another beats it by more than ``MARGIN``.

    The margin keeps noise from flipping sizes where the algorithms tie; it costs at most
    ``MARGIN`` of speed.
    """
    best = int(np.argmin(seconds))
    return candidates[best] if seconds[best] < (1 - MARGIN) * seconds[0] else candidates[0]


def save(table: AutoTable) -> Path:
    """Write ``table`` to its cache file atomically (temporary file + rename)."""
    path = cache_path(table.key)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    payload = {**asdict(table), "source": "cache", "path": str(path)}
    temporary.write_text(json.dumps(payload, indent=1))
    temporary.replace(path)
    table.path = str(path)
    return path


def load(key: dict[str, Any]) -> AutoTable | None:
    """The cached table for ``key``, or None if absent or unreadable."""
    path = cache_path(key)
    try:
        payload = json.loads(path.read_text())
        table = AutoTable(**payload)
    except (OSError, ValueError, TypeError):
        return None
    return table if table.key == key and len(table.choices) == len(table.sizes) else None


def tune(comm: MPI.Comm, max_bytes: int = QUICK_MAX_BYTES, force: bool = False) -> AutoTable:
    """The table for this cluster: from the cache, else measured and cached (collective).

    Rank 0 reads and writes the file and broadcasts the table, so every rank decides alike
    even without a shared file system.
    """
    key = cluster_key(comm)
    table = load(key) if comm.Get_rank() == 0 and not force else None
    table = comm.bcast(table, root=0)
    if table is None:
        if not settings().comm_autotune and not force:
            return AutoTable(key=key)
        table = measure(comm, max_bytes)
        if comm.Get_rank() == 0:
            save(table)
        comm.Barrier()  # the file exists when tune() returns, on every rank
        table.path = str(cache_path(key))
    return table


class AutoAlgorithm(Algorithm):
    """Delegates each message to ``mpi``, ``ring`` or ``shm`` by size, from :func:`tune`'s table.

    Parameters
    ----------
    comm
        The mpi4py communicator. Construction is collective.
    table
        A table to use instead of loading/measuring one (shared by :meth:`bind`).
    pace
        How to wait (polite on the communication thread).
    shm
        The ``shm`` algorithm over ``comm`` (default: a new one); offered only where
        :attr:`~rapydli.comm.shm.SharedMemoryAlgorithm.usable`.
    """

    name = "auto"

    def __init__(
        self,
        comm: MPI.Comm,
        table: AutoTable | None = None,
        pace: Pace = SPIN,
        shm: SharedMemoryAlgorithm | None = None,
    ) -> None:
        super().__init__(comm)
        self.shm = shm if shm is not None else SharedMemoryAlgorithm(comm, pace=pace)
        self.candidates: dict[str, Algorithm] = {
            "mpi": MPIAlgorithm(comm, pace=pace),
            "ring": RingAlgorithm(comm, pace=pace),
        }
        if self.shm.usable:
            self.candidates["shm"] = self.shm
        self.table = table if table is not None else tune(comm)

    def bind(self, comm: MPI.Comm, pace: Pace | None = None) -> AutoAlgorithm:
        return AutoAlgorithm(comm, self.table, pace or SPIN, self.shm.bind(comm, pace))

    def choose(self, flat: torch.Tensor) -> str:
        nbytes = flat.numel() * flat.element_size()
        name = self.table.pick(nbytes)
        if name not in self.candidates or (name == "shm" and nbytes > COMPILED_MAX_BYTES):  # a table from elsewhere
            name = "mpi"
        return "ring" if name == "mpi" and flat.dtype in HALF_DTYPES else name

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        self.candidates[self.choose(flat)].allreduce_(flat, op)

    def averages_for(self, flat: torch.Tensor) -> bool:
        return self.candidates[self.choose(flat)].averages_for(flat)

    def prepare(self, flat: torch.Tensor, op: str) -> Callable[[], object] | None:
        return self.candidates[self.choose(flat)].prepare(flat, op)
