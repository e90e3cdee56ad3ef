"""``rapydli bench magics``: round trip of a trivial ``%%distributed`` cell against ``%%px``.

Both magics drive the same engines from one IPython shell: ipyparallel's ``%%px`` (with
``--block``) and RaPyDLI's ``%%distributed``. Also reports the cluster start time.
Target: ``%%distributed`` latency <= 1.5x ``%%px``'s, the two timed alternately (one of each
per round) and judged on the 10th to 90th percentile of the per-round ratios.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import click

from rapydli.bench.report import emit
from rapydli.spread import Spread, rounds_text, target

TARGET_RATIO = 1.5


def _interleaved_ms(magics: dict[str, Any], repeat: int) -> dict[str, list[float]]:
    """Each magic's latency (ms) in ``repeat`` rounds, every magic once per round (after 5 warm-up rounds)."""
    for _ in range(5):
        for fn in magics.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in magics}
    for _ in range(repeat):
        for name, fn in magics.items():
            start = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - start) * 1e3)
    return samples


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

        samples = _interleaved_ms({"%%px": px, "%%distributed": distributed}, repeat)
    finally:
        cluster.stop()
    rows = [
        {
            "magic": name,
            "median_ms": statistics.median(ms),
            "p90_ms": statistics.quantiles(ms, n=10)[-1],
            "cells": repeat,
        }
        for name, ms in samples.items()
    ]
    # the two cells of a round ran back to back; the middle 80 % of the per-round ratios is the interval
    ratios = sorted(d / p for d, p in zip(samples["%%distributed"], samples["%%px"]))
    ratio = Spread(statistics.median(ratios), ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10], len(ratios))
    summary = {
        "engines": n,
        "cluster_start_s": start_s,
        "distributed_over_px": ratio.median,
        "distributed_over_px, 10th to 90th percentile of the rounds": rounds_text(ratio),
        f"target %%distributed <= {TARGET_RATIO}x %%px": target(ratio, TARGET_RATIO),
    }
    emit("magics", rows, summary, json_path)
