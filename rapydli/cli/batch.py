"""``rapydli batch NOTEBOOK --grid key=v1,v2 ...``: a grid of notebook experiments."""

from __future__ import annotations

import click

from rapydli.cli.fmt import fmt_value


class BatchFailed(click.ClickException):
    """Some items failed: the summary was written, the exit status is 1."""

    exit_code = 1

    def show(self, file=None) -> None:  # noqa: ANN001 - click's signature
        click.echo(f"rapydli batch: {self.message}", err=True)


@click.command()
@click.argument("notebook", type=click.Path(dir_okay=False))
@click.argument("axes", nargs=-1, metavar="[KEY=V1,V2]...")
@click.option(
    "--grid",
    "grid",
    multiple=True,
    metavar="KEY=V1,V2",
    help="A parameter and its values (JSON numbers/lists/true/false or strings); repeat for more axes.",
)
@click.option(
    "--params-file",
    type=click.Path(dir_okay=False),
    default=None,
    help="YAML/JSON: a mapping (list values are axes) or a list of points.",
)
@click.option("--parallel", "-j", type=int, default=1, show_default=True, help="Items running at once.")
@click.option(
    "--out",
    "out",
    type=click.Path(file_okay=False),
    default="batch-results",
    show_default=True,
    help="Output folder: <stem>/<param-hash>.ipynb, summary.csv, report.html.",
)
@click.option("--kernel", default=None, help="Jupyter kernel name (default: the notebook's).")
@click.option("--timeout", type=float, default=None, help="Seconds an item may run before it is killed.")
@click.option("--retry", type=int, default=0, show_default=True, help="Re-run a failed item up to N times.")
@click.option("--force", is_flag=True, help="Run every item, even those already finished in --out.")
@click.option("--dry-run", is_flag=True, help="Validate and list the items; run nothing.")
@click.option("--hosts", default=None, help="Run items on these hosts over ssh (one at a time each), e.g. node1,node2.")
@click.option(
    "--ssh-command", default="ssh", show_default=True, help="With --hosts: the ssh program that reaches them."
)
@click.option(
    "--launcher", default=None, help="Where items run: local (default), ssh or slurm (each item a Slurm job)."
)
@click.option(
    "--option",
    "-o",
    "options",
    multiple=True,
    metavar="KEY=VALUE",
    help="A launcher option, e.g. -o partition=debug -o timelimit=00:30:00; a key given twice makes a list.",
)
@click.option(
    "--trackers",
    default="",
    metavar="NAME,...",
    help="Also log the batch to these experiment trackers (mlflow, tensorboard, wandb): a parent run, one child per item.",
)
def batch(
    notebook: str,
    axes: tuple[str, ...],
    grid: tuple[str, ...],
    params_file: str | None,
    parallel: int,
    out: str,
    kernel: str | None,
    timeout: float | None,
    retry: int,
    force: bool,
    dry_run: bool,
    hosts: str | None,
    ssh_command: str,
    launcher: str | None,
    options: tuple[str, ...],
    trackers: str,
) -> None:
    """Run NOTEBOOK once per point of a parameter grid with papermill.

    Grid axes are given with --grid KEY=V1,V2 or as plain KEY=V1,V2 arguments after the
    notebook (so `--grid lr=0.1,0.01 workers=1,2` names two axes). When the notebook has a `parameters` cell, every key is checked against it (and every value
    against the default's type) before anything runs; without one, the parameters are injected at the top.
    A notebook with no kernel metadata runs with this environment's Python kernel. Items already finished with the
    same parameters and notebook source are skipped. Exit status 1 when an item failed.
    With --launcher slurm each item is a Slurm job of one task (--parallel jobs in the queue at
    once; Ctrl-C cancels them) that records into a store file of its own, merged when it ends.

    \b
    Examples:
      rapydli batch notebooks/05-batch-experiments.ipynb --grid lr=0.1,0.01 workers=1,2 --parallel 2
      rapydli batch nb.ipynb --grid lr=0.1,0.01 --launcher slurm -o partition=debug --parallel 4
      rapydli batch nb.ipynb --grid lr=0.1,0.01 --trackers mlflow --parallel 2
    """
    from rapydli.experiments.batch import batch as batch_mod
    from rapydli.registry import tracker_names

    tracker_names(trackers, "--trackers")  # refused before anything runs
    launcher_options = _launcher_options(options)
    places_hosts = hosts.split(",") if hosts else None
    batch_mod.item_places(launcher, launcher_options, places_hosts, ssh_command)  # refused before anything runs
    plan = batch_mod.plan_batch(
        notebook,
        [*grid, *axes],
        params_file=params_file,
        out=out,
        kernel=kernel,
        parallel=parallel,
        timeout=timeout,
        retry=retry,
    )
    if dry_run:
        for item in plan.items:
            click.echo(f"{item.key}  {item.output}  {item.parameters}")
        click.echo(f"{len(plan.items)} items; nothing run (--dry-run)")
        return
    summary = batch_mod.run_plan(
        plan,
        parallel=parallel,
        kernel=kernel,
        timeout=timeout,
        retry=retry,
        force=force,
        hosts=places_hosts,
        ssh_command=ssh_command,
        launcher=launcher,
        launcher_options=launcher_options,
        trackers=trackers,
    )
    shown = summary.drop(columns=["output", "run_id", "error"])
    click.echo(shown.to_string(index=False, float_format=fmt_value))  # floats rounded (summary.csv keeps every digit)
    click.echo(f"summary: {summary.attrs['summary']}\nreport:  {summary.attrs['report']}")
    failed = summary.attrs["failed"]
    if failed:
        for _, row in summary[summary["status"] != "finished"].iterrows():
            cell = row["failing_cell"] if isinstance(row["failing_cell"], str) else None
            click.echo(f"failed {row['item']}" + (f" in {cell}" if cell else "") + f"\n  {row['error']}", err=True)
        raise BatchFailed(f"{failed} of {len(summary)} items failed")


def _launcher_options(items: tuple[str, ...]) -> dict[str, object]:
    """``-o KEY=VALUE`` options (values read as JSON when they parse); a key given again adds to a list."""
    from rapydli.cli.cluster import parse_options

    options: dict[str, object] = {}
    for item in items:
        ((key, value),) = parse_options((item,)).items()
        if key in options:
            previous = options[key]
            options[key] = [*(previous if isinstance(previous, list) else [previous]), value]
        else:
            options[key] = value
    return options
