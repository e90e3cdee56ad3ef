"""``mpi``: the MPI library's own ``Allreduce`` on the tensor's memory.

The vendor implementation is tuned for its network and message sizes. ``float16`` and
``bfloat16`` have no MPI datatype; they are reduced by a user-defined MPI operation that
applies torch to 2-byte words (:func:`rapydli.comm.tensors.mpi_op`), which is correct but
slower than the ring's built-in torch reduction.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from mpi4py import MPI

from rapydli.comm.base import Algorithm
from rapydli.comm.tensors import address_buffer, mpi_buffer, mpi_op
from rapydli.comm.waiting import SPIN, Pace


class MPIAlgorithm(Algorithm):
    """mpi4py ``Allreduce`` in place on the tensor's buffer.

    With a polite ``pace`` (the instance on the communication thread) it is ``Iallreduce``
    completed by :meth:`rapydli.comm.waiting.Pace.complete`, which leaves the core to
    backward while it waits, and spins once the caller blocks on the result; otherwise the
    blocking ``Allreduce`` (lowest latency: MPICH's ``Iallreduce`` runs slower
    schedule-based algorithms). Which of the two runs must not depend on timing: a
    blocking collective on one rank does not match a non-blocking one on another.
    """

    name = "mpi"

    def __init__(self, comm: MPI.Comm, pace: Pace = SPIN) -> None:
        super().__init__(comm)
        self.pace = pace

    def bind(self, comm: MPI.Comm, pace: Pace | None = None) -> MPIAlgorithm:
        return MPIAlgorithm(comm, pace or SPIN)

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        if flat.numel() == 0 or self.comm.Get_size() == 1:
            return
        if self.pace.polite:  # the same call on every rank: Allreduce and Iallreduce do not match
            self.pace.complete((self.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(flat), op=mpi_op(flat.dtype, op)),))
        else:
            self.comm.Allreduce(MPI.IN_PLACE, mpi_buffer(flat), op=mpi_op(flat.dtype, op))

    def prepare(self, flat: torch.Tensor, op: str) -> Callable[[], object] | None:
        """The blocking ``Allreduce`` bound to ``flat``'s address: no buffer conversion per call."""
        if self.pace.polite or flat.numel() == 0 or self.comm.Get_size() == 1:
            return None
        return partial(self.comm.Allreduce, MPI.IN_PLACE, address_buffer(flat), mpi_op(flat.dtype, op))
