"""``rapydli bench pipeline --json PATH``: the pipeline's bubble, activation memory and throughput.

Re-launches :mod:`rapydli.bench.pipeline_worker` through :func:`rapydli.cluster.mpirun.run`:

* **bubble**: stages that sleep a calibrated time (forward ``--forward-ms``, backward
  twice that), p in {2, 4}, m in {1, 2, 4, 8}, GPipe and 1F1B: the measured idle
  fraction against ``(p - 1) / (m + p - 1)``; target within 10 % (relative) at m >= 4.
* **memory**: peak bytes autograd holds for backward on each rank for GPipe, 1F1B and
  data parallelism on one MLP and global batch, on p = 2 and p = 4 ranks
  (``--memory-ranks``; bytes, not times, so 4 ranks on 2 cores are fine), against the
  theory: the micro-batches the schedule keeps alive (GPipe m, 1F1B ``min(p - s, m)``)
  times one micro-batch's bytes on the rank's stage. GPipe grows with m, 1F1B with p.
* **throughput**: 1F1B on 2 ranks, RaPyDLI's executor against
  ``torch.distributed.pipelining.Schedule1F1B`` over gloo, same split, same m, launches
  alternated for ``--rounds`` rounds; every torch launch is bounded by ``--peer-timeout``
  (peers' gloo pipelines are known to hang): a hang is reported, not waited out.
  Target: RaPyDLI's step <= torch's (ratio torch / rapydli >= 1.0). The peer is the
  installed torch; its version is in every throughput row and the summary, which says
  whether it is :data:`PEER_TORCH`, the version these figures were checked against.
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

BUBBLE_TOLERANCE = 0.10
#: The torch release whose ``torch.distributed.pipelining`` the throughput figures were checked against.
PEER_TORCH = "2.13"


def _launch(part: str, n: int, timeout: float, *args: str) -> list[dict[str, Any]] | None:
    """Rows of one worker launch; None when it timed out (the ranks are killed)."""
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-pipeline-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [sys.executable, "-m", "rapydli.bench.pipeline_worker", "--part", part, "--out", str(out), *args]
        try:
            result = mpirun.run(argv, n=n, threads=1, timeout=timeout)
        except ClusterError as exc:
            if "did not finish within" in str(exc):
                return None
            raise
        if result.returncode != 0 or not out.exists():
            raise ClusterError(
                f"the pipeline benchmark's {part} part failed on {n} ranks:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
            )
        return json.loads(out.read_text())


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios and targets from the rows."""
    summary: dict[str, Any] = {}
    for row in rows:
        if row["part"] == "bubble":
            key = f"bubble {row['schedule']} p={row['stages']} m={row['microbatches']}"
            summary[f"{key}: measured / theory"] = row["bubble_measured"] / row["bubble_theory"]
            if row["microbatches"] >= 4:
                summary[f"{key}: target within {BUBBLE_TOLERANCE:.0%}"] = (
                    "met" if row["relative_error"] <= BUBBLE_TOLERANCE else "not met"
                )
    summary.update(_memory_summary([row for row in rows if row["part"] == "memory"]))
    rounds: dict[Any, dict[str, float]] = {}  # the two peers' step in each alternated round (launched back to back)
    for variant in ("rapydli", "torch"):
        timed = [row for row in rows if row["part"] == "throughput" and row["variant"] == variant and "step_ms" in row]
        for position, row in enumerate(timed):
            rounds.setdefault(row.get("round", position), {})[variant] = row["step_ms"]
    both = [steps for steps in rounds.values() if len(steps) == 2]  # a round whose torch launch timed out has no pair
    if both:
        ratio = paired([steps["torch"] for steps in both], [steps["rapydli"] for steps in both])
        summary["throughput 1f1b: torch step / rapydli step"] = ratio.median
        summary["throughput 1f1b: torch step / rapydli step, range"] = rounds_text(ratio)
        summary["throughput target rapydli >= 1.0x torch"] = target(ratio, 1.0, at_most=False)
    versions = sorted({row["torch"] for row in rows if row["part"] == "throughput" and "torch" in row})
    if versions:
        pinned = all(v.split("+")[0].startswith(PEER_TORCH + ".") or v.split("+")[0] == PEER_TORCH for v in versions)
        summary["throughput peer: torch.distributed.pipelining of torch"] = (
            f"{', '.join(versions)} (checked against {PEER_TORCH}: {'yes' if pinned else 'no'})"
        )
    hung = [row for row in rows if row["part"] == "throughput" and row.get("timed_out")]
    if hung:
        summary["torch.distributed.pipelining launches that timed out"] = len(hung)
    return summary


