"""``rapydli tune ...``: tune one convolution or a reference model from the shell."""

from __future__ import annotations

import json

import click

from rapydli.autotune.strategies import names as strategy_names
from rapydli.cli.group import Group
from rapydli.errors import ConfigError

_MODELS = ("resnet-mini", "resnet18")


def _common(fn: click.decorators.FC) -> click.decorators.FC:
    for option in reversed(
        [
            click.option(
                "--mode",
                type=click.Choice(["train", "inference"]),
                default="train",
                show_default=True,
                help="train times forward + both gradients",
            ),
            click.option(
                "--strategy",
                type=click.Choice(strategy_names()),
                default=None,
                help="search strategy (default: model_based with --budget-s, else exhaustive)",
            ),
            click.option(
                "--budget", type=int, default=8, show_default=True, help="configurations for --strategy random"
            ),
            click.option(
                "--preset",
                type=click.Choice(["tiny", "small", "default", "full"]),
                default="default",
                show_default=True,
                help="domains of the generated kernels",
            ),
            click.option(
                "--engines",
                "engines_n",
                type=int,
                default=0,
                show_default=True,
                help="measure in parallel on this many local MPI engines (0: here)",
            ),
            click.option("--repetitions", type=int, default=5, show_default=True),
            click.option(
                "--threads",
                type=click.IntRange(min=1),
                default=None,
                help="threads of each timed run (default: this process's torch threads); part of the cache key",
            ),
            click.option(
                "--json",
                "json_path",
                type=click.Path(dir_okay=False),
                default=None,
                help="write the measured table as JSON",
            ),
        ]
    ):
        fn = option(fn)
    return fn


def _tune_options(strategy: str | None, budget: int, preset: str, repetitions: int, threads: int | None) -> dict:
    chosen = {"strategy": strategy} if strategy else {}
    options = {"options": {"budget": budget}} if strategy == "random" else {}
    return {**chosen, **options, "preset": preset, "repetitions": repetitions, "threads": threads}


def _with_engines(n: int, work):
    if n <= 0:
        return work(None)
    from rapydli.cluster import Cluster

    with Cluster(n=n) as cluster:
        return work(cluster)


@click.group(cls=Group)
def tune() -> None:
    """Autotune convolutions (results cached under $RAPYDLI_HOME/autotune.db)."""


@tune.command("conv2d")
@click.option("--shape", required=True, help="N,C,H,W,K,R,S[,stride,pad[,groups,dilation]]")
@_common
def conv2d(
    shape: str,
    mode: str,
    strategy: str | None,
    budget: int,
    preset: str,
    engines_n: int,
    repetitions: int,
    threads: int | None,
    json_path: str | None,
) -> None:
    """Tune one convolution and print every measured configuration."""
    from rapydli.autotune import ConvShape, tune_conv2d

    conv = ConvShape.parse(shape)
    opts = _tune_options(strategy, budget, preset, repetitions, threads)
    result = _with_engines(engines_n, lambda engines: tune_conv2d(conv, "cpu", mode, engines, **opts))
    columns = ["config", "status", "median_ms", "std_ms", "gflops", "pct_peak", "cached"]
    click.echo(result.table[columns].to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    click.echo(f"space: {result.space.counts}  skipped: {result.space.skipped or '-'}")
    click.echo(
        f"best: {result.best.config}  {result.best.median * 1e3:.3f} ms  "
        f"(measured {result.measured}, {result.seconds:.1f} s)"
    )
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(
                {
                    "problem": conv.key,
                    "mode": mode,
                    "best": str(result.best.config),
                    "rows": result.table.to_dict(orient="records"),
                },
                fh,
                indent=2,
                default=str,
            )


@tune.command("model")
@click.argument("name", type=click.Choice(_MODELS))
@click.option("--batch", type=int, default=16, show_default=True)
@click.option(
    "--budget-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="seconds the tuning may take (default: no limit); the costliest layers are tuned first",
)
@_common
def model(
    name: str,
    batch: int,
    budget_s: float | None,
    mode: str,
    strategy: str | None,
    budget: int,
    preset: str,
    engines_n: int,
    repetitions: int,
    threads: int | None,
    json_path: str | None,
) -> None:
    """Tune every convolution of a reference model: a line per layer shape as it is tuned, then the plan."""
    import torch

    from rapydli.autotune import autotune_model
    from rapydli.autotune.progress import table_line
    from rapydli.zoo.models import resnet18_like, resnet_mini

    if batch < 1:
        raise ConfigError(f"--batch must be >= 1, got {batch}")
    net = resnet18_like() if name == "resnet18" else resnet_mini()
    example = torch.randn(batch, 3, 32, 32)
    opts = _tune_options(strategy, budget, preset, repetitions, threads)
    click.echo(table_line({}, header=True))

    def on_layer(row: dict) -> None:
        from tqdm.auto import tqdm

        tqdm.write(table_line(row))

    _, report = _with_engines(
        engines_n,
        lambda engines: autotune_model(net, example, mode, engines, budget_s=budget_s, on_layer=on_layer, **opts),
    )
    click.echo(report.table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    click.echo("estimated conv time (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in report.estimates_ms.items()))
    if report.time_s:
        click.echo("where the time went (s): " + ", ".join(f"{k} {v:.1f}" for k, v in report.time_s.items()))
    click.echo(f"skipped by the budget: {', '.join(report.skipped) or 'none'}")
    click.echo(f"tuned in {report.seconds:.1f} s")
    if json_path:
        with open(json_path, "w") as fh:
            json.dump(
                {
                    "model": name,
                    "mode": mode,
                    "estimates_ms": report.estimates_ms,
                    "summary": report.summary,
                    "time_s": report.time_s,
                    "skipped": report.skipped,
                    "layers": report.layers.to_dict(orient="records"),
                    "rows": report.table.to_dict(orient="records"),
                },
                fh,
                indent=2,
                default=str,
            )
