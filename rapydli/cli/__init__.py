"""The ``rapydli`` command line: clusters, batches, runs, benchmarks and tuning.

User mistakes (any :class:`~rapydli.errors.RapydliError`) print one line and exit with
status 2; no traceback.
"""

from __future__ import annotations

import sys

import click

from rapydli.cli.lazy import LazyGroup
from rapydli.errors import RapydliError
from rapydli.version import __version__


@click.group(
    cls=LazyGroup,
    lazy={
        "cluster": "rapydli.cli.cluster:cluster",
        "batch": "rapydli.cli.batch:batch",
        "runs": "rapydli.cli.runs:runs",
        "bench": "rapydli.cli.bench:bench",
        "tune": "rapydli.cli.tune:tune",
    },
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(__version__, prog_name="rapydli")
def cli() -> None:
    """RaPyDLI: prototype distributed deep learning from Jupyter."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rapydli`` console script."""
    from rapydli.experiments.batch.headless import skip_unused_imports

    skip_unused_imports()  # this process reads and writes notebooks, never checks IRIs: 3-5 s of CPU less
    try:
        code = cli.main(args=argv, prog_name="rapydli", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except RapydliError as exc:
        click.echo(f"rapydli: error: {exc}", err=True)
        return 2
    return code if isinstance(code, int) else 0  # a command's ctx.exit(n) comes back as n


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
