"""rapydli.comm: collectives on torch tensors over MPI, and gradient synchronisation.

``Communicator`` runs in-place ``allreduce_``/``iallreduce_``/``broadcast_`` with an
algorithm chosen by name (``mpi``, ``ring``, ``shm``, ``gloo``, ``nccl``, ``auto``);
``GradientSynchronizer`` averages a model's gradients in buckets that are reduced while
backward still runs, as DDP does.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

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


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'rapydli.comm' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
