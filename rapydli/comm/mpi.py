"""``mpi``: the MPI library's own ``Allreduce`` on the tensor's memory.

The vendor implementation is tuned for its network and message sizes. ``float16`` and
``bfloat16`` have no MPI datatype; they are reduced by a user-defined MPI operation that
applies torch to 2-byte words (:func:`rapydli.comm.tensors.mpi_op`), which is correct but
slower than the ring's built-in torch reduction.
"""

from __future__ import annotations

import torch

from rapydli.comm.base import Algorithm
from rapydli.comm.tensors import mpi_buffer, mpi_op


class MPIAlgorithm(Algorithm):
    """mpi4py ``Allreduce`` in place on the tensor's buffer.

    The blocking call is used on the communication thread too: MPICH's ``Iallreduce``
    runs schedule-based algorithms that are slower than its ``Allreduce``, and the thread
    already provides the asynchrony.
    """

    name = "mpi"

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        from mpi4py import MPI

        if flat.numel() == 0 or self.comm.Get_size() == 1:
            return
        self.comm.Allreduce(MPI.IN_PLACE, mpi_buffer(flat), op=mpi_op(flat.dtype, op))
