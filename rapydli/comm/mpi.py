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
from rapydli.comm.waiting import complete


class MPIAlgorithm(Algorithm):
    """mpi4py ``Allreduce`` in place on the tensor's buffer.

    With ``polite`` (the instance on the communication thread) it is ``Iallreduce``
    completed by :func:`rapydli.comm.waiting.complete`, which leaves the core to backward
    while it waits; otherwise the blocking ``Allreduce`` (lowest latency).
    """

    name = "mpi"

    def __init__(self, comm: MPI.Comm, polite: bool = False) -> None:
        super().__init__(comm)
        self.polite = polite

    def bind(self, comm: MPI.Comm, polite: bool = False) -> MPIAlgorithm:
        return MPIAlgorithm(comm, polite)

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        if flat.numel() == 0 or self.comm.Get_size() == 1:
            return
        if self.polite:
            complete((self.comm.Iallreduce(MPI.IN_PLACE, mpi_buffer(flat), op=mpi_op(flat.dtype, op)),), True)
        else:
            self.comm.Allreduce(MPI.IN_PLACE, mpi_buffer(flat), op=mpi_op(flat.dtype, op))

    def prepare(self, flat: torch.Tensor, op: str) -> Callable[[], object] | None:
        """The blocking ``Allreduce`` bound to ``flat``'s address: no buffer conversion per call."""
        if self.polite or flat.numel() == 0 or self.comm.Get_size() == 1:
            return None
        return partial(self.comm.Allreduce, MPI.IN_PLACE, address_buffer(flat), mpi_op(flat.dtype, op))
