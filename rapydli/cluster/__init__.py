"""Clusters of MPI engines driven from a notebook (the lowest layer: it alone starts processes).

``Cluster`` wraps ipyparallel's MPI engines; ``launchers`` names the ways to start them;
``job`` holds the failure semantics; ``engine`` is the code that runs on a rank;
``mpirun`` starts plain SPMD programs for benchmarks and tests; ``ensure`` decides which
cluster a call uses; ``processes`` finds and ends the processes a cluster started.

Names are imported lazily: ``rapydli.cluster.processes`` (the run store asks it whether
a pid is alive) does not pull ipyparallel in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rapydli.lazy import LazyExports

# public name -> module that defines it
_LAZY: dict[str, str] = {
    "Cluster": "rapydli.cluster.cluster",
    "current": "rapydli.cluster.cluster",
    "choose_cluster": "rapydli.cluster.ensure",
    "ensure_cluster": "rapydli.cluster.ensure",
    "ready": "rapydli.cluster.ensure",
    "Job": "rapydli.cluster.job",
    "LAUNCHERS": "rapydli.cluster.launchers",
    "get_launcher": "rapydli.cluster.launchers",
    "validate_options": "rapydli.cluster.launchers",
    "parse_targets": "rapydli.cluster.targets",
}

__all__ = [
    "LAUNCHERS", "Cluster", "Job", "choose_cluster", "current", "ensure_cluster", "get_launcher", "parse_targets", "ready",
    "validate_options",
]  # fmt: skip


_exports = LazyExports(__name__, _LAZY, globals(), also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()


if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from rapydli.cluster.cluster import Cluster, current
    from rapydli.cluster.ensure import choose_cluster, ensure_cluster, ready
    from rapydli.cluster.job import Job
    from rapydli.cluster.launchers import LAUNCHERS, get_launcher, validate_options
    from rapydli.cluster.targets import parse_targets
