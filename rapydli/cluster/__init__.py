"""Clusters of MPI engines driven from a notebook (the lowest layer: it alone starts processes).

``Cluster`` wraps ipyparallel's MPI engines; ``launchers`` names the ways to start them;
``job`` holds the failure semantics; ``engine`` is the code that runs on a rank;
``mpirun`` starts plain SPMD programs for benchmarks and tests.
"""

from rapydli.cluster.cluster import Cluster, current
from rapydli.cluster.job import Job
from rapydli.cluster.launchers import LAUNCHERS, get_launcher, validate_options
from rapydli.cluster.targets import parse_targets

__all__ = ["LAUNCHERS", "Cluster", "Job", "current", "get_launcher", "parse_targets", "validate_options"]
