"""``rapydli bench cluster``: time from start to ready engines, RaPyDLI's launcher vs ipyparallel's own.

Runs against the Slurm the environment points at (``SLURM_CONF`` or the site's). Each
round starts and stops, one after the other (interleaved, so load drifts hit both):

* ``rapydli``: ``rd.Cluster(n, launcher="slurm", **options).start()``: the job is
  submitted, the engines register *and* are checked to be one MPI world of ``n`` ranks
  (``engine.setup``: MPI initialised, threads set, ranks and sizes compared), ready for
  ``%%distributed`` (torch and the trainer are imported behind the start, not waited for);
* ``ipyparallel``: ``ipp.Cluster(engines="slurm", n=n)`` with the same ``#SBATCH``
  layout, until ``n`` engines registered (ipyparallel's own readiness; its engines are
  not an MPI world under ``MpiDefault=none``).

Prints the medians and their ratio. Target: RaPyDLI <= 1.2x ipyparallel.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from typing import Any

import click

from rapydli.bench.report import emit

TARGET_RATIO = 1.2


def _ipyparallel_start(n: int, options: dict[str, Any], timeout: float) -> tuple[float, float]:
    """Seconds to ``n`` registered engines with ipyparallel's own Slurm launcher; and to stop."""
    import ipyparallel as ipp
    from traitlets.config import Config

    directives = {
        "nodes": "nodes", "ntasks_per_node": "ntasks-per-node", "cpus_per_task": "cpus-per-task",
        "partition": "partition", "account": "account", "qos": "qos", "timelimit": "time",
    }  # fmt: skip
    lines = [f"#SBATCH --{flag}={options[key]}" for key, flag in directives.items() if key in options]
    config = Config()
    config.SlurmEngineSetLauncher.batch_template = "\n".join(
        ["#!/bin/sh", "#SBATCH --export=ALL", "#SBATCH --job-name=ipengine-{cluster_id}", "#SBATCH --ntasks={n}",
         "#SBATCH --output={output_file}", *lines, "srun {program_and_args}", ""]
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-ipp-") as profile:
        config.SlurmEngineSetLauncher.batch_file_name = f"{profile}/ipp_engine.sh"
        start = time.perf_counter()
        cluster = ipp.Cluster(
            engines="slurm", n=n, controller_ip="*", profile_dir=profile, config=config, log_level=logging.ERROR
        )
        try:
            cluster.start_cluster_sync()
            client = cluster.connect_client_sync()
            client.wait_for_engines(n, timeout=timeout, block=True, widget=False, interactive=False)
            ready = time.perf_counter() - start
            client.close()
        finally:
            stop = time.perf_counter()
            cluster.stop_cluster_sync()
            stopped = time.perf_counter() - stop
    return ready, stopped


def _rapydli_start(n: int, options: dict[str, Any], timeout: float) -> tuple[float, float]:
    """Seconds to ``n`` ready RaPyDLI engines with the ``slurm`` launcher; and to stop (queue empty)."""
    from rapydli.cluster import Cluster

    cluster = Cluster(n=n, launcher="slurm", start_timeout=timeout, **options)
    start = time.perf_counter()
    try:
        cluster.start()
        ready = time.perf_counter() - start
    finally:
        stop = time.perf_counter()
        cluster.stop()
        stopped = time.perf_counter() - stop
    return ready, stopped


@click.command()
@click.option("-n", "--engines", "n", default=4, show_default=True, help="number of engines")
@click.option("--repeat", default=3, show_default=True, help="starts per launcher (interleaved)")
@click.option("--timeout", default=300.0, show_default=True, help="seconds to wait for the engines of one start")
@click.option("--json", "json_path", default=None, help="write the results as JSON to this path")
@click.argument("options", nargs=-1)
def command(n: int, repeat: int, timeout: float, json_path: str | None, options: tuple[str, ...]) -> None:
    """Cluster start time to ready engines: launcher slurm vs ipyparallel's engines="slurm".

    OPTIONS are slurm launcher options as key=value (e.g. nodes=2 ntasks_per_node=2
    partition=debug); the ipyparallel side gets the same #SBATCH layout.
    """
    from rapydli.cli.cluster import parse_options
    from rapydli.cluster import launchers

    slurm_options = launchers.validate_options("slurm", parse_options(options))
    runs: dict[str, list[tuple[float, float]]] = {"rapydli": [], "ipyparallel": []}
    for _ in range(repeat):
        runs["rapydli"].append(_rapydli_start(n, slurm_options, timeout))
        runs["ipyparallel"].append(_ipyparallel_start(n, slurm_options, timeout))
    rows: list[dict[str, Any]] = [
        {
            "launcher": name,
            "engines": n,
            "median_start_s": statistics.median(r for r, _ in samples),
            "min_start_s": min(r for r, _ in samples),
            "max_start_s": max(r for r, _ in samples),
            "median_stop_s": statistics.median(s for _, s in samples),
            "starts": len(samples),
        }
        for name, samples in runs.items()
    ]
    ratio = rows[0]["median_start_s"] / rows[1]["median_start_s"]
    summary = {
        "options": slurm_options,
        "rapydli_over_ipyparallel": ratio,
        "target": f"rapydli <= {TARGET_RATIO}x ipyparallel: {'met' if ratio <= TARGET_RATIO else 'NOT met'}",
    }
    emit("cluster", rows, summary, json_path)
