"""``rapydli bench magics``: round trip of a trivial ``%%distributed`` cell against ``%%px``.

Both magics drive the same engines from one IPython shell: ipyparallel's ``%%px`` (with
``--block``) and RaPyDLI's ``%%distributed``. Also reports the cluster start time.
Target: ``%%distributed`` median latency <= 1.5x ``%%px``'s.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

from rapydli.bench.report import emit

TARGET_RATIO = 1.5


def _median_ms(fn, repeat: int) -> tuple[float, float]:
    for _ in range(5):  # warm-up
        fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples), statistics.quantiles(samples, n=10)[-1]


@click.command()
@click.option("-n", "--engines", "n", default=2, show_default=True, help="number of MPI engines")
@click.option("--repeat", default=100, show_default=True, help="timed cells per magic")
@click.option("--json", "json_path", default=None, help="write the results as JSON to this path")
def command(n: int, repeat: int, json_path: str | None) -> None:
    """Median latency of a trivial %%distributed cell vs %%px on the same engines."""
    from IPython.testing.globalipapp import start_ipython
    from IPython.utils.capture import capture_output

    from rapydli.cluster import Cluster

    shell = start_ipython()
    shell.run_line_magic("load_ext", "rapydli")
    start = time.perf_counter()
    cluster = Cluster(n=n).start()
    start_s = time.perf_counter() - start
    try:
        cluster.client.activate()  # registers %%px on this client's engines
        cell = "x = 1"

        def px() -> None:
            with capture_output():
                shell.run_cell_magic("px", "--block", cell)

        def distributed() -> None:
            with capture_output():
                shell.run_cell_magic("distributed", "", cell)

        rows: list[dict[str, Any]] = []
        for name, fn in (("%%px", px), ("%%distributed", distributed)):
            median, p90 = _median_ms(fn, repeat)
            rows.append({"magic": name, "median_ms": median, "p90_ms": p90, "cells": repeat})
    finally:
        cluster.stop()
    ratio = rows[1]["median_ms"] / rows[0]["median_ms"]
    summary = {
        "engines": n,
        "cluster_start_s": start_s,
        "distributed_over_px": ratio,
        "target": f"%%distributed <= {TARGET_RATIO}x %%px: {'met' if ratio <= TARGET_RATIO else 'NOT met'}",
    }
    emit("magics", rows, summary, json_path)
