"""``rapydli bench allreduce -n 2 --json PATH``: RaPyDLI's allreduce against MPI and gloo.

Re-launches :mod:`rapydli.bench.allreduce_worker` on ``n`` ranks (one thread each)
through :func:`rapydli.cluster.mpirun.run`. Message sizes 4 B ... ``--max-bytes``
(powers of 4) of float32; algorithms ``ring``, ``mpi``, ``shm``, ``auto`` (RaPyDLI), ``mpi4py``
(mpi4py's own ``Allreduce`` on numpy: the MPI library alone) and torch ``gloo``. Per
row: median time (slowest rank), algbw = bytes / time and busbw = algbw x 2(n-1)/n, as
nccl-tests define them. The run also re-measures and caches the table ``auto`` decides
by (``$RAPYDLI_HOME/comm/``).

Targets (issue 3): ``ring`` busbw >= 0.9x MPI native (``mpi4py``) at >= 1 MB; ``auto``
>= 0.95x the best of the others at every size; judged on the median time and, as
second views for a shared machine, on the fastest rep (``@min``) and on the ratios within
each rep (``@paired``: their median, and their middle half as the interval; a target is
met or not only where the middle half of the reps is on one side of it, else unclear).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from rapydli.bench.report import emit
from rapydli.cluster import mpirun
from rapydli.errors import ClusterError, ConfigError

RING_TARGET, RING_FROM_BYTES, AUTO_TARGET = 0.9, 1 << 20, 0.95


def _ratios(cells: dict[str, dict[str, Any]], key: str) -> tuple[float | None, float | None]:
    """(ring / mpi4py, auto / best of the others) of the busbw column ``key``."""
    ring = cells["ring"][key] / cells["mpi4py"][key] if "ring" in cells and "mpi4py" in cells else None
    others = [cell[key] for name, cell in cells.items() if name != "auto"]
    auto = cells["auto"][key] / max(others) if "auto" in cells and others else None
    return ring, auto


@dataclass(frozen=True)
class RepRatios:
    """The ratios of two algorithms' times within each rep: their median and the middle half (lower to upper quartile)."""

    median: float
    q1: float
    q3: float

    @classmethod
    def of(cls, ratios: list[float]) -> RepRatios:
        if len(ratios) < 2:
            return cls(ratios[0], ratios[0], ratios[0])
        q1, median, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
        return cls(median, q1, q3)

    def text(self) -> str:
        """``"0.93 to 1.02"``: the middle half of the reps' ratios."""
        return f"{self.q1:.3g} to {self.q3:.3g}"

    def verdict(self, limit: float) -> str:
        """``met`` (the middle half at or above ``limit``), ``not met`` (below it) or ``unclear`` (it spans ``limit``)."""
        return "met" if self.q1 >= limit else "not met" if self.q3 < limit else "unclear"


def _paired(cells: dict[str, dict[str, Any]]) -> tuple[RepRatios | None, RepRatios | None]:
    """(ring / mpi4py, auto / best of the others) from the ratios within each rep.

    The reps of one size interleave every algorithm, so a rep's ratio compares calls made
    milliseconds apart; their median is not moved by the machine getting slower or faster
    between reps, which the ratio of two medians is, and their quartiles say how much the
    reps agree. "Best" is the other algorithm with the lowest median time.
    """

    def rep_ratios(faster: str, slower: str) -> RepRatios:
        return RepRatios.of(
            [b / a for a, b in zip(cells[faster]["rep_times_us"], cells[slower]["rep_times_us"], strict=True)]
        )

    ring = rep_ratios("ring", "mpi4py") if "ring" in cells and "mpi4py" in cells else None
    others = [name for name in cells if name != "auto"]
    best = min(others, key=lambda name: cells[name]["time_us"]) if others else None
    auto = rep_ratios("auto", best) if "auto" in cells and best is not None else None
    return ring, auto


