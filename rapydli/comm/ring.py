"""``ring``: bandwidth-optimal ring allreduce over MPI point-to-point (baidu-allreduce).

The flat tensor is cut into ``n`` segments (sizes differ by at most one element; some are
empty when the tensor has fewer than ``n`` elements). In ``n - 1`` scatter-reduce steps
each rank sends one segment to its right neighbour and adds the one arriving from its
left; after them rank ``r`` holds the fully reduced segment ``r + 1``. In ``n - 1``
allgather steps the reduced segments travel once more round the ring, straight into the
tensor's memory. Each rank sends and receives ``2 (n - 1) / n`` of the tensor, the lower
bound for allreduce.

Segments larger than a chunk (``chunk_bytes``) are split into chunks and the steps are
pipelined: receives for the next step are posted before the current one is reduced, and a
chunk is forwarded the moment it is reduced, so the network, the reduction and the next
transfer overlap. When every segment fits in one chunk there is nothing to pipeline, and
each step is one ``Sendrecv`` (or, on a communication thread that must leave the core to
backward, one pair of requests it completes politely): measured on 2 ranks of one host,
interleaved with the pipelined code, 8 B 35 -> 27 us, 64 KiB 71 -> 60 us, 1 MiB 210 ->
203 us (MPI's ``Allreduce`` 204 us), 4-16 MiB the same within noise. Reduction uses
torch ops, so every dtype (``bfloat16``, ``float16`` included) works; data travels as
bytes.

A buffer reduced again and again (``Communicator.allreduce_`` on the same tensor) runs the
unpipelined ring as a plan laid out once (:meth:`RingAlgorithm.prepare`): its messages and
reduction views are built over the tensor's address, so a call is the exchanges and the
reductions and nothing else. Laying them out took 6-17 us a call on 2 ranks (against the
same exchanges written out by hand), up to an eighth of a 1 MiB allreduce. With the plan,
``rapydli bench allreduce`` (2 ranks, 3 runs) measured the ring at 1.15-1.17x MPI's busbw
at 1 MiB (116-118 against 135-137 us) and 0.99-1.13x at 4 MiB, where the ring without it
had measured 0.87-1.0x and 0.91-0.99x; alone against mpi4py's ``Allreduce`` at 8 B,
8.4 against 3.5 us (31 against 5.5 us before).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import lru_cache, partial
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from rapydli.comm.base import Algorithm
from rapydli.comm.tensors import byte_array, host_zeros, reduce_into
from rapydli.comm.waiting import SPIN, Pace

#: Default chunk size of the pipeline (bytes). Measured on 2 ranks of one host (MPICH 5,
#: 1 MiB to 256 MiB): 4 MiB chunks were 10-30 % faster than 1 MiB at 4-256 MiB and
#: equal at 1 MiB; 256 KiB chunks were 20-90 % slower. Each chunk costs a message and a
#: wake-up, and with one core per rank there is little to overlap.
CHUNK_BYTES = 4 << 20

_TAG_SCATTER = 7101
_TAG_GATHER = 7102


@lru_cache(maxsize=64)
def _layout(n: int, numel: int, step_elems: int) -> tuple[tuple[int, ...], tuple[tuple[tuple[int, int], ...], ...]]:
    """Segment starts (``n + 1``) and each segment's chunks as ``(start, stop)`` element ranges."""
    base, extra = divmod(numel, n)
    starts = tuple(i * base + min(i, extra) for i in range(n + 1))
    chunks = tuple(
        tuple((a, min(a + step_elems, starts[s + 1])) for a in range(starts[s], starts[s + 1], step_elems))
        for s in range(n)
    )
    return starts, chunks


