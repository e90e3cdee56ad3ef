"""``rapydli bench trainer -n 2 --json PATH``: the Trainer's step against DDP and no communication.

Re-launches :mod:`rapydli.bench.trainer_worker` on ``n`` ranks (one thread each) through
:func:`rapydli.cluster.mpirun.run`. For the small ResNet and the MLP at batch 32 per rank
it prints the step time of the RaPyDLI ``Trainer``, of the same step under torch
``DistributedDataParallel`` with gloo, and of the same step with no communication, then
the issue's targets with met / not met:

* ``Trainer`` step <= 0.85x DDP's;
* communication overhead of the ``Trainer`` over the no-communication step <= 10%;

and the fraction of the ``Trainer``'s communication hidden behind backward. These judge
the plain ``trainer`` variant: the same model and kernels as DDP, so its ratio to DDP is
the communication-only comparison (and it cannot beat DDP by more than DDP's own overhead
over the no-communication step).

With ``--autotune`` (the default) it also times ``trainer_autotune``: the same ``Trainer``
with ``TrainConfig(autotune=True)``, i.e. the model's convolutions tuned by
:mod:`rapydli.autotune` (once, before the rounds; the row's ``tune_s``, not in any step)
while DDP runs the default kernels. Its lines ``trainer+autotune / ddp step``,
``trainer+autotune / trainer step`` and ``target trainer <= 0.85x ddp with autotune``
therefore include the tuned convolution kernels as well as the communication; they are
the product's Trainer as a user runs it with autotune on. A model without convolutions
(the MLP) gets an empty plan, so there ``trainer_autotune`` is the plain ``Trainer`` again.

It also times what a checkpoint costs the steps: the ``Trainer``'s ``save_checkpoint``
(a copy of the state in memory, which the step waits for) plus the writer thread's toll on
the steps that run while it writes (their excess over the steps with no write in flight),
against a synchronous write of the same state, and reports that cost per step at
``checkpoint_every=50`` (target <= 5%).

With ``--live`` (the default) it then measures what streaming the step metrics to the
notebook costs a training task on a local cluster (:mod:`rapydli.bench.live`; target <= 2%
of the step).
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from rapydli.bench.report import emit
from rapydli.cluster import mpirun
from rapydli.errors import ClusterError
from rapydli.spread import paired, rounds_text, target
from rapydli.trainer.task import WARMUP_STEPS

TRAINER_VS_DDP = 0.85
MAX_OVERHEAD = 0.10
CHECKPOINT_EVERY = 50
MAX_CHECKPOINT_COST = 0.05


def _rounds(row: dict[str, Any]) -> list[float]:
    """A variant's step time (ms) in each interleaved round (older rows: their median alone)."""
    return list(row.get("rounds_ms") or [row["step_ms"]])


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios and targets per model from the worker's rows.

    Each ratio is the median of the per-round ratios (the variants ran in the same
    interleaved rounds) with the range over rounds beside it; a target is "met" or "not
    met" only when every round agrees, else "unclear" (:func:`rapydli.spread.target`).
    """
    summary: dict[str, Any] = {}
    for row in rows:
        if row["variant"] == "checkpoint" and row["save_ms"] is not None:
            per_checkpoint = row["save_ms"] + row["thread_ms"]  # the copy the step waits for + the write thread's toll
            cost = per_checkpoint / (CHECKPOINT_EVERY * row["step_ms"])
            summary[f"{row['model']}: checkpoint cost per step at checkpoint_every={CHECKPOINT_EVERY}"] = cost
            summary[f"{row['model']}: of which the writer thread"] = row["thread_ms"] / (
                CHECKPOINT_EVERY * row["step_ms"]
            )
            summary[f"{row['model']}: synchronous write / trainer checkpoint"] = row["sync_write_ms"] / per_checkpoint
            summary[f"{row['model']}: target checkpoint cost <= {MAX_CHECKPOINT_COST:.0%}"] = (
                "met" if cost <= MAX_CHECKPOINT_COST else "not met"
            )
    rows = [row for row in rows if row["variant"] != "checkpoint"]
    for model in dict.fromkeys(row["model"] for row in rows):
        step = {row["variant"]: _rounds(row) for row in rows if row["model"] == model}
        trainer_row = next(row for row in rows if row["model"] == model and row["variant"] == "trainer")
        ratio = paired(step["trainer"], step["ddp_gloo"])  # the variants ran in the same rounds
        overhead = paired(step["trainer"], step["no_comm"])
        summary[f"{model}: trainer / ddp step"] = ratio.median
        summary[f"{model}: trainer / ddp step, range"] = rounds_text(ratio)
        summary[f"{model}: target trainer <= {TRAINER_VS_DDP}x ddp"] = target(ratio, TRAINER_VS_DDP)
        summary[f"{model}: trainer overhead over no-comm"] = overhead.median - 1.0
        summary[f"{model}: trainer overhead over no-comm, range"] = rounds_text(overhead.minus(1.0), percent=True)
        summary[f"{model}: ddp overhead over no-comm"] = paired(step["ddp_gloo"], step["no_comm"]).median - 1.0
        summary[f"{model}: target overhead <= {MAX_OVERHEAD:.0%}"] = target(
            overhead.minus(1.0), MAX_OVERHEAD, percent=True
        )
        summary[f"{model}: comm hidden behind backward"] = trainer_row["hidden_fraction"]
        if "trainer_autotune" in step:  # tuned convolutions + communication, against DDP on the default kernels
            tuned = paired(step["trainer_autotune"], step["ddp_gloo"])
            summary[f"{model}: trainer+autotune / ddp step"] = tuned.median
            summary[f"{model}: trainer+autotune / ddp step, range"] = rounds_text(tuned)
            summary[f"{model}: trainer+autotune / trainer step"] = paired(
                step["trainer_autotune"], step["trainer"]
            ).median
            summary[f"{model}: target trainer <= {TRAINER_VS_DDP}x ddp with autotune"] = target(tuned, TRAINER_VS_DDP)
    return summary


@click.command("trainer")
@click.option("-n", "--ranks", "n", type=click.IntRange(min=2), default=2, show_default=True, help="MPI ranks.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here."
)
@click.option("--models", default="resnet_mini,mlp", show_default=True, help="Comma-separated: resnet_mini, mlp.")
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Measured steps per round.")
@click.option(
    "--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="Interleaved rounds per variant."
)
@click.option("--allreduce", default="auto", show_default=True, help="The Trainer's allreduce algorithm.")
@click.option(
    "--bucket-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=25.0,
    show_default=True,
    help="The Trainer's gradient bucket size (MiB).",
)
@click.option(
    "--autotune/--no-autotune",
    default=True,
    show_default=True,
    help="Also time trainer_autotune: the Trainer with TrainConfig(autotune=True), tuned once before the rounds (first run: minutes).",
)
@click.option(
    "--live/--no-live",
    default=True,
    show_default=True,
    help="Also measure the cost of live metrics on a local cluster.",
)
@click.option(
    "--live-steps", type=click.IntRange(min=1), default=60, show_default=True, help="Measured steps per live/quiet run."
)
@click.option(
    "--live-rounds", type=click.IntRange(min=1), default=5, show_default=True, help="Live/quiet pairs per model."
)
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds before every rank is killed.")
def command(
    n: int,
    json_path: str | None,
    models: str,
    steps: int,
    rounds: int,
    allreduce: str,
    bucket_mb: float,
    autotune: bool,
    live: bool,
    live_steps: int,
    live_rounds: int,
    timeout: float,
) -> None:
    """Trainer step vs torch DDP (gloo) vs no communication; small ResNet and MLP, batch 32 per rank.

    The plain "trainer / ddp" ratio (the targets) is the communication-only comparison: same
    model, same kernels. The "trainer_autotune" variant (on by default) is the same Trainer with
    TrainConfig(autotune=True): its ratios to DDP also include the tuned convolution kernels,
    while DDP runs the default ones. Tuning happens once before the rounds, outside the steps.
    """
    from rapydli.bench.trainer_worker import MODELS

    unknown = sorted(set(models.split(",")) - set(MODELS))
    if unknown:
        raise click.BadParameter(
            f"unknown model(s) {', '.join(unknown)}; allowed: {', '.join(MODELS)}", param_hint="--models"
        )
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-trainer-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "rapydli.bench.trainer_worker", "--out", str(out), "--models", models,
                "--steps", str(steps), "--rounds", str(rounds), "--allreduce", allreduce, "--bucket-mb", str(bucket_mb),
                "--autotune" if autotune else "--no-autotune", "--checkpoint-dir", str(Path(tmp) / "checkpoints")]  # fmt: skip
        result = mpirun.run(argv, n=n, threads=1, timeout=timeout)
        if result.returncode != 0 or not out.exists():
            raise ClusterError(
                f"the trainer benchmark failed on {n} ranks:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        rows = json.loads(out.read_text())
    summary = summarize(rows)
    if live:
        from rapydli.bench import live as live_bench

        live_rows = live_bench.measure(
            n, models.split(","), live_steps + WARMUP_STEPS, live_rounds, allreduce, bucket_mb
        )
        summary.update(live_bench.summarize(live_rows))
        rows += live_rows
    emit("trainer", rows, summary, json_path)