def _paired_targets(ring: list[RepRatios], auto: list[RepRatios]) -> dict[str, Any]:
    """The targets on the reps' ratios: met or not where the middle half of the reps is on one side, unclear where it spans the target."""
    summary: dict[str, Any] = {}
    for name, ratios, limit, where in (
        ("ring", ring, RING_TARGET, "MPI native at >= 1 MB"),
        ("auto", auto, AUTO_TARGET, "best of the others at every size"),
    ):
        key = f"target {name} >= {limit}x {where} (paired)"
        if not ratios:
            summary[key] = "not measured (raise --max-bytes to >= 1 MiB)" if name == "ring" else "not measured"
            continue
        verdicts = [r.verdict(limit) for r in ratios]
        missed, unclear = verdicts.count("not met"), verdicts.count("unclear")
        if not missed and not unclear:
            summary[key] = "met"
        elif missed:
            summary[key] = f"not met at {missed} of {len(ratios)} sizes" + (
                f", unclear at {unclear}" if unclear else ""
            )
        else:
            summary[key] = (
                f"unclear at {unclear} of {len(ratios)} sizes (the middle half of the reps spans {limit}x: "
                "repeat on a quieter machine)"
            )
        worst = min(ratios, key=lambda r: r.median)
        summary[
            f"{name} / {'MPI native' if name == 'ring' else 'best of the others'}, worst size, reps' median and middle half (paired)"
        ] = f"{worst.median:.3g} ({worst.text()})"
    return summary


