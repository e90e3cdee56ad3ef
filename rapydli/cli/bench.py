"""``rapydli bench ...``: benchmark programs that measure the peer in the same run.

Each benchmark lives in ``rapydli/bench/<name>.py`` and exposes a click ``command``; it
prints a table and writes JSON with ``--json PATH``.
"""

from __future__ import annotations

import click

from rapydli.cli.lazy import LazyGroup


@click.group(
    cls=LazyGroup,
    lazy={
        name: f"rapydli.bench.{name}:command"
        for name in (
            "magics",
            "allreduce",
            "trainer",
            "conv",
            "loader",
            "pipeline",
            "parallel",
            "cluster",
            "live",
            "gpu",
            "model",
            "recovery",
        )
    },
)
def bench() -> None:
    """Benchmarks; each prints a table and ratios against its peer."""