class RingAlgorithm(Algorithm):
    """Chunked, pipelined ring allreduce (scatter-reduce, then allgather).

    Parameters
    ----------
    comm
        The mpi4py communicator.
    chunk_bytes
        Pipeline chunk size in bytes (at least one element).
    pace
        How to wait for requests (spinning by default; polite on the communication thread).
    """

    name = "ring"

    def __init__(self, comm: MPI.Comm, chunk_bytes: int = CHUNK_BYTES, pace: Pace = SPIN) -> None:
        super().__init__(comm)
        self.chunk_bytes = int(chunk_bytes)
        self.pace = pace
        self._local = threading.local()
        rank, n = comm.Get_rank(), comm.Get_size()
        self._neighbours = ((rank + 1) % n, (rank - 1) % n)  # (right, left)

    def bind(self, comm: MPI.Comm, pace: Pace | None = None) -> RingAlgorithm:
        return RingAlgorithm(comm, self.chunk_bytes, pace or SPIN)

    def _scratch(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, np.ndarray]:
        """Receive buffer and its bytes, reused across calls (one per thread: the comm thread has its own)."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch[0].dtype != dtype or scratch[0].numel() < numel:
            tensor = host_zeros(numel, dtype)
            scratch = self._local.scratch = (tensor, byte_array(tensor))
        return scratch

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        comm = self.comm
        n, numel = comm.Get_size(), flat.numel()
        if n == 1 or numel == 0:
            return
        rank = comm.Get_rank()
        right, left = self._neighbours
        size = flat.element_size()
        starts, chunks = _layout(n, numel, max(1, self.chunk_bytes // size))
        seg_max = starts[1] - starts[0]  # the first segments are the longest
        data = byte_array(flat)
        if len(chunks[0]) == 1:
            self._run_unpipelined(*self._unpipelined_steps(data, flat, op, starts, seg_max))
            return
        scratch, scratch_bytes = self._scratch(2 * seg_max, flat.dtype)
        complete = self.pace.complete
        byte = MPI.BYTE

        def post_scatter_receives(step: int) -> list[MPI.Request]:
            segment, half = (rank - step - 1) % n, (step % 2) * seg_max
            shift = half - starts[segment]
            return [
                comm.Irecv([scratch_bytes[(a + shift) * size : (b + shift) * size], byte], left, _TAG_SCATTER)
                for a, b in chunks[segment]
            ]

        # scatter-reduce: step s sends segment rank - s, receives and reduces segment rank - s - 1
        pending: list[MPI.Request] | None = post_scatter_receives(0)
        scatter_sends = [comm.Isend([data[a * size : b * size], byte], right, _TAG_SCATTER) for a, b in chunks[rank]]
        gather_sends: list[MPI.Request] = []
        for step in range(n - 1):
            segment, half = (rank - step - 1) % n, (step % 2) * seg_max
            shift = half - starts[segment]
            last = step == n - 2
            upcoming = None if last else post_scatter_receives(step + 1)
            # forward each reduced chunk at once: next scatter step, or the first allgather step
            sends, tag = (gather_sends, _TAG_GATHER) if last else (scatter_sends, _TAG_SCATTER)
            assert pending is not None  # None only after the last step
            for request, (a, b) in zip(pending, chunks[segment]):
                complete((request,))
                reduce_into(flat[a:b], scratch[a + shift : b + shift], op)
                sends.append(comm.Isend([data[a * size : b * size], byte], right, tag))
            pending = upcoming
        # segments sent while reducing are overwritten by the allgather: their sends must be done
        complete(scatter_sends)

        # allgather: step s receives the reduced segment rank - s into place and forwards it
        segments = [(rank - step) % n for step in range(n - 1)]
        receives = [
            [comm.Irecv([data[a * size : b * size], byte], left, _TAG_GATHER) for a, b in chunks[segment]]
            for segment in segments
        ]
        for step, segment in enumerate(segments):
            forward = step < n - 2
            for request, (a, b) in zip(receives[step], chunks[segment]):
                complete((request,))
                if forward:
                    gather_sends.append(comm.Isend([data[a * size : b * size], byte], right, _TAG_GATHER))
        complete(gather_sends)

    def prepare(self, flat: torch.Tensor, op: str) -> Callable[[], object] | None:
        """The unpipelined ring with its messages and reductions laid out once, over ``flat``'s address.

        Messages whose segments span several chunks keep running :meth:`allreduce_`: their
        per-call layout cost is small against their size.
        """
        n, numel = self.comm.Get_size(), flat.numel()
        if n == 1 or numel == 0 or self.pace.polite:
            return None
        size = flat.element_size()
        starts, chunks = _layout(n, numel, max(1, self.chunk_bytes // size))
        if len(chunks[0]) != 1:
            return None
        memory = MPI.buffer.fromaddress(flat.data_ptr(), numel * size)  # no reference to flat
        # MPI.buffer has the buffer protocol; mpi4py's stub declares __buffer__ only for Python >= 3.12
        data = np.frombuffer(memory, dtype=np.uint8)  # type: ignore[call-overload]
        target = torch.from_numpy(data).view(flat.dtype)
        return partial(self._run_unpipelined, *self._unpipelined_steps(data, target, op, starts, starts[1] - starts[0]))

    def _unpipelined_steps(
        self, data: np.ndarray, target: torch.Tensor, op: str, starts: tuple[int, ...], seg_max: int
    ) -> tuple[list[tuple[list[Any], list[Any], Callable[[], None]]], list[tuple[list[Any], list[Any]]]]:
        """The ring with one message per segment and step, laid out over ``data`` (``target``'s bytes).

        Returns ``(send, receive, reduce)`` per scatter-reduce step and ``(send, receive)``
        per allgather step.
        """
        n, rank = self.comm.Get_size(), self.comm.Get_rank()
        size = target.element_size()
        scratch, scratch_bytes = self._scratch(seg_max, target.dtype)
        byte = MPI.BYTE

        def segment(s: int) -> list[Any]:
            return [data[starts[s] * size : starts[s + 1] * size], byte]

        scatter: list[tuple[list[Any], list[Any], Callable[[], None]]] = []
        # scatter-reduce: step s sends segment rank - s, receives and reduces segment rank - s - 1
        for step in range(n - 1):
            out, into = (rank - step) % n, (rank - step - 1) % n
            a, b = starts[into], starts[into + 1]
            receive = [scratch_bytes[: (b - a) * size], byte]
            scatter.append((segment(out), receive, partial(reduce_into, target[a:b], scratch[: b - a], op)))
        # allgather: step s forwards segment rank - s + 1 (reduced) and receives segment rank - s into place
        gather = [(segment((rank - step + 1) % n), segment((rank - step) % n)) for step in range(n - 1)]
        return scatter, gather

    def _run_unpipelined(
        self, scatter: list[tuple[list[Any], list[Any], Callable[[], None]]], gather: list[tuple[list[Any], list[Any]]]
    ) -> None:
        """``2 (n - 1)`` exchanges with the neighbours, a reduction after each scatter step."""
        comm, pace = self.comm, self.pace
        right, left = self._neighbours

        def exchange(send: list[Any], receive: list[Any], tag: int) -> None:
            if pace.urgent:  # point-to-point: blocking on one rank matches non-blocking on another
                comm.Sendrecv(send, right, tag, receive, left, tag)
            else:
                pace.complete((comm.Irecv(receive, left, tag), comm.Isend(send, right, tag)))

        for send, receive, reduce in scatter:
            exchange(send, receive, _TAG_SCATTER)
            reduce()
        for send, receive in gather:
            exchange(send, receive, _TAG_GATHER)
