"""``rapydli bench parallel --json PATH``: memory and step time of each layout on 2 ranks, and the planner's error.

One model (:data:`rapydli.bench.parallel_worker.bench_model`, a 0.9 M-parameter ``tiny_lm``
trained with AdamW), one global batch, the layouts: plain data parallelism (``dp``, the peer),
ZeRO 1 and 2 over it, a pipeline of 2 stages (1F1B and GPipe, 4 micro-batches) and 2-way
tensor parallelism.

* **memory**: right after the optimizer step, each rank's model states (the storages of
  the parameters it trains, their gradients and the optimizer state:
  :mod:`rapydli.bench.parallel_worker`) against the fp32 ZeRO formulas for those
  parameters ``P`` (``4 P`` for Adam; ``2 P + 2 P / N`` for ZeRO-1; ``P + 3 P / N`` for
  ZeRO-2), target within 10 %; and everything the rank holds (every live tensor storage)
  against the planner's peak without activations (the formula plus the buffers it knows
  this implementation keeps), and the activations against the planner's.
* **step time**: the layouts trained on a 2-engine cluster through ``rd.plan_parallel``
  (``--rounds`` rounds, alternated; the median of each layout's medians), each against
  plain data parallelism (ratio ``step / dp step``), and the planner's prediction error.
  Target: predicted within 20 % of measured.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from rapydli.bench.parallel_worker import bench_data, bench_model
from rapydli.bench.report import emit
from rapydli.errors import ClusterError
from rapydli.spread import Spread, paired, rounds_text, target

MEMORY_TOLERANCE = 0.10
GLOBAL_BATCH = 16
MICROBATCHES = 4


def layouts() -> dict[str, Any]:
    """The layouts benchmarked, by name."""
    from rapydli.experiments.planning.layouts import NO_SCHEDULE, Candidate

    return {
        "dp": Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0),
        "zero1": Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 1),
        "zero2": Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 2),
        "pp 1f1b": Candidate.of(1, 2, 1, MICROBATCHES, "1f1b", 0),
        "pp gpipe": Candidate.of(1, 2, 1, MICROBATCHES, "gpipe", 0),
        "tp": Candidate.of(1, 1, 2, 1, NO_SCHEDULE, 0),
    }


def _config() -> Any:
    from rapydli.trainer.config import TrainConfig

    return TrainConfig(batch_size=GLOBAL_BATCH // 2, optimizer="adamw", lr=1e-3, allreduce="mpi")


def memory_rows(steps: int, timeout: float) -> list[dict[str, Any]]:
    """Measured bytes per rank and layout (mpirun worker) beside the formula and the planner's prediction."""
    from rapydli.cluster import mpirun
    from rapydli.experiments.planning.layouts import optimizer_factor, zero_states
    from rapydli.experiments.planning.network import Network
    from rapydli.experiments.planning.perfmodel import RingModel
    from rapydli.experiments.planning.profiling import local_profile
    from rapydli.experiments.planning.stepmodel import predict

    config = _config()
    chosen = layouts()
    micro = sorted({layout.microbatch(GLOBAL_BATCH) for layout in chosen.values()})
    profile = local_profile(bench_model, bench_data, config, micro, sorted({layout.tp for layout in chosen.values()}), [])
    network = Network.from_ring(RingModel(0.0, 0.0))
    predictions = {name: predict(layout, profile, network, GLOBAL_BATCH, config) for name, layout in chosen.items()}
    variants = [{"name": name, "config": layout.config(config, GLOBAL_BATCH, predictions[name].split).to_dict()} for name, layout in chosen.items()]
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-parallel-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "rapydli.bench.parallel_worker", "--out", str(out), "--variants", json.dumps(variants), "--steps", str(steps)]
        result = mpirun.run(argv, n=2, threads=1, timeout=timeout)
        if result.returncode != 0 or not out.exists():
            raise ClusterError(f"the parallel benchmark's memory part failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        rows = json.loads(out.read_text())
    factor = optimizer_factor(config)
    for row in rows:
        layout = chosen[row["variant"]]
        memory = predictions[row["variant"]].stage_memory[row["rank"] // layout.tp % layout.pp]
        formula = sum(zero_states(row["parameter_bytes"], layout.dp, layout.zero, factor))
        predicted = memory.model_states + memory.buffers
        row.update(formula_bytes=formula, predicted_total_bytes=predicted, predicted_activation_bytes=memory.activations,
                   states_vs_formula=row["model_state_bytes"] / formula, total_vs_predicted=row["total_bytes"] / predicted,
                   activations_vs_predicted=row["activation_bytes"] / memory.activations if memory.activations else float("nan"))  # fmt: skip
    return rows


def time_rows(steps: int, rounds: int) -> list[dict[str, Any]]:
    """Each layout's measured and predicted step time on a 2-engine cluster, through the planner."""
    from rapydli.cluster import Cluster
    from rapydli.experiments.planning.planner import plan_parallel

    config = _config()
    labels = {layout.label: name for name, layout in layouts().items()}
    measured: dict[str, list[float]] = {label: [] for label in labels}
    plan = None
    with Cluster(n=2) as cluster:
        for _ in range(rounds):
            plan = plan_parallel(
                bench_model, bench_data, config, ranks=2, run_top=0, steps=steps, cluster=cluster, global_batch=GLOBAL_BATCH,
                run_layouts=list(labels), profile=plan.profile if plan else None, network=plan.network if plan else None,
            )  # fmt: skip
            for label in labels:
                row = plan.table[plan.table["layout"] == label].iloc[0]
                measured[label].append(float(row["measured_step_s"]))
    assert plan is not None
    rows = []
    for label, name in labels.items():
        row = plan.table[plan.table["layout"] == label].iloc[0]
        step = statistics.median(measured[label])
        rows.append({"part": "time", "variant": name, "layout": label, "measured_step_ms": 1e3 * step, "predicted_step_ms": 1e3 * row["predicted_step_s"],
                     "error": (row["predicted_step_s"] - step) / step, "rounds_ms": [round(1e3 * s, 3) for s in measured[label]]})  # fmt: skip
    base = next(r for r in rows if r["variant"] == "dp")["rounds_ms"]
    for row in rows:
        row["vs_dp"] = paired(row["rounds_ms"], base).median  # the layouts ran in the same rounds
    rows.append({"part": "network", "variant": plan.network.describe()})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios and targets from the rows."""
    from rapydli.experiments.planning.planner import TOLERANCE

    summary: dict[str, Any] = {}
    memory = [r for r in rows if r["part"] == "memory"]
    for name in dict.fromkeys(r["variant"] for r in memory):
        mine = [r for r in memory if r["variant"] == name]
        worst = max(mine, key=lambda r: abs(r["states_vs_formula"] - 1))
        summary[f"memory {name}: model states measured / fp32 ZeRO formula (worst rank)"] = worst["states_vs_formula"]
        summary[f"memory {name}: all the rank holds / planner's peak without activations (worst rank)"] = max(
            (r["total_vs_predicted"] for r in mine), key=lambda v: abs(v - 1))
        summary[f"memory {name}: activations measured / planner (worst rank)"] = max(
            (r["activations_vs_predicted"] for r in mine), key=lambda v: abs(v - 1))
        met = abs(worst["states_vs_formula"] - 1) <= MEMORY_TOLERANCE
        summary[f"memory {name}: target within {MEMORY_TOLERANCE:.0%} of the formula"] = "met" if met else "not met"
    timed = [r for r in rows if r["part"] == "time"]
    dp_rounds = next((r.get("rounds_ms") or [r["measured_step_ms"]] for r in timed if r["variant"] == "dp"), None)
    for row in timed:
        own: list[float] = row.get("rounds_ms") or [row["measured_step_ms"]]  # every layout ran once in each round
        summary[f"step {row['variant']}: step / dp step"] = row["vs_dp"]
        if dp_rounds is not None and len(dp_rounds) == len(own):
            summary[f"step {row['variant']}: step / dp step, range"] = rounds_text(paired(own, dp_rounds))
        errors = Spread.of([abs(row["predicted_step_ms"] - step) / step for step in own]) if "predicted_step_ms" in row else Spread.of([abs(row["error"])])
        summary[f"step {row['variant']}: planner error"] = row["error"]
        summary[f"step {row['variant']}: planner error (absolute), range"] = rounds_text(errors, percent=True)
        summary[f"step {row['variant']}: target predicted within {TOLERANCE:.0%}"] = target(errors, TOLERANCE, percent=True)
    return summary


@click.command("parallel")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here.")
@click.option("--parts", default="memory,time", show_default=True, help="Comma-separated: memory, time.")
@click.option("--steps", type=click.IntRange(min=3), default=12, show_default=True, help="Steps per layout run (2 are warm-up).")
@click.option("--rounds", type=click.IntRange(min=1), default=3, show_default=True, help="Alternated rounds of the step-time part.")
@click.option("--timeout", type=float, default=600.0, show_default=True, help="Seconds before the memory launch is killed.")
def command(json_path: str | None, parts: str, steps: int, rounds: int, timeout: float) -> None:
    """Memory per rank of dp / ZeRO-1 / ZeRO-2 / pipeline / tensor parallel vs the ZeRO formulas; step times vs dp; planner error."""
    wanted = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - {"memory", "time"})
    if unknown:
        raise click.BadParameter(f"unknown part(s) {', '.join(unknown)}; allowed: memory, time", param_hint="--parts")
    rows: list[dict[str, Any]] = []
    if "memory" in wanted:
        rows += memory_rows(min(steps, 4), timeout)
    if "time" in wanted:
        rows += time_rows(steps, rounds)
    emit("parallel", rows, summarize(rows), json_path)
