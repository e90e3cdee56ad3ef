"""Which cluster a call uses: the one place that decides it.

Every front end and experiment that takes ``cluster=None`` (``rd.train``, ``rd.sweep``,
``rd.scaling_study``, the hyperparameter panel, ``%%distributed``) asks
:func:`ensure_cluster`, so they all follow the same rule:

1. the cluster given (started first if it is not running; its owner stops it);
2. else the cluster running in this process (``%rapydli start``, ``rd.Cluster(...).start()``,
   ``rd.Cluster.attach(id)``), the most recently started one;
3. else a new local cluster of ``n`` engines, which the call owns and stops when it ends.

A running cluster with fewer engines than the call needs is refused with a message, not
replaced by a second cluster behind the user's back.

Examples
--------
>>> with ensure_cluster(None, n=2) as cluster:  # doctest: +SKIP
...     cluster.run(lambda: 1)
[1, 1]
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rapydli.cluster.cluster import Cluster, current
from rapydli.errors import ConfigError


def choose_cluster(
    cluster: Cluster | None = None, n: int = 2, *, need: int = 1, start: bool = True
) -> tuple[Cluster, bool]:
    """The cluster a call uses, and whether the call owns it (started it and must stop it).

    Parameters
    ----------
    cluster
        The cluster the caller was given, or ``None``.
    n
        Engines of the local cluster started when none is given or running.
    need
        Engines the call needs; a given or running cluster with fewer is refused.
    start
        Start the chosen cluster if it is not running. ``False`` leaves that to the caller
        (``rd.train`` starts it inside its run, so that Ctrl-C during the start is
        recorded on the run).

    Raises
    ------
    ConfigError
        The given or running cluster has fewer than ``need`` engines.
    """
    chosen = cluster
    source = "the cluster given"
    if chosen is None:
        chosen, source = current(), "the cluster running in this kernel"
    if chosen is None:
        new = Cluster(n=max(n, need))
        return (new.start() if start else new), True
    if chosen.n < need:
        raise ConfigError(
            f"this needs {need} engines and {source} has {chosen.n}: "
            f"stop it (`%rapydli stop`, cluster.stop()) and start one of {need}, or pass cluster= a larger one"
        )
    if start and not chosen.running:
        chosen.start()
    return chosen, False


@contextmanager
def ensure_cluster(
    cluster: Cluster | None = None, n: int = 2, *, need: int = 1, start: bool = True
) -> Iterator[Cluster]:
    """:func:`choose_cluster` as a context: a cluster the call owns is stopped when it ends."""
    chosen, owned = choose_cluster(cluster, n, need=need, start=start)
    try:
        yield chosen
    finally:
        if owned:
            chosen.stop()
