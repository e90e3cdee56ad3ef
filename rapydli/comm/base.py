"""The allreduce algorithm interface and its registry by name.

An algorithm is bound to one mpi4py communicator and reduces a flat, contiguous tensor in
place. Built-in algorithms are registered by import path, so naming one does not import
the others (``gloo``/``nccl`` pull in ``torch.distributed`` only when used)::

    from rapydli.comm.base import register_algorithm
    register_algorithm("mine", "mypackage.allreduce:MyAlgorithm")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch

from rapydli.comm.registry import ALGORITHMS
from rapydli.comm.tensors import byte_array
from rapydli.errors import ConfigError

if TYPE_CHECKING:
    from mpi4py import MPI

    from rapydli.comm.handle import Handle
    from rapydli.comm.waiting import Pace


class Algorithm:
    """Base class: an allreduce algorithm over one MPI communicator.

    Subclasses implement :meth:`allreduce_` for ``op`` in ``sum``, ``max``, ``min``
    (``avg`` reduces like ``sum`` and the :class:`~rapydli.comm.Communicator` divides
    afterwards, unless :meth:`averages_for` says the algorithm did). Those with their own
    asynchronous engine (torch.distributed) set ``native_async`` and implement
    :meth:`iallreduce_`; the others are run by the communicator's communication thread.

    Parameters
    ----------
    comm
        The mpi4py communicator the algorithm works over.
    """

    name: ClassVar[str] = ""
    #: True when :meth:`iallreduce_` progresses on its own (no communication thread needed).
    native_async: ClassVar[bool] = False
    #: True when :meth:`allreduce_` divides ``avg`` itself (no second pass over the result).
    averages: ClassVar[bool] = False
    #: Devices whose tensors the algorithm reduces directly; others are staged through host memory.
    device_types: ClassVar[frozenset[str]] = frozenset({"cpu"})

    def __init__(self, comm: MPI.Comm) -> None:
        self.comm = comm

    def bind(self, comm: MPI.Comm, pace: Pace | None = None) -> Algorithm:
        """The same algorithm over another communicator (used for the asynchronous one).

        ``pace``: how to wait for requests (:class:`rapydli.comm.waiting.Pace`: politely
        while the caller computes); used on the communication thread.
        """
        return type(self)(comm)

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        """Reduce ``flat`` (1-D, contiguous) in place across the communicator."""
        raise NotImplementedError

    def averages_for(self, flat: torch.Tensor) -> bool:
        """True when ``allreduce_(flat, "avg")`` (and its prepared call) divides by itself."""
        return self.averages

    def prepare(self, flat: torch.Tensor, op: str) -> Callable[[], object] | None:
        """A zero-argument call that reduces ``flat``'s memory again, for repeated calls on one buffer.

        The call must hold no reference to ``flat`` (the caller checks that the tensor is
        alive and still owns the same memory before each use). ``None`` (the default):
        the algorithm has no such shortcut and :meth:`allreduce_` runs every time.
        """
        return None

    def iallreduce_(self, flat: torch.Tensor, op: str) -> Handle:
        """Start reducing ``flat``; only for ``native_async`` algorithms."""
        raise NotImplementedError(f"{self.name} has no native asynchronous allreduce")

    def broadcast_(self, flat: torch.Tensor, root: int) -> None:
        """Copy ``root``'s ``flat`` to every rank (MPI ``Bcast`` on the tensor's bytes)."""
        from mpi4py import MPI

        if flat.numel():
            self.comm.Bcast([byte_array(flat), MPI.BYTE], root=root)

    def choose(self, flat: torch.Tensor) -> str:
        """The name of the algorithm that actually runs for ``flat`` (``auto`` overrides)."""
        return self.name


def register_algorithm(name: str, factory: str | Callable[[MPI.Comm], Algorithm]) -> None:
    """Register ``factory`` (a callable or ``"module:attribute"``) under ``name``."""
    ALGORITHMS.register(name, factory)


def algorithm_names() -> list[str]:
    """Registered algorithm names, sorted."""
    return ALGORITHMS.names()


def check_algorithm(name: str) -> str:
    """Return ``name`` if registered, else raise :class:`ConfigError` listing the allowed names."""
    if name not in ALGORITHMS.names():
        raise ConfigError(f"algorithm={name!r} is invalid: allowed algorithms are {', '.join(algorithm_names())}")
    return name


def create_algorithm(name: str, comm: MPI.Comm) -> Algorithm:
    """Instantiate the algorithm registered as ``name`` over ``comm`` (collective for some)."""
    return ALGORITHMS.load(check_algorithm(name))(comm)


def node_rank(comm: MPI.Comm) -> tuple[int, int]:
    """``(rank among the ranks of comm on this node, how many there are)`` (collective)."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank(), node.Get_size()
    finally:
        node.Free()
