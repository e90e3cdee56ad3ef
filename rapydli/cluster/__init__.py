"""Clusters of MPI engines driven from a notebook (the lowest layer: it alone starts processes).

``Cluster`` wraps ipyparallel's MPI engines; ``launchers`` names the ways to start them;
``job`` holds the failure semantics; ``engine`` is the code that runs on a rank;
``mpirun`` starts plain SPMD programs for benchmarks and tests; ``ensure`` decides which
cluster a call uses.
"""

from rapydli.cluster.cluster import Cluster, current
from rapydli.cluster.ensure import choose_cluster, ensure_cluster
from rapydli.cluster.job import Job
from rapydli.cluster.launchers import LAUNCHERS, get_launcher, validate_options
from rapydli.cluster.targets import parse_targets

__all__ = [
    "LAUNCHERS", "Cluster", "Job", "choose_cluster", "current", "ensure_cluster", "get_launcher", "parse_targets", "validate_options",
]  # fmt: skip
