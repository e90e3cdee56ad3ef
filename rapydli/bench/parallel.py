"""``rapydli bench parallel --json PATH``: memory and step time of each layout on 2 ranks, and the planner's error.

One model (:data:`rapydli.bench.parallel_worker.bench_model`, a 0.9 M-parameter ``tiny_lm``
trained with AdamW), one global batch, the layouts: plain data parallelism (``dp``, the peer),
ZeRO 1 and 2 over it, a pipeline of 2 stages (1F1B and GPipe, 4 micro-batches) and 2-way
tensor parallelism.

* **memory**: right after the optimizer step, each rank's model states (the storages of
  the parameters it trains, their gradients and the optimizer state:
  :mod:`rapydli.bench.parallel_worker`) against the fp32 ZeRO formulas for those
  parameters ``P`` (``4 P`` for Adam; ``2 P + 2 P / N`` for ZeRO-1; ``P + 3 P / N`` for
  ZeRO-2), target within 10 %; and everything the rank holds at backward's peak (every
  live tensor storage after the step, plus the whole gradient buckets ZeRO 2 and 3 held at
  once during backward, gone by then) against the planner's peak without activations (the
  formula plus the buffers it knows this implementation keeps), and the activations
  against the planner's.
* **step time**: the layouts trained on a 2-engine cluster through ``rd.plan_parallel``
  (``--model``: ``tiny_lm``, or the GPT-2-style or Llama-style model of ``--peers``)
  (``--rounds`` rounds, alternated; the median of each layout's medians), each against
  plain data parallelism (ratio ``step / dp step``), and the planner's prediction error.
  Target: predicted within 20 % of measured.

``rapydli bench parallel --zero 3`` runs this instead: ZeRO-3 (``TrainConfig(zero=3)``)
against PyTorch's FSDP2 (``fully_shard`` over gloo) on a GPT-2-style model
(:data:`rapydli.bench.zero3_worker.SIZES`: ``--size gpt2-63m``, 63.0 M parameters, 4
sequences of 64 tokens a step; ``--size tiny`` for tests), on 2 and 4 ranks
(``--ranks``), each with and without activation checkpointing of every block. Every
variant trains ``--steps`` steps (the first is warm-up) in fresh processes
(:mod:`rapydli.bench.zero3_worker` says what is measured and how the peer is set up); a
round launches every variant once, rapydli and FSDP2 back to back (which goes first
alternates from round to round), and ratios are paired within a round
(:func:`rapydli.spread.paired`). Printed per rank count: the step time rapydli / FSDP2
(a launch's: the slowest rank's median step after the warm-up; target <= 1.0: rapydli at
least as fast) and the peak resident memory per rank (worst rank) rapydli / FSDP2 (target
<= 1.0), each with the range of the rounds and a verdict
only where every round agrees; what activation checkpointing costs in step time and saves
in activations and in peak memory, for both; whether both sides computed the same losses;
and the load: the 1-minute load average before each launch, and the cores other
processes used while it ran.

``rapydli bench parallel --peers`` runs this instead: RaPyDLI's 2-way tensor parallelism
(``tp2``) and its 2-stage 1F1B pipeline of 4 micro-batches (``pp2``) against PyTorch's own
(``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel`` on a gloo mesh;
``torch.distributed.pipelining``'s ``Schedule1F1B``), on a GPT-2-style and a Llama-style
model (:data:`rapydli.bench.peers_worker.SHAPES`: ``--size bench``, 3.7 and 4.0 M
parameters, 4 sequences of 64 tokens a step; ``--size tiny`` for tests), on 2 ranks of one
thread. Every variant trains ``--steps`` steps (the first 2 are warm-up) in fresh
processes (:mod:`rapydli.bench.peers_worker` says what is measured and how the peer is set
up); a round launches every (model, layout) once, rapydli and torch back to back (which
goes first alternates from round to round). Printed per model and layout: the step time
torch / rapydli (a launch's: the slowest rank's median step after the warm-up; target
>= 1.0: rapydli at least as fast), paired within rounds, with the range of the rounds and
a verdict only where every round agrees; whether both sides computed the same losses
(tensor parallel: every step; pipeline: the first, since torch's pipeline trains GPT-2's
tied embedding as two copies); and the load, as for ``--zero 3``.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from rapydli.bench.parallel_worker import TIME_MODELS, bench_data, bench_model
from rapydli.bench.peers_worker import SHAPES
from rapydli.bench.report import emit
from rapydli.bench.zero3_worker import SIZES
from rapydli.errors import ClusterError
from rapydli.spread import Spread, machine_load, paired, rounds_text, target

MEMORY_TOLERANCE = 0.10
GLOBAL_BATCH = 16
MICROBATCHES = 4
#: Zero-3 part: steps of each launch that are warm-up (not timed), and the relative difference two losses may have and be equal.
ZERO3_WARMUP, LOSS_TOLERANCE = 1, 1e-4
MIB = 2**20


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
        "dp checkpointed": Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0, "blocks"),
        "pp 1f1b checkpointed": Candidate.of(1, 2, 1, MICROBATCHES, "1f1b", 0, "blocks"),
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
    profile = local_profile(
        bench_model, bench_data, config, micro, sorted({layout.tensor_parallel for layout in chosen.values()}), []
    )
    network = Network.from_ring(RingModel(0.0, 0.0))
    predictions = {name: predict(layout, profile, network, GLOBAL_BATCH, config) for name, layout in chosen.items()}
    variants = [
        {"name": name, "config": layout.config(config, GLOBAL_BATCH, predictions[name].split).to_dict()}
        for name, layout in chosen.items()
    ]
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-parallel-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [
            sys.executable,
            "-m",
            "rapydli.bench.parallel_worker",
            "--out",
            str(out),
            "--variants",
            json.dumps(variants),
            "--steps",
            str(steps),
        ]
        result = mpirun.run(argv, n=2, threads=1, timeout=timeout)
        if result.returncode != 0 or not out.exists():
            raise ClusterError(
                f"the parallel benchmark's memory part failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        rows = json.loads(out.read_text())
    factor = optimizer_factor(config)
    for row in rows:
        layout = chosen[row["variant"]]
        memory = predictions[row["variant"]].stage_memory[
            row["rank"] // layout.tensor_parallel % layout.pipeline_stages
        ]
        formula = sum(zero_states(row["parameter_bytes"], layout.data_parallel, layout.zero, factor))
        predicted = memory.model_states + memory.buffers
        # at backward's peak: what the rank holds after the step, plus the whole gradient buckets it held at once during
        # backward (ZeRO 2 and 3; gone by the step's end, where the storages are counted)
        held = row["total_bytes"] + row.get("in_flight_bytes", 0)
        row.update(
            formula_bytes=formula,
            predicted_total_bytes=predicted,
            predicted_activation_bytes=memory.activations,
            states_vs_formula=row["model_state_bytes"] / formula,
            total_vs_predicted=held / predicted,
            activations_vs_predicted=row["activation_bytes"] / memory.activations
            if memory.activations
            else float("nan"),
        )
    return rows


def time_rows(steps: int, rounds: int, model: str = "tiny_lm") -> list[dict[str, Any]]:
    """Each layout's measured and predicted step time on a 2-engine cluster, through the planner, for ``TIME_MODELS[model]``."""
    from rapydli.cluster import Cluster
    from rapydli.experiments.planning.planner import plan_parallel

    model_fn, data_fn = TIME_MODELS[model]
    config = _config()
    labels = {layout.label: name for name, layout in layouts().items()}
    measured: dict[str, list[float]] = {label: [] for label in labels}
    plan = None
    with Cluster(n=2) as cluster:
        for _ in range(rounds):
            plan = plan_parallel(
                model_fn,
                data_fn,
                config,
                ranks=2,
                run_top=0,
                steps=steps,
                cluster=cluster,
                global_batch=GLOBAL_BATCH,
                run_layouts=list(labels),
                profile=plan.profile if plan else None,
                network=plan.network if plan else None,
            )
            for label in labels:
                row = plan.table[plan.table["layout"] == label].iloc[0]
                measured[label].append(float(row["measured_step_s"]))
    assert plan is not None
    rows = []
    for label, name in labels.items():
        row = plan.table[plan.table["layout"] == label].iloc[0]
        step = statistics.median(measured[label])
        rows.append(
            {
                "part": "time",
                "model": model,
                "variant": name,
                "layout": label,
                "measured_step_ms": 1e3 * step,
                "predicted_step_ms": 1e3 * row["predicted_step_s"],
                "error": (row["predicted_step_s"] - step) / step,
                "rounds_ms": [round(1e3 * s, 3) for s in measured[label]],
            }
        )
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
        summary[
            f"memory {name}: all the rank holds at backward's peak / planner's peak without activations (worst rank)"
        ] = max((r["total_vs_predicted"] for r in mine), key=lambda v: abs(v - 1))
        summary[f"memory {name}: activations measured / planner (worst rank)"] = max(
            (r["activations_vs_predicted"] for r in mine), key=lambda v: abs(v - 1)
        )
        met = abs(worst["states_vs_formula"] - 1) <= MEMORY_TOLERANCE
        summary[f"memory {name}: target within {MEMORY_TOLERANCE:.0%} of the formula"] = "met" if met else "not met"
    timed = [r for r in rows if r["part"] == "time"]
    dp_rounds = next((r.get("rounds_ms") or [r["measured_step_ms"]] for r in timed if r["variant"] == "dp"), None)
    for row in timed:
        own: list[float] = row.get("rounds_ms") or [row["measured_step_ms"]]  # every layout ran once in each round
        summary[f"step {row['variant']}: step / dp step"] = row["vs_dp"]
        if dp_rounds is not None and len(dp_rounds) == len(own):
            summary[f"step {row['variant']}: step / dp step, range"] = rounds_text(paired(own, dp_rounds))
        errors = (
            Spread.of([abs(row["predicted_step_ms"] - step) / step for step in own])
            if "predicted_step_ms" in row
            else Spread.of([abs(row["error"])])
        )
        summary[f"step {row['variant']}: planner error"] = row["error"]
        summary[f"step {row['variant']}: planner error (absolute), range"] = rounds_text(errors, percent=True)
        summary[f"step {row['variant']}: target predicted within {TOLERANCE:.0%}"] = target(
            errors, TOLERANCE, percent=True
        )
    return summary


