"""``ring``: bandwidth-optimal ring allreduce over MPI point-to-point (baidu-allreduce).

The flat tensor is cut into ``n`` segments (sizes differ by at most one element; some are
empty when the tensor has fewer than ``n`` elements). In ``n - 1`` scatter-reduce steps
each rank sends one segment to its right neighbour and adds the one arriving from its
left; after them rank ``r`` holds the fully reduced segment ``r + 1``. In ``n - 1``
allgather steps the reduced segments travel once more round the ring, straight into the
tensor's memory. Each rank sends and receives ``2 (n - 1) / n`` of the tensor, the lower
bound for allreduce.

Segments are split into chunks (``chunk_bytes``) and the steps are pipelined: receives
for the next step are posted before the current one is reduced, and a chunk is forwarded
the moment it is reduced, so the network, the reduction and the next transfer overlap.
Reduction uses torch ops, so every dtype (``bfloat16``, ``float16`` included) works; data
travels as bytes.
"""

from __future__ import annotations

import threading

import torch

from rapydli.comm.base import Algorithm
from rapydli.comm.tensors import byte_array, host_zeros, reduce_into
from rapydli.comm.waiting import complete

#: Default chunk size of the pipeline (bytes).
CHUNK_BYTES = 1 << 20

_TAG_SCATTER = 7101
_TAG_GATHER = 7102


class RingAlgorithm(Algorithm):
    """Chunked, pipelined ring allreduce (scatter-reduce, then allgather).

    Parameters
    ----------
    comm
        The mpi4py communicator.
    chunk_bytes
        Pipeline chunk size in bytes (at least one element).
    """

    name = "ring"

    def __init__(self, comm, chunk_bytes: int = CHUNK_BYTES, polite: bool = False) -> None:
        super().__init__(comm)
        self.chunk_bytes = int(chunk_bytes)
        self.polite = polite
        self._local = threading.local()

    def bind(self, comm, polite: bool = False) -> RingAlgorithm:
        return RingAlgorithm(comm, self.chunk_bytes, polite)

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Receive buffer, reused across calls (one per thread: the comm thread has its own)."""
        scratch = getattr(self._local, "scratch", None)
        if scratch is None or scratch.dtype != dtype or scratch.numel() < numel:
            scratch = host_zeros(numel, dtype)
            self._local.scratch = scratch
        return scratch

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        from mpi4py import MPI

        comm = self.comm
        n, rank = comm.Get_size(), comm.Get_rank()
        numel = flat.numel()
        if n == 1 or numel == 0:
            return
        right, left = (rank + 1) % n, (rank - 1) % n
        base, extra = divmod(numel, n)
        starts = [i * base + min(i, extra) for i in range(n + 1)]
        seg_max = base + (1 if extra else 0)
        step_elems = max(1, self.chunk_bytes // flat.element_size())

        def chunks(segment: int) -> list[tuple[int, int]]:
            lo, hi = starts[segment], starts[segment + 1]
            return [(a, min(a + step_elems, hi)) for a in range(lo, hi, step_elems)]

        size = flat.element_size()
        data = byte_array(flat)
        scratch = self._scratch(2 * seg_max, flat.dtype)
        scratch_bytes = byte_array(scratch)

        def post_scatter_receives(step: int) -> list:
            segment, half = (rank - step - 1) % n, (step % 2) * seg_max
            requests = []
            for a, b in chunks(segment):
                offset = half + a - starts[segment]
                window = scratch_bytes[offset * size : (offset + b - a) * size]
                requests.append(comm.Irecv([window, MPI.BYTE], source=left, tag=_TAG_SCATTER))
            return requests

        # scatter-reduce: step s sends segment rank - s, receives and reduces segment rank - s - 1
        scatter_sends = [
            comm.Isend([data[a * size : b * size], MPI.BYTE], dest=right, tag=_TAG_SCATTER) for a, b in chunks(rank)
        ]
        gather_sends = []
        pending = post_scatter_receives(0)
        for step in range(n - 1):
            segment, half = (rank - step - 1) % n, (step % 2) * seg_max
            last = step == n - 2
            upcoming = None if last else post_scatter_receives(step + 1)
            for request, (a, b) in zip(pending, chunks(segment)):
                complete((request,), self.polite)
                offset = half + a - starts[segment]
                reduce_into(flat[a:b], scratch[offset : offset + b - a], op)
                # forward the reduced chunk at once: next scatter step, or the first allgather step
                message = [data[a * size : b * size], MPI.BYTE]
                if last:
                    gather_sends.append(comm.Isend(message, dest=right, tag=_TAG_GATHER))
                else:
                    scatter_sends.append(comm.Isend(message, dest=right, tag=_TAG_SCATTER))
            pending = upcoming
        # segments sent while reducing are overwritten by the allgather: their sends must be done
        complete(scatter_sends, self.polite)

        # allgather: step s receives the reduced segment rank - s into place and forwards it
        steps = [(rank - step) % n for step in range(n - 1)]
        receives = [
            [comm.Irecv([data[a * size : b * size], MPI.BYTE], source=left, tag=_TAG_GATHER) for a, b in chunks(seg)]
            for seg in steps
        ]
        for step, segment in enumerate(steps):
            forward = step < n - 2
            for request, (a, b) in zip(receives[step], chunks(segment)):
                complete((request,), self.polite)
                if forward:
                    gather_sends.append(comm.Isend([data[a * size : b * size], MPI.BYTE], dest=right, tag=_TAG_GATHER))
        complete(gather_sends, self.polite)
