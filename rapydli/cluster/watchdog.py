"""A cluster held by a kernel or a script ends with it: a watchdog process per held cluster.

A :class:`~rapydli.cluster.Cluster` that a process starts and does not detach is that
process's: ipyparallel stops it when the process exits normally, but a kernel that
crashes or is killed (``kill -9``, the OOM killer, "Restart kernel" after a hang) runs no
exit handler, and its controller, ``mpiexec`` and engines would go on (ranks blocked in a
collective spin and keep their memory until someone finds them).

So each held cluster has a :class:`Watchdog`: a small process in a session of its own whose
standard input is a pipe from the holder. The holder never writes to it until it lets the
cluster go: :data:`STOPPED` (it stopped the cluster itself) or :data:`DETACHED` (the cluster
outlives it, :meth:`~rapydli.cluster.Cluster.detach`), and the watchdog exits. When the
holder dies, the kernel closes the pipe; the watchdog reads end-of-file and stops the
cluster from outside (:func:`rapydli.cluster.registry.stop_cluster`: the controller, the
engine launchers, the engines, a batch job, every process carrying the cluster's marker),
within seconds. The pipe is not inherited by the programs the holder starts (close-on-exec);
a child the holder forks without ``exec`` keeps it open, and the cluster lives as long as
that child does.

Every process of a held cluster also carries :data:`HOLDER_MARKER` (the holder's pid and
start time, :func:`holder_value`), so ``rapydli cluster status`` tells a held cluster from an
orphan even if its watchdog was killed too, and ``rapydli cluster stop --all`` stops orphans.

Run as ``python -m rapydli.cluster.watchdog CLUSTER_ID`` (only :meth:`Watchdog.start` does).
"""

from __future__ import annotations

import os
import subprocess
import sys

#: The environment variable each process of a held cluster carries: ``<pid>:<start time>`` of its holder.
HOLDER_MARKER = "RAPYDLI_HOLDER"
#: What the holder writes when it stopped the cluster itself: the watchdog exits, leaving nothing to do.
STOPPED = "stopped"
#: Seconds the processes of a cluster whose holder died get to exit on SIGTERM before SIGKILL.
STOP_GRACE_S = 2.0
#: What the holder writes when the cluster outlives it (detached): the watchdog exits, the cluster stays.
DETACHED = "detached"


def holder_value(pid: int | None = None) -> str:
    """``<pid>:<start time>`` of process ``pid`` (default: this one), what :data:`HOLDER_MARKER` holds.

    The start time tells this process from a later one that got the same pid.
    """
    from rapydli.cluster.processes import started_at

    pid = os.getpid() if pid is None else pid
    return f"{pid}:{started_at(pid) or 0:.2f}"


def holder_alive(value: str) -> bool:
    """Whether the holder named by ``value`` (:func:`holder_value`) is still running."""
    pid, _, _ = value.partition(":")
    return pid.isdigit() and holder_value(int(pid)) == value


class Watchdog:
    """The watchdog of one held cluster, seen from its holder.

    Examples
    --------
    >>> dog = Watchdog.start("1765000000-abcd")  # doctest: +SKIP
    >>> dog.release(STOPPED)  # the holder stopped the cluster itself  # doctest: +SKIP
    """

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self.process = process

    @classmethod
    def start(cls, cluster_id: str) -> Watchdog:
        """Start the watchdog of cluster ``cluster_id``; it stops the cluster when this process dies."""
        from rapydli.cluster.processes import CLUSTER_MARKER

        env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_MARKER, HOLDER_MARKER)}  # reaped by no one
        process = subprocess.Popen(
            [sys.executable, "-m", "rapydli.cluster.watchdog", cluster_id],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C or a signal to the kernel's group does not reach it
            env=env,
        )
        return cls(process)

    @property
    def watching(self) -> bool:
        """Whether the watchdog still runs."""
        return self.process.poll() is None

    def release(self, word: str) -> None:
        """Let the cluster go (:data:`STOPPED` or :data:`DETACHED`): the watchdog exits without acting."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.write(f"{word}\n".encode())
                self.process.stdin.close()
        except (BrokenPipeError, OSError, ValueError):  # it had exited: nothing to tell
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def main(argv: list[str]) -> int:
    """Wait for the holder's word; on end-of-file (the holder died) stop cluster ``argv[0]``."""
    (cluster_id,) = argv
    word = sys.stdin.readline().strip()
    if word in (STOPPED, DETACHED):
        return 0
    from rapydli.cluster.registry import stop_cluster
    from rapydli.errors import NotFoundError

    try:  # nobody will read its engines' results: a short grace, then SIGKILL (ranks blocked in a collective ignore SIGTERM)
        stop_cluster(cluster_id, timeout=STOP_GRACE_S)
    except NotFoundError:  # it was gone already (stopped as the holder exited normally)
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