def _cpu_seconds() -> tuple[float, float]:
    """CPU seconds this machine has been busy since boot (``/proc/stat``), and those of this process's finished children."""
    with open("/proc/stat") as stream:
        ticks = [int(v) for v in stream.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), children.ru_utime + children.ru_stime


def _launch(module: str, args: list[str], n: int, what: str, timeout: float) -> tuple[Any, dict[str, float]]:
    """Run the worker ``module`` with ``args`` on ``n`` fresh ranks: what it wrote to ``--out``, and the load around it."""
    from rapydli.cluster import mpirun

    load = machine_load()["load_1m"]
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-parallel-") as tmp:
        out = Path(tmp) / "rows.json"
        busy, ours = _cpu_seconds()
        started = time.perf_counter()
        result = mpirun.run([sys.executable, "-m", module, *args, "--out", str(out)], n=n, threads=1, timeout=timeout)
        wall = time.perf_counter() - started
        if result.returncode != 0 or not out.exists():
            raise ClusterError(f"the {what} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        written = json.loads(out.read_text())
    busy_after, ours_after = _cpu_seconds()
    return written, {
        "load_1m": load,
        "other_cores": max(0.0, (busy_after - busy) - (ours_after - ours)) / wall,
        "wall_s": wall,
    }


def zero3_launch(impl: str, size: str, n: int, steps: int, checkpointing: bool, timeout: float) -> dict[str, Any]:
    """One variant on ``n`` fresh ranks (:mod:`rapydli.bench.zero3_worker`): one row, and the load around it."""
    args = ["--impl", impl, "--size", size, "--steps", str(steps), *(["--checkpointing"] if checkpointing else [])]
    ranks, load = _launch(
        "rapydli.bench.zero3_worker", args, n, f"zero-3 benchmark's {impl} launch on {n} ranks", timeout
    )
    first = ranks[0]
    return {
        "part": "zero3",
        "impl": impl,
        "ranks": n,
        "checkpointing": checkpointing,
        "step_ms": 1e3 * max(statistics.median(r["step_s"][ZERO3_WARMUP:]) for r in ranks),  # the slowest rank's
        "peak_mib": max(r["peak_bytes"] for r in ranks) / MIB,
        "after_mib": max(r["after_bytes"] for r in ranks) / MIB,
        "activation_mib": max(r["activation_bytes"] for r in ranks) / MIB,
        "final_loss": first["loss"][-1],
        "units": first["units"],
        **load,
        "losses": first["loss"],
        "peak_mib_per_rank": [round(r["peak_bytes"] / MIB, 1) for r in ranks],
    }


def zero3_rows(size: str, ranks: list[int], steps: int, rounds: int, timeout: float) -> list[dict[str, Any]]:
    """Every variant once a round, rapydli and FSDP2 back to back (the first alternating between rounds)."""
    from rapydli.bench.zero3_worker import IMPLEMENTATIONS

    rows = []
    for round_ in range(rounds):
        for n in ranks:
            for checkpointing in (False, True):
                for impl in IMPLEMENTATIONS[:: 1 if round_ % 2 == 0 else -1]:
                    row = {"round": round_, **zero3_launch(impl, size, n, steps, checkpointing, timeout)}
                    click.echo(
                        f"round {round_ + 1}/{rounds}, {n} ranks, {impl}{', checkpointing' if checkpointing else ''}: step "
                        f"{row['step_ms']:.0f} ms, peak {row['peak_mib']:.0f} MiB a rank ({row['wall_s']:.0f} s)",
                        err=True,
                    )
                    rows.append(row)
    return rows


def _rounds(rows: list[dict[str, Any]], key: str, **match: Any) -> dict[int, Any]:
    """``key`` of the rows that match, by round."""
    return {r["round"]: r[key] for r in rows if all(r[k] == v for k, v in match.items())}


def _pair(rows: list[dict[str, Any]], key: str, top: dict[str, Any], bottom: dict[str, Any]) -> Spread:
    """``key`` of ``top``'s rows over ``bottom``'s, paired within each round both ran in."""
    a, b = _rounds(rows, key, **top), _rounds(rows, key, **bottom)
    both = sorted(set(a) & set(b))
    return paired([a[r] for r in both], [b[r] for r in both])


def _verdict(spread: Spread, at_most: bool = True) -> str:
    """:func:`rapydli.spread.target` at ``<= 1.0`` (``at_most``; else ``>= 1.0``), saying "too noisy" where the rounds straddle it."""
    found = target(spread, 1.0, at_most=at_most)
    return f"too noisy to tell: {found}" if found.startswith("unclear") else found


def zero3_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios rapydli / FSDP2, what checkpointing costs and saves, the losses compared, the load."""
    summary: dict[str, Any] = {}
    mine = [r for r in rows if r["part"] == "zero3"]
    for n in sorted({r["ranks"] for r in mine}):
        at = [r for r in mine if r["ranks"] == n]
        for checkpointing in (False, True):
            label = f"zero3 {n} ranks{', checkpointing' if checkpointing else ''}"
            for key, what in (("step_ms", "step time"), ("peak_mib", "peak memory per rank")):
                ratio = _pair(
                    at,
                    key,
                    {"impl": "rapydli", "checkpointing": checkpointing},
                    {"impl": "fsdp2", "checkpointing": checkpointing},
                )
                summary[f"{label}: {what} rapydli / FSDP2"] = ratio.median
                summary[f"{label}: {what} rapydli / FSDP2, range"] = rounds_text(ratio)
                summary[f"{label}: target {what} rapydli <= FSDP2"] = _verdict(ratio)
        for impl in ("rapydli", "fsdp2"):
            label = f"zero3 {n} ranks, {'FSDP2' if impl == 'fsdp2' else impl}: activation checkpointing"
            on, off = {"impl": impl, "checkpointing": True}, {"impl": impl, "checkpointing": False}
            overhead = _pair(at, "step_ms", on, off).minus(1.0)
            summary[f"{label} step time overhead (with / without - 1)"] = (
                f"{overhead.median:+.1%} ({rounds_text(overhead, percent=True)})"
            )
            for key, what in (("activation_mib", "activations"), ("peak_mib", "peak memory")):
                saving = _pair(at, key, off, on)
                summary[f"{label} saving in {what} (without / with)"] = f"{saving.median:.3g}x ({rounds_text(saving)})"
        worst = 0.0
        for r in at:
            if r["impl"] == "rapydli":
                peer = [
                    p
                    for p in at
                    if p["impl"] == "fsdp2" and p["round"] == r["round"] and p["checkpointing"] == r["checkpointing"]
                ]
                for p in peer:
                    worst = max([worst, *(abs(a - b) / abs(b) for a, b in zip(r["losses"], p["losses"], strict=True))])
        steps = len(at[0]["losses"])
        summary[f"zero3 {n} ranks: losses rapydli vs FSDP2, the same {steps} steps"] = (
            f"{'equal' if worst <= LOSS_TOLERANCE else 'DIFFERENT'} (largest relative difference {worst:.2g}; tolerance {LOSS_TOLERANCE:g})"
        )
    return {**summary, **_load_summary(mine, "zero3")}


def _load_summary(rows: list[dict[str, Any]], part: str) -> dict[str, str]:
    """The load around the launches of ``rows``: the load average before each, the cores other processes used during each."""
    if not rows:
        return {}
    loads, others = Spread.of([r["load_1m"] for r in rows]), Spread.of([r["other_cores"] for r in rows])
    cores = int(machine_load()["cores"])
    return {
        f"{part} load: 1-minute load average before each launch": f"median {loads.median:.2f} ({loads.low:.2f} to {loads.high:.2f}) on {cores} cores",
        f"{part} load: cores other processes used during each launch": f"median {others.median:.2f} ({others.low:.2f} to {others.high:.2f}) of {cores}"
        + ("; the machine was shared: timings drifted with the other work" if others.high > 0.25 else ""),
    }


def zero3_context(size: str, steps: int) -> dict[str, Any]:
    """What the zero-3 part trained, for the summary."""
    import torch

    from rapydli.bench.zero3_worker import LR, SIZES

    chosen = SIZES[size]
    return {
        "zero3 model": f"{size}: GPT-2-style, {chosen.n_layer} blocks of width {chosen.n_embd}, vocabulary {chosen.vocab}, "
        f"{chosen.parameters / 1e6:.1f} M parameters (fp32), tied embeddings",
        "zero3 training": f"global batch {chosen.global_batch} x {chosen.positions} tokens, AdamW lr {LR:g}, {steps} steps a launch "
        f"({ZERO3_WARMUP} warm-up), one thread a rank; peer: FSDP2 (fully_shard) of torch {torch.__version__} over gloo",
    }


def peers_launch(impl: str, model: str, layout: str, size: str, steps: int, timeout: float) -> dict[str, Any]:
    """One variant on 2 fresh ranks (:mod:`rapydli.bench.peers_worker`): its row, and the load around it."""
    args = ["--impl", impl, "--model", model, "--layout", layout, "--size", size, "--steps", str(steps)]
    row, load = _launch(
        "rapydli.bench.peers_worker", args, 2, f"peers benchmark's {impl} {model} {layout} launch", timeout
    )
    return {"part": "peers", **row, **load}


def peers_rows(size: str, steps: int, rounds: int, timeout: float) -> list[dict[str, Any]]:
    """Every (model, layout) once a round, rapydli and torch back to back (the first alternating between rounds)."""
    from rapydli.bench.peers_worker import IMPLEMENTATIONS, LAYOUTS, MODELS

    rows = []
    for round_ in range(rounds):
        for model in MODELS:
            for layout in LAYOUTS:
                for impl in IMPLEMENTATIONS[:: 1 if round_ % 2 == 0 else -1]:
                    row = {"round": round_, **peers_launch(impl, model, layout, size, steps, timeout)}
                    click.echo(
                        f"round {round_ + 1}/{rounds}, {model} {layout}, {impl}: step {row['step_ms']:.0f} ms ({row['wall_s']:.0f} s)",
                        err=True,
                    )
                    rows.append(row)
    return rows


def peers_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Step time torch / rapydli per model and layout (paired within rounds), the losses compared, the load."""
    summary: dict[str, Any] = {}
    mine = [r for r in rows if r["part"] == "peers"]
    for model, layout in dict.fromkeys((r["model"], r["layout"]) for r in mine):
        label, at = f"peers {model} {layout}", {"model": model, "layout": layout}
        ratio = _pair(mine, "step_ms", {"impl": "torch", **at}, {"impl": "rapydli", **at})
        summary[f"{label}: step time torch / rapydli"] = ratio.median
        summary[f"{label}: step time torch / rapydli, range"] = rounds_text(ratio)
        summary[f"{label}: target rapydli at least as fast (torch / rapydli >= 1)"] = _verdict(ratio, at_most=False)
        ours, theirs = _rounds(mine, "losses", impl="rapydli", **at), _rounds(mine, "losses", impl="torch", **at)
        steps = (
            1 if layout == "pp2" else min((len(losses) for losses in ours.values()), default=0)
        )  # torch's pipeline: the tied embedding two copies
        pairs = [
            pair for r in sorted(set(ours) & set(theirs)) for pair in list(zip(ours[r], theirs[r], strict=True))[:steps]
        ]
        worst = max((abs(a - b) / abs(b) for a, b in pairs), default=float("nan"))
        what = "the first step" if steps == 1 else f"the same {steps} steps"
        summary[f"{label}: losses rapydli vs torch, {what}"] = (
            f"{'equal' if worst <= LOSS_TOLERANCE else 'DIFFERENT'} (largest relative difference {worst:.2g}; tolerance {LOSS_TOLERANCE:g})"
        )
    return {**summary, **_load_summary(mine, "peers")}


def peers_context(size: str, steps: int) -> dict[str, Any]:
    """What the peers part trained, for the summary."""
    import torch

    from rapydli.bench.peers_worker import LR, MICROBATCHES, MODELS, SHAPES, WARMUP

    shape = SHAPES[size]
    sizes = {name: sum(p.numel() for p in shape.model(name).parameters()) / 1e6 for name in MODELS}
    return {
        "peers models": f"{size}: gpt2, GPT-2-style, {shape.layers} blocks of width {shape.width}, {shape.heads} heads, fused c_attn, "
        f"tied embeddings, {sizes['gpt2']:.2f} M parameters; llama, Llama-style, {shape.layers} layers of width "
        f"{shape.width}, {shape.heads} query and {shape.kv_heads} key/value heads, SwiGLU {shape.intermediate}, "
        f"{sizes['llama']:.2f} M parameters; vocabulary {shape.vocab}, fp32",
        "peers training": f"batch {shape.batch} x {shape.positions} tokens (synthetic), AdamW lr {LR:g}, {steps} steps a launch "
        f"({WARMUP} warm-up), 2 ranks of one thread; tp2: 2-way tensor parallel, pp2: 2 stages, 1F1B, "
        f"{MICROBATCHES} micro-batches",
        "peers peer": f"torch {torch.__version__} over gloo: parallelize_module (ColwiseParallel / RowwiseParallel) and "
        "torch.distributed.pipelining (PipelineStage, Schedule1F1B); its pipeline keeps GPT-2's tied embedding "
        "as two copies (one a stage, not summed), so only the first step's losses are compared there",
    }


def _rank_counts(text: str) -> list[int]:
    try:
        counts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        counts = []
    if not counts or any(n < 2 for n in counts):
        raise click.BadParameter(f"{text!r}: comma-separated rank counts, each >= 2", param_hint="--ranks")
    return counts


@click.command("parallel")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here."
)
@click.option("--parts", default="memory,time", show_default=True, help="Comma-separated: memory, time.")
@click.option(
    "--steps",
    type=click.IntRange(min=2),
    default=None,
    help="Steps per layout run (2 are warm-up; default 12); with --zero 3, per launch (1 is warm-up; default 3); "
    "with --peers, per launch (2 are warm-up; default 6).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Alternated rounds of the step-time part (with --zero 3 or --peers: of every launch).",
)
@click.option(
    "--timeout",
    type=float,
    default=600.0,
    show_default=True,
    help="Seconds before the memory launch (with --zero 3 or --peers: each launch) is killed.",
)
@click.option(
    "--zero",
    type=click.Choice(["3"]),
    default=None,
    help="Instead of the parts: ZeRO-3 against PyTorch's FSDP2, with and without activation checkpointing.",
)
@click.option(
    "--peers",
    is_flag=True,
    default=False,
    help="Instead of the parts: tensor parallelism and the 1F1B pipeline on 2 ranks against PyTorch's own, GPT-2- and Llama-style.",
)
@click.option("--ranks", default="2,4", show_default=True, help="With --zero 3: comma-separated rank counts.")
@click.option(
    "--model",
    "time_model",
    type=click.Choice(sorted(TIME_MODELS)),
    default="tiny_lm",
    show_default=True,
    help="The model of the step-time part: tiny_lm, or the GPT-2-style or Llama-style model of --peers' bench size.",
)
@click.option(
    "--size",
    type=click.Choice(sorted(set(SIZES) | set(SHAPES))),
    default=None,
    help="With --zero 3 (default gpt2-63m) or --peers (default bench): the models and batch (tiny: for tests).",
)
def command(
    json_path: str | None,
    parts: str,
    steps: int | None,
    rounds: int,
    timeout: float,
    zero: str | None,
    peers: bool,
    ranks: str,
    time_model: str,
    size: str | None,
) -> None:
    """Memory per rank of dp / ZeRO-1 / ZeRO-2 / pipeline / tensor parallel vs the ZeRO formulas; step times vs dp; planner error.

    With ``--zero 3``: ZeRO-3 against PyTorch's FSDP2 on a GPT-2-style model, step time and peak memory per rank, with and without activation checkpointing.
    With ``--peers``: 2-way tensor parallelism and a 2-stage 1F1B pipeline against PyTorch's own, on a GPT-2-style and a Llama-style model.
    """
    if zero is not None and peers:
        raise click.BadParameter("choose one of --zero 3 and --peers", param_hint="--peers")
    if peers:
        from rapydli.bench.peers_worker import WARMUP

        size = "bench" if size is None else size
        if size not in SHAPES:
            raise click.BadParameter(f"{size!r}: with --peers, one of {', '.join(sorted(SHAPES))}", param_hint="--size")
        steps = 6 if steps is None else steps
        if steps <= WARMUP:
            raise click.BadParameter(
                f"{steps}: with --peers, more than the {WARMUP} warm-up steps", param_hint="--steps"
            )
        launched = peers_rows(size, steps, rounds, timeout)
        emit("parallel --peers", launched, {**peers_context(size, steps), **peers_summary(launched)}, json_path)
        return
    if zero is not None:
        size = "gpt2-63m" if size is None else size
        if size not in SIZES:
            raise click.BadParameter(f"{size!r}: with --zero 3, one of {', '.join(sorted(SIZES))}", param_hint="--size")
        counts = _rank_counts(ranks)
        chosen = SIZES[size]
        if any(chosen.global_batch % n for n in counts):
            raise click.BadParameter(
                f"{ranks!r}: the global batch of --size {size} ({chosen.global_batch}) must divide by each",
                param_hint="--ranks",
            )
        steps = 3 if steps is None else steps
        launched = zero3_rows(size, counts, steps, rounds, timeout)
        emit("parallel --zero 3", launched, {**zero3_context(size, steps), **zero3_summary(launched)}, json_path)
        return
    steps = 12 if steps is None else steps
    if steps < 3:
        raise click.BadParameter(f"{steps}: the layouts' runs need at least 3 (2 are warm-up)", param_hint="--steps")
    wanted = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - {"memory", "time"})
    if unknown:
        raise click.BadParameter(f"unknown part(s) {', '.join(unknown)}; allowed: memory, time", param_hint="--parts")
    rows: list[dict[str, Any]] = []
    if "memory" in wanted:
        rows += memory_rows(min(steps, 4), timeout)
    if "time" in wanted:
        rows += time_rows(steps, rounds, time_model)
    emit("parallel", rows, summarize(rows), json_path)
