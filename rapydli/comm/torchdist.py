"""``gloo`` and ``nccl``: torch.distributed collectives, for comparison and for GPUs.

The process group is set up from the MPI communicator, so users never export
``MASTER_ADDR``/``MASTER_PORT``: rank 0 picks a free TCP port on its host and broadcasts
the address over MPI. If torch.distributed is already initialised over the same ranks
(e.g. by code that also uses DDP), a new group of the wanted backend is made on top of it.
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from rapydli.comm.base import Algorithm, node_rank
from rapydli.comm.handle import Handle, WorkHandle
from rapydli.errors import ConfigError

if TYPE_CHECKING:
    from mpi4py import MPI

    from rapydli.comm.waiting import Pace

_GROUPS: dict[tuple[str, int], Any] = {}


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def process_group(comm: MPI.Comm, backend: str, timeout: float = 300.0) -> Any:
    """A torch.distributed group of ``backend`` over the ranks of ``comm`` (collective; cached)."""
    import torch.distributed as dist

    key = (backend, comm.Get_size())
    if key in _GROUPS:
        return _GROUPS[key]
    if not dist.is_initialized():
        hosts = comm.allgather(socket.gethostname())
        address = None
        if comm.Get_rank() == 0:
            host = "127.0.0.1" if len(set(hosts)) == 1 else socket.getfqdn()
            address = f"tcp://{host}:{_free_port()}"
        address = comm.bcast(address, root=0)
        dist.init_process_group(
            backend,
            init_method=address,
            rank=comm.Get_rank(),
            world_size=comm.Get_size(),
            timeout=timedelta(seconds=timeout),
        )
        group = dist.group.WORLD
    elif dist.get_world_size() == comm.Get_size():
        group = dist.group.WORLD if dist.get_backend() == backend else dist.new_group(backend=backend)
    else:
        raise ConfigError(
            f"torch.distributed is already initialised over {dist.get_world_size()} ranks, but this "
            f"communicator has {comm.Get_size()}: use algorithm 'mpi' or 'ring' on sub-communicators"
        )
    _GROUPS[key] = group
    return group


class TorchDistAlgorithm(Algorithm):
    """Allreduce with ``torch.distributed`` (asynchronous work runs on the backend's own threads)."""

    backend = "gloo"
    native_async = True

    def __init__(self, comm: MPI.Comm) -> None:
        import torch.distributed as dist

        super().__init__(comm)
        if not dist.is_available():
            raise ConfigError(f"algorithm={self.name!r} needs torch.distributed, which this torch build lacks")
        self.group = process_group(comm, self.backend)

    def bind(self, comm: MPI.Comm, pace: Pace | None = None) -> Algorithm:
        return self

    def _op(self, op: str) -> Any:
        from torch.distributed import ReduceOp

        return {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]

    def allreduce_(self, flat: torch.Tensor, op: str) -> None:
        import torch.distributed as dist

        if flat.numel():
            dist.all_reduce(flat, op=self._op(op), group=self.group)

    def iallreduce_(self, flat: torch.Tensor, op: str) -> Handle:
        import torch.distributed as dist

        work = dist.all_reduce(flat, op=self._op(op), group=self.group, async_op=True) if flat.numel() else None
        return WorkHandle(flat, self.name, work if work is not None else _Done())

    def broadcast_(self, flat: torch.Tensor, root: int) -> None:
        import torch.distributed as dist

        if flat.numel():
            dist.broadcast(flat, src=root, group=self.group)


class _Done:
    """Work of an empty tensor: already complete."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


class GlooAlgorithm(TorchDistAlgorithm):
    """torch.distributed with the gloo backend (CPU tensors)."""

    name = "gloo"
    backend = "gloo"


class NcclAlgorithm(TorchDistAlgorithm):
    """torch.distributed with the NCCL backend (CUDA tensors only)."""

    name = "nccl"
    backend = "nccl"
    device_types = frozenset({"cuda"})

    def __init__(self, comm: MPI.Comm) -> None:
        import torch.distributed as dist

        if not (torch.cuda.is_available() and dist.is_nccl_available()):
            raise ConfigError("algorithm='nccl' needs CUDA GPUs and a torch build with NCCL; use 'mpi' or 'ring'")
        local_rank, local_size = node_rank(comm)
        if local_size > torch.cuda.device_count():
            raise ConfigError(
                f"algorithm='nccl' needs a GPU of its own for every rank, but {local_size} ranks on this node share "
                f"{torch.cuda.device_count()} GPU(s) (NCCL refuses two ranks on one GPU); use 'auto', 'mpi' or 'ring', "
                "which stage CUDA tensors through host memory"
            )
        if not torch.cuda.is_initialized():
            torch.cuda.set_device(local_rank)
        super().__init__(comm)
