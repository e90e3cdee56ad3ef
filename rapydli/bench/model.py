"""``rapydli bench model --json PATH``: what keeping a run's trained model costs at its end, gathered or written in pieces.

Every run used to gather its whole model to rank 0 and ship it to the notebook (every
sweep trial and scaling point too; under ZeRO-3, building on one rank the model that was
sharded because it does not fit there). Now ``rd.train``'s ranks write their own pieces
(``result.model()`` assembles them when asked) and sweeps and scaling studies keep
nothing. This benchmark measures the three on the same trained model in the same
processes (:mod:`rapydli.bench.model_worker` says what and how): ``gather`` (the peer:
the old way), ``write`` (``rd.train`` now) and ``none`` (a sweep trial now), in
plain data parallelism and at ZeRO-3, on ``--ranks`` ranks, the order alternating
between ``--rounds`` interleaved rounds.

Printed per layout: the end-of-run time of ``write`` and ``none`` against ``gather``
(ratios paired within rounds, with their range and a verdict only where every round
agrees), the most model bytes any rank handles for each (rank 0 assembles the whole model
for ``gather``; for ``write`` the most any rank writes), what ``result.model()`` then costs on the notebook when asked, and the load.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import click

from rapydli.spread import Spread, paired, rounds_text

MIB = float(1 << 20)


def rows_of(size: str, ranks: int, rounds: int, timeout: float) -> list[dict[str, Any]]:
    """One launch per layout (ZeRO 0, then 3), every variant measured ``rounds`` times inside it; the rows with the load around each."""
    from rapydli.bench.parallel import _launch

    rows = []
    for zero in (0, 3):
        measured, load = _launch(
            "rapydli.bench.model_worker",
            ["--size", size, "--zero", str(zero), "--rounds", str(rounds)],
            ranks,
            f"model-keeping benchmark at ZeRO-{zero} on {ranks} ranks",
            timeout,
        )
        rows += [{**row, **load} for row in measured]
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per layout: each variant's median time and range, its ratio to ``gather`` paired by round, bytes held and assembly time."""
    summary: dict[str, Any] = {}
    for zero in sorted({r["zero"] for r in rows}):
        mine = [r for r in rows if r["zero"] == zero]
        by = {
            v: sorted((r for r in mine if r["variant"] == v), key=lambda r: r["round"])
            for v in ("gather", "write", "none")
        }
        gather = [r["seconds"] for r in by["gather"]]
        layout: dict[str, Any] = {}
        for variant, found in by.items():
            times = Spread.of([r["seconds"] for r in found])
            layout[variant] = {
                "ms": 1e3 * times.median,
                "ms_low": 1e3 * times.low,
                "ms_high": 1e3 * times.high,
                "held_mib_max_rank": max(max(r["held_bytes"]) for r in found) / MIB if found else None,
            }
            if variant != "gather":
                ratio = paired([r["seconds"] for r in found], gather)
                layout[variant].update(
                    ratio_to_gather=ratio.median,
                    ratio_low=ratio.low,
                    ratio_high=ratio.high,
                    verdict=_verdict(ratio),
                    rounds=rounds_text(ratio),
                )
        assembled = [r["assemble_s"] for r in by["write"] if r["assemble_s"] is not None]
        layout["assemble_ms_when_asked"] = 1e3 * statistics.median(assembled) if assembled else None
        layout["load_1m"] = [round(r["load_1m"], 2) for r in mine if r["variant"] == "gather"][:1]
        layout["other_cores"] = round(max(r["other_cores"] for r in mine), 2)
        summary[f"zero{zero}"] = layout
    return summary


def _verdict(ratio: Spread) -> str:
    """``faster than gather in every round``, ``slower ...``, or why the rounds allow no conclusion."""
    said = ratio.verdict(1.0)
    if said == "below 1":
        return "faster than gather in every round"
    if said == "above 1":
        return "slower than gather in every round"
    return said


@click.command("model")
@click.option("-n", "--ranks", "ranks", type=click.IntRange(min=2), default=2, show_default=True, help="MPI ranks.")
@click.option(
    "--size",
    type=click.Choice(["gpt2-63m", "tiny"]),
    default="gpt2-63m",
    show_default=True,
    help="The model (rapydli.bench.zero3_worker.SIZES); tiny for tests.",
)
@click.option(
    "--rounds", type=click.IntRange(min=1), default=5, show_default=True, help="Interleaved rounds of every variant."
)
@click.option("--timeout", type=float, default=900.0, show_default=True, help="Seconds before every rank is killed.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here."
)
def command(ranks: int, size: str, rounds: int, timeout: float, json_path: str | None) -> None:
    """What a run's end costs to keep its model: gathered to rank 0 (before), written in pieces (rd.train now), or not at all (sweeps)."""
    rows = rows_of(size, ranks, rounds, timeout)
    summary = summarize(rows)
    for layout, found in summary.items():
        gather = found["gather"]
        click.echo(
            f"{layout} on {ranks} ranks ({rows[0]['parameters'] / 1e6:.1f} M parameters): gather {gather['ms']:.0f} ms "
            f"({gather['ms_low']:.0f}-{gather['ms_high']:.0f}), rank 0 assembles {gather['held_mib_max_rank']:.0f} MiB"
        )
        for variant in ("write", "none"):
            v = found[variant]
            click.echo(
                f"  {variant}: {v['ms']:.0f} ms, {v['ratio_to_gather']:.2f}x gather ({v['rounds']}; {v['verdict']}); "
                f"the most any rank writes {v['held_mib_max_rank']:.0f} MiB"
            )
        click.echo(
            f"  result.model() when asked: {found['assemble_ms_when_asked']:.0f} ms on the notebook; load {found['load_1m']} "
            f"before, other processes used up to {found['other_cores']} cores"
        )
    if json_path:
        Path(json_path).write_text(json.dumps({"rows": rows, "summary": summary}, indent=1))