def _memory_summary(memory: list[dict[str, Any]]) -> dict[str, Any]:
    """Per launch (p ranks) and m: GPipe / 1F1B and the theory, measured / theory, 1F1B / data parallel; 1F1B's growth with p."""
    summary: dict[str, Any] = {}
    for p in sorted({row["ranks"] for row in memory}):
        dp = {row["rank"]: row for row in memory if row["ranks"] == p and row["variant"] == "data_parallel"}
        for m in sorted(
            {row["microbatches"] for row in memory if row["ranks"] == p and row["variant"] != "data_parallel"}
        ):
            pick = {
                (row["variant"], row["rank"]): row for row in memory if row["ranks"] == p and row["microbatches"] == m
            }
            ranks = sorted(rank for variant, rank in pick if variant == "1f1b")
            for schedule in ("gpipe", "1f1b"):
                ratios = [pick[schedule, r]["peak_activation_bytes"] / pick[schedule, r]["theory_bytes"] for r in ranks]
                summary[f"memory p={p} m={m} {schedule}: measured / theory, per rank"] = ", ".join(
                    f"{v:.2f}" for v in ratios
                )
            for rank in ranks:
                gpipe, ofob = pick["gpipe", rank], pick["1f1b", rank]
                summary[f"memory p={p} m={m} rank {rank}: gpipe / 1f1b"] = (
                    gpipe["peak_activation_bytes"] / ofob["peak_activation_bytes"]
                )
                summary[f"memory p={p} m={m} rank {rank}: theory (live micro-batches)"] = (
                    gpipe["live_microbatches"] / ofob["live_microbatches"]
                )
                if rank in dp:
                    summary[f"memory p={p} m={m} rank {rank}: 1f1b / data parallel"] = (
                        ofob["peak_activation_bytes"] / dp[rank]["peak_activation_bytes"]
                    )
    first = [row for row in memory if row["variant"] == "1f1b" and row["rank"] == 0]
    for m in sorted({row["microbatches"] for row in first}):
        live = {row["ranks"]: row["live_microbatches"] for row in first if row["microbatches"] == m}
        if len(live) > 1:
            summary[f"memory m={m}: 1f1b rank 0 live micro-batches by p"] = ", ".join(
                f"p={p}: {n}" for p, n in sorted(live.items())
            )
    return summary


@click.command("pipeline")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here."
)
@click.option(
    "--parts",
    default="bubble,memory,throughput",
    show_default=True,
    help="Comma-separated: bubble, memory, throughput.",
)
@click.option(
    "--forward-ms",
    type=click.FloatRange(min=1.0),
    default=40.0,
    show_default=True,
    help="Sleep of a synthetic stage's forward (backward: twice).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Measured steps per configuration and launch.",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=3,
    show_default=True,
    help="Alternated RaPyDLI/torch launches (throughput).",
)
@click.option(
    "--microbatches", type=click.IntRange(min=1), default=4, show_default=True, help="m of the throughput part."
)
@click.option(
    "--batch",
    type=click.IntRange(min=1),
    default=64,
    show_default=True,
    help="Batch of the memory and throughput parts.",
)
@click.option(
    "--memory-ranks", default="2,4", show_default=True, help="Comma-separated p (ranks = stages) of the memory part."
)
@click.option(
    "--peer-timeout",
    type=float,
    default=120.0,
    show_default=True,
    help="Seconds before a torch pipelining launch is killed.",
)
@click.option(
    "--timeout", type=float, default=600.0, show_default=True, help="Seconds before any other launch is killed."
)
def command(
    json_path: str | None,
    parts: str,
    forward_ms: float,
    steps: int,
    rounds: int,
    microbatches: int,
    batch: int,
    memory_ranks: str,
    peer_timeout: float,
    timeout: float,
) -> None:
    """Pipeline bubble (sleeping stages) vs theory, activation memory per rank, 1F1B vs torch.distributed.pipelining."""
    wanted = [p.strip() for p in parts.split(",") if p.strip()]
    unknown = sorted(set(wanted) - {"bubble", "memory", "throughput"})
    if unknown:
        raise click.BadParameter(
            f"unknown part(s) {', '.join(unknown)}; allowed: bubble, memory, throughput", param_hint="--parts"
        )
    try:
        memory_p = [int(p) for p in memory_ranks.split(",") if p.strip()]
    except ValueError:
        memory_p = []
    if not memory_p or any(p < 2 or batch % p for p in memory_p) or batch % 8:
        raise click.BadParameter(
            f"{memory_ranks!r} with --batch {batch}: integers >= 2 that divide the batch, and a batch that 8 divides "
            "(the memory part cuts it into up to 8 micro-batches)",
            param_hint="--memory-ranks",
        )
    rows: list[dict[str, Any]] = []
    if "bubble" in wanted:
        for p in (2, 4):
            rows += _launch("bubble", p, timeout, "--forward-ms", str(forward_ms), "--steps", str(steps)) or []
    if "memory" in wanted:
        for p in memory_p:
            rows += _launch("memory", p, timeout, "--batch", str(batch)) or []
    if "throughput" in wanted:
        common = ("--batch", str(batch), "--microbatches", str(microbatches), "--steps", str(max(steps, 5)))
        for round_ in range(rounds):
            for peer, limit in (("rapydli", timeout), ("torch", peer_timeout)):
                got = _launch(peer, 2, limit, *common)
                rows += (
                    [{**row, "round": round_} for row in got]
                    if got is not None
                    else [{"part": "throughput", "variant": peer, "timed_out": True, "round": round_}]
                )
    emit("pipeline", rows, summarize(rows), json_path)
