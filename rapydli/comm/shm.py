"""``shm``: allreduce of buffers that live in memory shared by all ranks of one node.

When every rank of a communicator runs on the same host, a buffer that is reduced again
and again (a gradient bucket) can be allocated by :meth:`SharedBuffers.zeros`: each rank
gets its own segment of one ``/dev/shm`` mapping and sees every other rank's segment of
it. Reducing it then needs no message at all: after a barrier, rank ``r`` reduces segment
``r`` of the buffer by reading that segment straight from the other ranks' memory (torch
ops, so every dtype works), divides it there for ``avg``, and writes the result into the
same segment of every other rank's buffer; a second barrier and every rank holds the whole
result. Only rank ``r`` touches segment ``r`` of any buffer in between, and each element is
reduced once, by its owner, so every rank ends with the same bits.

Measured on 2 ranks of one host (MPICH 5, the MLP's 7.4 MB of gradients, right after
backward): 1.0 ms against 2.4 ms for MPI's ``Allreduce`` on the same memory (0.43 against
1.6 ms when the buffer is warm in cache): MPI copies every message twice through its
shared-memory cells, this reads the peer's bytes once. Pushing the owner's result (rather
than each rank pulling the other segments after a second barrier, then a third barrier and
a separate ``avg`` pass over the whole buffer) took that ``avg`` reduction from 1.03-1.41 to
0.84-1.09 ms (medians of 60 interleaved reps after evicting the caches, 2 runs).

Any other CPU tensor is reduced by compiled code (``shm_reduce.c``, :mod:`rapydli.comm.native`)
through two small slots per rank in such a mapping: each rank copies its message into its
slot and publishes a sequence number, waits until every rank has published it, then reduces
all slots in rank order into its own tensor (in chunks of :data:`SLOT_BYTES`). No MPI call
and no barrier: on 2 ranks of one host 0.9-1.8 us per call from 4 B to 4 KiB against 3.9-5.9
us for mpi4py's ``Allreduce``, 15 against 29 us at 64 KiB (back-to-back calls). ``auto``
measures it against ``mpi`` and ``ring`` up to :data:`COMPILED_MAX_BYTES` and uses it where
it wins; above that size it is there by name only.

Buffers are allocated collectively (every rank, same order, same sizes). Rank 0 creates
the file, reserves its pages (``posix_fallocate``: a full ``/dev/shm`` is an error here,
not a ``SIGBUS`` later) and unlinks it once every rank has tried to map it, so nothing is
left behind; if any rank could not, every rank falls back to ordinary memory. The mapping
lives as long as the tensors over it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from rapydli.comm import native
from rapydli.comm.base import Algorithm
from rapydli.comm.tensors import _NUMPY_STORAGE, finish_avg, host_zeros, reduce_into
from rapydli.comm.waiting import SPIN, Pace
from rapydli.errors import ConfigError
from rapydli.native import CompileError

if TYPE_CHECKING:
    from mpi4py import MPI

#: Where shared buffers are created (a tmpfs on Linux).
SHM_DIR = "/dev/shm"
_PAGE = mmap.PAGESIZE
#: Bytes per slot of the compiled path: messages are reduced in chunks of this size.
SLOT_BYTES = 256 << 10
#: Largest message ``auto`` sends through the compiled path. Above it the chunk-by-chunk
#: handshakes, and every rank reading every rank's whole message, lose to MPI's own
#: reduce-scatter + allgather: 2 ranks, 16 MiB, 3.5-13 ms against 4.0-4.2 ms for MPI in three
#: runs; 1 MiB (4 chunks) 0.42-0.49 ms against 0.54-0.56 ms.
COMPILED_MAX_BYTES = 1 << 20
#: A rank's area for the compiled path: its published sequence number (one cache line), two slots.
_AREA_BYTES = 64 + 2 * SLOT_BYTES
#: What each rank of a node keeps for the compiled path once the first shared buffer is made: two areas (1 MiB).
AREAS_BYTES = 2 * _AREA_BYTES


def _round_up(nbytes: int) -> int:
    return max(_PAGE, -(-nbytes // _PAGE) * _PAGE)


class SharedBuffers:
    """Buffers in node-shared memory for one communicator, and the peers' views of them.

    Parameters
    ----------
    comm
        The mpi4py communicator. Construction is collective: it finds out whether every
        rank shares this node (``MPI.COMM_TYPE_SHARED``) and whether ``/dev/shm`` exists.
    """

    def __init__(self, comm: MPI.Comm) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        same_node = node.Get_size() == self.size
        node.Free()
        #: True when every rank is on this node and ``/dev/shm`` can be used
        self.available: bool = comm.allreduce(same_node and os.path.isdir(SHM_DIR), op=MPI.LAND) and self.size > 1
        #: data_ptr of each shared buffer -> (numel, every rank's view of it, by rank)
        self._peers: dict[int, tuple[int, list[torch.Tensor]]] = {}

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed 1-D CPU tensor in node-shared memory (collective: same sizes on every rank).

        Falls back to ordinary (numpy-allocated) memory on every rank alike when the
        ranks are not on one node or ``/dev/shm`` has no room.
        """
        sizes = self.comm.allgather((numel, str(dtype)))
        if len(set(sizes)) != 1:
            raise ConfigError(f"shared buffers must have the same numel and dtype on every rank, got {sizes}")
        segment = _round_up(numel * torch.empty(0, dtype=dtype).element_size())
        path = None
        if self.available and numel > 0 and self.rank == 0:
            path = self._create(segment * self.size)
        path = self.comm.bcast(path, root=0)
        if path is None:
            return host_zeros(numel, dtype)
        try:
            with open(path, "r+b") as stream:
                mapping: mmap.mmap | None = mmap.mmap(stream.fileno(), segment * self.size)
        except OSError:  # e.g. a rank whose /dev/shm is not rank 0's (a container of its own)
            mapping = None
        from mpi4py import MPI

        everywhere = self.comm.allreduce(mapping is not None, op=MPI.LAND)  # every rank has tried
        if self.rank == 0:
            os.unlink(path)
        if not everywhere:  # all ranks fall back alike, now and for later buffers
            self.available = False
            return host_zeros(numel, dtype)
        assert mapping is not None  # every rank mapped the file, this one included
        storage = np.dtype(_NUMPY_STORAGE[dtype])
        views = []
        for rank in range(self.size):
            array = np.frombuffer(mapping, dtype=storage, count=numel, offset=rank * segment)
            tensor = torch.from_numpy(array)
            views.append(tensor.view(dtype) if dtype == torch.bfloat16 else tensor)
        mine = views[self.rank]
        self._peers[mine.data_ptr()] = (numel, views)
        return mine

    def peer_views(self) -> list[torch.Tensor]:
        """The other ranks' segments of every buffer this rank allocated: mapped here, held by their owners."""
        return [view for _, views in self._peers.values() for rank, view in enumerate(views) if rank != self.rank]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's view of ``flat`` if it is a whole buffer from :meth:`zeros`, else None."""
        found = self._peers.get(flat.data_ptr())
        return found[1] if found is not None and found[0] == flat.numel() and found[1][0].dtype == flat.dtype else None

    @staticmethod
    def _create(nbytes: int) -> str | None:
        path = os.path.join(SHM_DIR, f"rapydli-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        try:
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(descriptor, 0, nbytes)  # reserve the pages now: no SIGBUS when /dev/shm is full
        except OSError:
            os.close(descriptor)
            os.unlink(path)
            return None
        os.close(descriptor)
        return path


class _Slots:
    """Every rank's area for the compiled path, and the sequence number this rank last used.

    One per communicator: the main communicator and its asynchronous duplicate each have
    their own, so calls on the two threads never share slots or sequence numbers.
    """

    def __init__(self, views: list[torch.Tensor]) -> None:
        self.views = views  # keep the mapping alive
        self.bases = (ctypes.c_void_p * len(views))(*[view.data_ptr() for view in views])
        self.seq = ctypes.c_uint64(0)


class SharedMemoryAlgorithm(Algorithm):
    """Allreduce through memory shared by every rank of one node.

    A buffer from :meth:`SharedBuffers.zeros` (``Communicator.host_buffer()``) is reduced in
    place by reading the other ranks' segments; any other CPU tensor goes through the
    compiled slots (:data:`SLOT_BYTES` at a time). Construction is collective.

    Parameters
    ----------
    comm
        The mpi4py communicator (its ranks must share one node; otherwise every call raises
        :class:`ConfigError`, and ``auto`` does not offer this algorithm).
    buffers
        Shared buffers to reduce in place (default: new ones over ``comm``).
    pace
        How to wait (polite on the communication thread).
    """

    name = "shm"
    averages = True

    def __init__(
        self,
        comm: MPI.Comm,
        buffers: SharedBuffers | None = None,
        pace: Pace = SPIN,
        slots: tuple[_Slots, _Slots] | None = None,
    ) -> None:
        super().__init__(comm)
        self.buffers = buffers if buffers is not None else SharedBuffers(comm)
        self.pace = pace
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self._barrier: Callable[[], object] = (
            comm.Barrier if pace is SPIN else (lambda: pace.complete((comm.Ibarrier(),)))
        )
        #: (this communicator's slots, the asynchronous duplicate's): None when the compiled path cannot run
        self.slots = slots if slots is not None else self._allocate_slots()

    @property
    def usable(self) -> bool:
        """True when any CPU tensor can be reduced here (one node, compiled code built)."""
        return self.slots is not None

    def bind(self, comm: MPI.Comm, pace: Pace | None = None) -> SharedMemoryAlgorithm:
        """The same buffers over ``comm``, with the second set of slots (for the asynchronous duplicate)."""
        slots = (self.slots[1], self.slots[0]) if self.slots is not None else None
        return SharedMemoryAlgorithm(comm, self.buffers, pace or SPIN, slots)

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        views = self.buffers.views(flat)
        if views is not None:
            self._reduce_shared(flat, views, op)
        elif flat.numel() and self.size > 1:
            plan = self._plan(flat, op)
            if native.allreduce_function()(ctypes.byref(plan)) != 0:
                raise ConfigError(f"the shm algorithm cannot reduce {flat.dtype} with op={op!r}")

    def prepare(self, flat: torch.Tensor, op: str) -> Callable[[], object] | None:
        """One foreign call on a plan filled once (tensors outside the shared buffers only)."""
        if self.buffers.views(flat) is not None or not flat.numel() or self.size == 1:
            return None
        return partial(native.allreduce_function(), ctypes.byref(self._plan(flat, op)))

    # -- internals ------------------------------------------------------------------

    def _allocate_slots(self) -> tuple[_Slots, _Slots] | None:
        """Two areas per rank in one shared buffer (collective); None where the compiled path cannot run."""
        from mpi4py import MPI

        built = self.buffers.available
        if built:
            try:
                native.allreduce_function()  # compiled once per machine, loaded once per process
            except CompileError:
                built = False
        if not self.comm.allreduce(built, op=MPI.LAND):
            return None
        mine = self.buffers.zeros(AREAS_BYTES, torch.uint8)
        views = self.buffers.views(mine)
        if views is None:  # /dev/shm refused the buffer on some rank: every rank fell back alike
            return None
        return _Slots([view[:_AREA_BYTES] for view in views]), _Slots([view[_AREA_BYTES:] for view in views])

    def _plan(self, flat: torch.Tensor, op: str) -> native.ReducePlan:
        if self.slots is None:
            raise ConfigError(
                "the shm algorithm needs every rank on one node with /dev/shm and a C compiler; use 'auto', 'mpi' or 'ring'"
            )
        slots = self.slots[0]
        return native.ReducePlan(
            slots.bases,
            ctypes.pointer(slots.seq),
            flat.data_ptr(),
            flat.numel(),
            SLOT_BYTES,
            self.size,
            self.rank,
            native.DTYPE_CODES[flat.dtype],
            native.OP_CODES[op],
            int(self.pace.polite),
        )

    def _reduce_shared(self, flat: torch.Tensor, views: list[torch.Tensor], op: str) -> None:
        """A whole shared buffer: each rank reduces its segment from the peers' memory and pushes it."""
        n, rank = self.size, self.rank
        base, extra = divmod(flat.numel(), n)
        start, stop = rank * base + min(rank, extra), (rank + 1) * base + min(rank + 1, extra)
        barrier = self._barrier
        barrier()  # every rank's data is in place
        result = flat[start:stop]
        for peer in range(n):
            if peer != rank:
                reduce_into(result, views[peer][start:stop], op)
        if op == "avg":
            finish_avg(result, n)
        for peer in range(n):
            if peer != rank:
                views[peer][start:stop].copy_(result)  # only this rank touches this segment anywhere
        barrier()  # every segment is reduced and pushed: each rank may read and write its buffer again
