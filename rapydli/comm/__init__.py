"""rapydli.comm: collectives on torch tensors over MPI, and gradient synchronisation.

``Communicator`` runs in-place ``allreduce_``/``iallreduce_``/``broadcast_`` with an
algorithm chosen by name (``mpi``, ``ring``, ``shm``, ``gloo``, ``nccl``, ``auto``);
``GradientSynchronizer`` averages a model's gradients in buckets that are reduced while
backward still runs, as DDP does.
"""

from __future__ import annotations

from typing import Any

from rapydli.lazy import LazyExports

__all__ = [
    "Communicator",
    "GradientSynchronizer",
    "Handle",
    "SyncStats",
    "algorithm_names",
    "register_algorithm",
]

_LAZY = {
    "Communicator": "rapydli.comm.communicator",
    "GradientSynchronizer": "rapydli.comm.synchronizer",
    "SyncStats": "rapydli.comm.synchronizer",
    "Handle": "rapydli.comm.handle",
    "algorithm_names": "rapydli.comm.base",
    "register_algorithm": "rapydli.comm.base",
}


_exports = LazyExports(__name__, _LAZY, globals(), also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()
