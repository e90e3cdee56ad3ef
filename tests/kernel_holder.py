"""A process that holds a cluster as a kernel does, to be killed as a crashing kernel dies (``tests/test_cluster_holder.py``).

``python tests/kernel_holder.py idle`` starts ``rd.Cluster(n=2)``, prints its id and waits;
with ``blocked`` it first leaves its ranks blocked in a collective (rank 0 in a barrier that
rank 1, asleep, never joins), as a hung training run does. It never stops the cluster itself.
"""

from __future__ import annotations

import sys
import time

import rapydli as rd


def stuck_in_a_barrier() -> None:
    from rapydli.cluster.engine import context

    ctx = context()
    if ctx.rank == 0:
        ctx.comm.Barrier()  # rank 1 never comes
    else:
        time.sleep(3600)


def main(mode: str) -> None:
    cluster = rd.Cluster(n=2).start()
    if mode == "blocked":
        cluster.submit(stuck_in_a_barrier, on_output=None)
        time.sleep(1.0)  # the task has reached the ranks
    print(cluster.status()["cluster_id"], flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(sys.argv[1])
