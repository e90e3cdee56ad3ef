"""``rapydli cluster start|status|stop``: clusters that outlive the command.

``start`` launches the engines, detaches them and prints the id; a notebook connects
with ``rd.Cluster.attach(ID)``; ``stop ID`` (or ``--all``) shuts them down.
"""

from __future__ import annotations

import json
from typing import Any

import click
import pandas as pd

from rapydli.cli.group import Group
from rapydli.cluster import Cluster
from rapydli.cluster.launchers import DEFAULT_LAUNCHER, LAUNCHERS
from rapydli.cluster.registry import stop_cluster
from rapydli.paths import subdir


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """Launcher options given as ``key=value`` (values read as JSON when they parse)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not key=value", param_hint="OPTIONS")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


@click.group(cls=Group)
def cluster() -> None:
    """Start, inspect and stop MPI engine clusters."""


@cluster.command()
@click.option("-n", "n", type=int, default=2, show_default=True, help="number of engines (MPI ranks)")
@click.option(
    "--launcher", default=DEFAULT_LAUNCHER, show_default=True, help=f"how the engines start: {', '.join(LAUNCHERS)}"
)
@click.option("--threads", type=int, default=None, help="threads per engine (default cores // n)")
@click.option(
    "--timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="seconds to wait for the engines (a queued job is cancelled)",
)
@click.argument("options", nargs=-1, metavar="[KEY=VALUE]...")
def start(n: int, launcher: str, threads: int | None, timeout: float, options: tuple[str, ...]) -> None:
    """Start N engines and leave them running; KEY=VALUE pairs are launcher options (values read as JSON when they parse)."""
    started = Cluster(n=n, launcher=launcher, threads=threads, start_timeout=timeout, **parse_options(options))
    click.echo(f"starting {n} engines ({launcher}) ...", err=True)

    recorded: list[str] = []

    def queued(job: dict[str, object]) -> None:  # `rapydli cluster status` shows the job meanwhile
        click.echo(f"job {job['id']}: {job['state']} ({job['reason']})", err=True)
        started.write_record("starting")
        recorded[:] = [str(started.status()["cluster_id"])]

    try:
        started.start(on_state=queued)
    except BaseException:
        for cluster_id in recorded:  # a start that failed or was interrupted lists nothing
            (subdir("clusters") / f"{cluster_id}.json").unlink(missing_ok=True)
        raise
    cluster_id = started.detach()
    click.echo(cluster_id)
    click.echo(
        f"connect from a notebook with rd.Cluster.attach({cluster_id!r}); stop with `rapydli cluster stop {cluster_id}`",
        err=True,
    )


def _job_text(job: dict[str, str] | None) -> str:
    if not job:
        return "-"
    reason = f" ({job['reason']})" if job.get("reason") not in ("", "None") else ""
    return f"{job['id']} {job['state']}{reason}"


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
            {
                "id": r["id"],
                "origin": r["origin"] if r.get("held", True) else "kernel (gone)",
                "launcher": r["launcher"],
                "n": r["n"],
                "state": r.get("state", "running"),
                "engines_alive": r["engines_alive"],
                "hosts": ",".join(r["hosts"]),
                "uptime_s": round(time.time() - r["started"]),
                "job": _job_text(r.get("job")),
            }
            for r in records
        ]
    )
    click.echo(table.to_string(index=False))


@cluster.command()
@click.argument("cluster_ids", nargs=-1)
@click.option(
    "--all",
    "stop_all",
    is_flag=True,
    help="stop every cluster started here (detached) and every one whose kernel or script is gone",
)
def stop(cluster_ids: tuple[str, ...], stop_all: bool) -> None:
    """Stop the clusters CLUSTER_IDS (or --all), all at once: each stop mostly waits for processes to end.

    ``--all`` leaves the clusters a running kernel or script holds (they are theirs to stop), saying so.
    """
    from concurrent.futures import ThreadPoolExecutor

    from rapydli.cluster.registry import running_clusters

    if not stop_all and not cluster_ids:
        raise click.UsageError("name a cluster id (see `rapydli cluster status`) or pass --all")
    ids = list(cluster_ids)
    if stop_all:
        found = {r["id"]: r for r in running_clusters()}
        held = [i for i, r in found.items() if r["origin"] == "kernel" and r.get("held", True)]
        ids = list(dict.fromkeys([*(r["id"] for r in Cluster.detached()), *(i for i in found if i not in held)]))
        for cluster_id in held:
            click.echo(f"left {cluster_id}: a running kernel or script holds it")
        if not ids:
            click.echo("no cluster to stop")
            return
    with ThreadPoolExecutor(max_workers=min(len(ids), 16)) as pool:
        futures = {cluster_id: pool.submit(stop_cluster, cluster_id) for cluster_id in ids}
    for cluster_id, future in futures.items():  # in the order given; the first error is raised after all were tried
        future.result()
        click.echo(f"stopped {cluster_id}")
