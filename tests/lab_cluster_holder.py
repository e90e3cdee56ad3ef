"""A process that holds a cluster as a kernel does (started, never detached), for the panel's
browser tests: ``python tests/lab_cluster_holder.py`` starts ``rd.Cluster(n=2)``, prints its
id, and stops it when its standard input closes (however its engines ended meanwhile)."""

from __future__ import annotations

import sys

import rapydli as rd


def main() -> None:
    cluster = rd.Cluster(n=2).start()
    print(cluster.status()["cluster_id"], flush=True)
    sys.stdin.read()
    cluster.stop()


if __name__ == "__main__":
    main()
