"""The allreduce algorithms by name (light: naming one imports nothing heavy).

Third-party algorithms register in the ``rapydli.allreduce`` entry-point group, or with
:func:`rapydli.comm.base.register_algorithm`; ``TrainConfig.allreduce`` and the command
line accept every registered name.
"""

from rapydli.registry import Registry

ALGORITHMS = Registry(
    "allreduce algorithm",
    {
        "mpi": "rapydli.comm.mpi:MPIAlgorithm",
        "ring": "rapydli.comm.ring:RingAlgorithm",
        "gloo": "rapydli.comm.torchdist:GlooAlgorithm",
        "nccl": "rapydli.comm.torchdist:NcclAlgorithm",
        "auto": "rapydli.comm.auto:AutoAlgorithm",
        "shm": "rapydli.comm.shm:SharedMemoryAlgorithm",
    },
    group="rapydli.allreduce",
)
