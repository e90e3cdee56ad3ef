"""``rapydli cluster start|status|stop``: clusters that outlive the command.

``start`` launches the engines, detaches them and prints the id; a notebook connects
with ``rd.Cluster.attach(ID)``; ``stop ID`` (or ``--all``) shuts them down.
"""

from __future__ import annotations

import json

import click
import pandas as pd

from rapydli.cluster import Cluster


def _options(items: tuple[str, ...]) -> dict[str, object]:
    options: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not key=value", param_hint="OPTIONS")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@click.group()
def cluster() -> None:
    """Start, inspect and stop MPI engine clusters."""


@cluster.command()
@click.option("-n", "n", type=int, default=2, show_default=True, help="number of engines (MPI ranks)")
@click.option("--launcher", default="local", show_default=True, help="local, ssh, slurm or pbs")
@click.option("--threads", type=int, default=None, help="threads per engine (default cores // n)")
@click.argument("options", nargs=-1)
def start(n: int, launcher: str, threads: int | None, options: tuple[str, ...]) -> None:
    """Start N engines and leave them running; OPTIONS are launcher options as key=value."""
    started = Cluster(n=n, launcher=launcher, threads=threads, **_options(options))
    click.echo(f"starting {n} engines ({launcher}) ...", err=True)
    started.start()
    cluster_id = started.detach()
    click.echo(cluster_id)
    click.echo(f"connect from a notebook with rd.Cluster.attach({cluster_id!r}); stop with `rapydli cluster stop {cluster_id}`", err=True)


@cluster.command()
def status() -> None:
    """List every running cluster: started here (detached) or held by a kernel or script."""
    import time

    from rapydli.cluster.registry import running_clusters

    records = running_clusters()
    if not records:
        click.echo("no clusters")
        return
    table = pd.DataFrame(
        [
            {"id": r["id"], "origin": r["origin"], "launcher": r["launcher"], "n": r["n"],
             "engines_alive": r["engines_alive"], "hosts": ",".join(r["hosts"]),
             "uptime_s": round(time.time() - r["started"])}
            for r in records
        ]
    )
    click.echo(table.to_string(index=False))


@cluster.command()
@click.argument("cluster_ids", nargs=-1)
@click.option("--all", "stop_all", is_flag=True, help="stop every cluster started here")
def stop(cluster_ids: tuple[str, ...], stop_all: bool) -> None:
    """Stop the clusters CLUSTER_IDS (or --all)."""
    ids = [r["id"] for r in Cluster.detached()] if stop_all else list(cluster_ids)
    if not ids:
        raise click.UsageError("name a cluster id (see `rapydli cluster status`) or pass --all")
    for cluster_id in ids:
        Cluster.attach(cluster_id).forget()
        click.echo(f"stopped {cluster_id}")