def _targets(label: str, ring: list[float], auto: list[float]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    name = f"target ring >= {RING_TARGET}x MPI native at >= 1 MB ({label})"
    if ring:
        summary[f"ring busbw / MPI native (mpi4py), worst at >= 1 MB ({label})"] = min(ring)
        summary[name] = "met" if min(ring) >= RING_TARGET else "not met"
    else:
        summary[name] = "not measured (raise --max-bytes to >= 1 MiB)"
    if auto:
        summary[f"auto busbw / best of the others, worst size ({label})"] = min(auto)
        summary[f"auto busbw / best of the others, median size ({label})"] = sorted(auto)[len(auto) // 2]
        failed = sum(r < AUTO_TARGET for r in auto)
        summary[f"target auto >= {AUTO_TARGET}x best of the others at every size ({label})"] = (
            "met" if not failed else f"not met at {failed} of {len(auto)} sizes"
        )
    return summary


def summarize(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One wide row per size (time and busbw per algorithm, ratios) and the targets, met or not.

    Ratios and targets are computed on the median time (the main figures), on the
    minimum time of the reps (``@min``: each algorithm when its ranks had their cores) and
    as the median of the ratios within each rep (``@paired``, see :func:`_paired`).
    """
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        by_size.setdefault(row["bytes"], {})[row["algorithm"]] = row
    table = []
    collected: dict[str, tuple[list[float], list[float]]] = {"median": ([], []), "min": ([], [])}
    paired_ratios: tuple[list[RepRatios], list[RepRatios]] = ([], [])
    for nbytes, cells in sorted(by_size.items()):
        wide: dict[str, Any] = {"bytes": nbytes}
        for name, cell in cells.items():
            wide[f"{name}_us"] = cell["time_us"]
        for name, cell in cells.items():
            wide[f"{name}_busbw"] = cell["busbw_GBps"]
        if all("rep_times_us" in cell for cell in cells.values()):
            ring_reps, auto_reps = _paired(cells)
            for name, found, kept, large in (
                ("ring/mpi4py", ring_reps, paired_ratios[0], nbytes >= RING_FROM_BYTES),
                ("auto/best", auto_reps, paired_ratios[1], True),
            ):
                if found is not None:
                    wide[f"{name}@paired"], wide[f"{name}@paired middle half"] = found.median, found.text()
                    if large:
                        kept.append(found)
        for label, key, suffix in (("median", "busbw_GBps", ""), ("min", "min_busbw_GBps", "@min")):
            if not all(key in cell for cell in cells.values()):
                continue
            ring, auto = _ratios(cells, key)
            if ring is not None:
                wide[f"ring/mpi4py{suffix}"] = ring
                if nbytes >= RING_FROM_BYTES:
                    collected[label][0].append(ring)
            if auto is not None:
                wide[f"auto/best{suffix}"] = auto
                collected[label][1].append(auto)
        if "auto" in cells:
            wide["auto_picked"] = cells["auto"].get("auto_picked")
        table.append(wide)
    summary: dict[str, Any] = {}
    for label, (rings, autos) in collected.items():
        if rings or autos or label == "median":
            summary.update(_targets(label, rings, autos))
    if paired_ratios[0] or paired_ratios[1]:
        summary.update(_paired_targets(*paired_ratios))
    return table, summary


@click.command()
@click.option("-n", "--ranks", "n", default=2, show_default=True, help="MPI ranks.")
@click.option(
    "--min-bytes",
    default=4,
    show_default=True,
    help="Smallest message timed (bytes); auto's measurement still starts at 4 B.",
)
@click.option(
    "--max-bytes", default=256 << 20, show_default=True, help="Largest message (bytes); sizes are 4 B x 4^k up to it."
)
@click.option(
    "--algorithms", default="ring,mpi,shm,auto,mpi4py,gloo", show_default=True, help="Comma-separated subset to time."
)
@click.option("--max-reps", default=200, show_default=True, help="Most timed repetitions per size and algorithm.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False), default=None, help="Write the rows and summary here."
)
@click.option("--timeout", default=1800.0, show_default=True, help="Seconds before all ranks are killed.")
@click.option(
    "--hosts", default=None, help="Run the ranks on these hosts over ssh, e.g. h1,h2 (the ssh launcher's hosts)."
)
@click.option("--ssh-command", default=None, help="With --hosts: the ssh program mpiexec runs to reach them.")
@click.option("--interface", default=None, help="With --hosts: the network interface MPI uses, e.g. ib0.")
@click.option(
    "--transport",
    type=click.Choice(["default", "tcp"]),
    default="default",
    show_default=True,
    help="With --hosts: 'tcp' forces MPI traffic onto TCP.",
)
def command(
    n: int,
    min_bytes: int,
    max_bytes: int,
    algorithms: str,
    max_reps: int,
    json_path: str | None,
    timeout: float,
    hosts: str | None,
    ssh_command: str | None,
    interface: str | None,
    transport: str,
) -> None:
    """Allreduce time, algbw and busbw per message size: ring, mpi, auto vs mpi4py and gloo."""
    from rapydli.bench.allreduce_worker import ALGORITHMS
    from rapydli.cluster.sshhosts import mpiexec_arguments

    if n < 2:
        raise ConfigError(f"-n {n} is invalid: allreduce needs at least 2 ranks")
    if max_reps < 3:
        raise ConfigError(f"--max-reps {max_reps} is invalid: it must be >= 3")
    if max_bytes < 4:
        raise ConfigError(f"--max-bytes {max_bytes} is invalid: it must be >= 4")
    unknown = sorted(set(algorithms.split(",")) - set(ALGORITHMS))
    if unknown:
        raise ConfigError(f"--algorithms: unknown {', '.join(unknown)}; allowed: {', '.join(ALGORITHMS)}")
    mpi_args: list[str] = []
    env: dict[str, str] = {}
    if hosts is not None:  # the ssh launcher's options, translated as for engines
        options = {"hosts": hosts, "transport": transport, "ssh_command": ssh_command, "interface": interface}
        mpi_args, env = mpiexec_arguments({k: v for k, v in options.items() if v is not None})
    elif ssh_command or interface or transport != "default":
        raise ConfigError("--ssh-command, --interface and --transport apply to --hosts only")
    with tempfile.TemporaryDirectory(prefix="rapydli-bench-allreduce-") as tmp:
        out = Path(tmp) / "rows.json"
        argv = [
            sys.executable,
            "-m",
            "rapydli.bench.allreduce_worker",
            "--out",
            str(out),
            "--min-bytes",
            str(min_bytes),
            "--max-bytes",
            str(max_bytes),
            "--algorithms",
            algorithms,
            "--max-reps",
            str(max_reps),
        ]
        result = mpirun.run(argv, n=n, threads=1, timeout=timeout, mpi_args=mpi_args, env=env)
        if result.returncode != 0 or not out.exists():
            raise ClusterError(
                f"allreduce benchmark failed on {n} ranks:\n{result.stdout[-4000:]}{result.stderr[-4000:]}"
            )
        payload = json.loads(out.read_text())
    table, summary = summarize(payload["rows"])
    summary = {
        "ranks": n,
        "hosts": ",".join(payload.get("hosts", [])) or "this machine",
        "transport": transport,
        "mpi library": payload["mpi_library"],
        "auto table": payload["auto_table"]["path"],
        "auto choices (4 B, 16 B, ...)": ",".join(payload["auto_table"]["choices"]),
        "auto measurement seconds": payload["tune_seconds"],
        **summary,
    }
    emit("allreduce", table, summary, json_path)
    if json_path:  # keep the raw per-algorithm rows and the auto measurement beside the table
        saved = json.loads(Path(json_path).read_text())
        saved.update({"raw_rows": payload["rows"], "auto_table": payload["auto_table"]})
        Path(json_path).write_text(json.dumps(saved, indent=2, default=str))
