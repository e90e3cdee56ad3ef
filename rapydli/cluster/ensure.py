"""Which cluster a call uses, and making it usable: the one place that decides both.

Every front end and experiment that takes ``cluster=None`` (``rd.train``, ``rd.sweep``,
``rd.scaling_study``, the hyperparameter panel, ``%%distributed``) asks
:func:`choose_cluster` (or :func:`ensure_cluster`), so they all follow the same rule:

1. the cluster given;
2. else the cluster this process holds (:func:`~rapydli.cluster.cluster.current`:
   ``%rapydli start``, ``rd.Cluster(...).start()``, ``rd.Cluster.attach(id)``), the most
   recently started one, whatever its state;
3. else a new local cluster of ``n`` engines, which the call owns and stops when it ends.

A cluster given or held with fewer engines than the call needs is refused with a message,
not replaced by a second cluster behind the user's back. :func:`ready` then makes the
chosen cluster usable, the same way for every caller:

* ``starting`` (``%rapydli start --no-wait``, a batch job in the queue): waited for;
  its start's error, if it fails, is raised;
* ``degraded`` (an engine died) or ``dead`` (aborted after a rank blocked): restarted,
  saying so: fresh engines, the variables defined on the old ones are gone (what
  ``%%distributed`` has always done; a run could not use the cluster otherwise);
* ``stopped``: started, saying so.

Examples
--------
>>> with ensure_cluster(None, n=2) as cluster:  # doctest: +SKIP
...     cluster.run(lambda: 1)
[1, 1]
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rapydli.cluster.cluster import Cluster, current
from rapydli.errors import ConfigError


def _say(text: str) -> None:
    print(f"[rapydli] {text}", flush=True)


def choose_cluster(
    cluster: Cluster | None = None,
    n: int = 2,
    *,
    need: int = 1,
    start: bool = True,
    say: Callable[[str], None] = _say,
) -> tuple[Cluster, bool]:
    """The cluster a call uses, and whether the call owns it (started it and must stop it).

    Parameters
    ----------
    cluster
        The cluster the caller was given, or ``None``.
    n
        Engines of the local cluster started when none is given or held.
    need
        Engines the call needs; a given or held cluster with fewer is refused.
    start
        Make the chosen cluster usable now (:func:`ready`). ``False`` leaves that to the
        caller (``rd.train`` does it inside its run, so that Ctrl-C meanwhile is recorded
        on the run).
    say
        Where :func:`ready` says that it waits or restarts (default: printed).

    Raises
    ------
    ConfigError
        The given or held cluster has fewer than ``need`` engines.
    """
    held = current()
    chosen = cluster if cluster is not None else held
    source = "the cluster running in this kernel" if chosen is held else "the cluster given"
    owned = chosen is None
    if chosen is None:
        chosen = Cluster(n=max(n, need))
    elif chosen.n < need:
        raise ConfigError(
            f"this needs {need} engines and {source} has {chosen.n}: "
            f"stop it (`%rapydli stop`, cluster.stop()) and start one of {need}, or pass cluster= a larger one"
        )
    if start:
        ready(chosen, say)
    return chosen, owned


def ready(cluster: Cluster, say: Callable[[str], None] = _say) -> Cluster:
    """Make ``cluster`` usable: wait for a start under way, restart dead engines, start a stopped one.

    Raises
    ------
    ClusterError
        The start (waited for or begun here) or the restart failed.
    KeyboardInterrupt
        Ctrl-C while waiting; a start under way in the background goes on.
    """
    status = cluster.status()
    state = status["state"]
    if state == "starting":
        say(f"waiting for the {cluster.n} engines of the cluster being started ...")
        cluster.wait_started()
    elif state in ("degraded", "dead"):
        dead = sorted(set(range(cluster.n)) - set(status["ranks"]))
        which = (
            f"{'rank' if len(dead) == 1 else 'ranks'} {', '.join(map(str, dead))}"
            if dead and state == "degraded"
            else "the engines"
        )
        say(
            f"{which} of the cluster had died; restarting {cluster.n} fresh engines (variables defined on them are gone)"
        )
        cluster.restart()
    if not cluster.running:
        say(f"starting {cluster.n} engines ({cluster.launcher.name} launcher) ...")
        cluster.start()
    return cluster


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
