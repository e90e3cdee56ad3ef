"""The engine program of batch jobs: MPI is initialised first, then ipyparallel's engine runs.

Under ``srun --mpi=pmi2`` each engine reaches Slurm's PMI server through an inherited
file descriptor (``PMI_FD``). ipyparallel's engine opens and closes many descriptors
while it starts (sockets, its nanny, bytecode caches), and an engine that initialised MPI
only later, in its first task, was seen sending a ``.pyc`` file's bytes to Slurm as PMI
requests (``mpi/pmi2: invalid client request``, then UCX aborting on a garbled address).
Initialising MPI here, before anything else, uses the descriptor while it is still the
one srun passed.
"""

from ipyparallel.engine.app import main
from mpi4py import MPI  # noqa: F401 - MPI_Init_thread runs at import

if __name__ == "__main__":
    main()
