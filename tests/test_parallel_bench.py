"""``rapydli bench pipeline``: its summary, and the memory part on 2 real ranks (bytes, not timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rapydli.bench.pipeline import command, summarize


def test_summary_ratios_and_targets_from_rows() -> None:
    rows = [
        {"part": "bubble", "schedule": "1f1b", "stages": 2, "microbatches": 4, "bubble_measured": 0.21, "bubble_theory": 0.2, "relative_error": 0.05},
        {"part": "bubble", "schedule": "1f1b", "stages": 2, "microbatches": 8, "bubble_measured": 0.15, "bubble_theory": 1 / 9, "relative_error": 0.35},
        {"part": "bubble", "schedule": "gpipe", "stages": 2, "microbatches": 1, "bubble_measured": 0.5, "bubble_theory": 0.5, "relative_error": 0.0},
        {"part": "throughput", "variant": "rapydli", "step_ms": 10.0, "torch": "2.13.0+cpu"},
        {"part": "throughput", "variant": "torch", "step_ms": 12.0, "torch": "2.13.0+cpu"},
        {"part": "throughput", "variant": "torch", "timed_out": True},
    ]
    summary = summarize(rows)
    assert summary["bubble 1f1b p=2 m=4: target within 10%"] == "met"
    assert summary["bubble 1f1b p=2 m=8: target within 10%"] == "not met"
    assert "bubble gpipe p=2 m=1: target within 10%" not in summary  # the target is for m >= 4
    assert summary["throughput 1f1b: torch step / rapydli step"] == pytest.approx(1.2)
    assert summary["throughput target rapydli >= 1.0x torch"] == "met"
    assert summary["torch.distributed.pipelining launches that timed out"] == 1
    assert summary["throughput peer: torch.distributed.pipelining of torch"] == "2.13.0+cpu (checked against 2.13: yes)"


@pytest.mark.mpi
def test_memory_part_gpipe_grows_with_m_1f1b_with_p(tmp_path: Path) -> None:
    """Bytes on real ranks (2 and 4; 4 ranks on 2 cores are fine for bytes), against the theory."""
    out = tmp_path / "pipeline.json"
    result = CliRunner().invoke(command, ["--parts", "memory", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    summary = payload["summary"]
    for p in (2, 4):
        for m in (2, 4, 8):
            for rank in range(p):
                measured = summary[f"memory p={p} m={m} rank {rank}: gpipe / 1f1b"]
                theory = summary[f"memory p={p} m={m} rank {rank}: theory (live micro-batches)"]
                assert measured == pytest.approx(theory, rel=0.1), (p, m, rank)
            for schedule in ("gpipe", "1f1b"):  # live micro-batches x one micro-batch's bytes on the stage
                ratios = [float(v) for v in summary[f"memory p={p} m={m} {schedule}: measured / theory, per rank"].split(", ")]
                assert len(ratios) == p and all(r == pytest.approx(1.0, abs=0.1) for r in ratios), (p, m, schedule, ratios)
    assert summary["memory m=8: 1f1b rank 0 live micro-batches by p"] == "p=2: 2, p=4: 4"  # 1F1B grows with p
    assert summary["memory p=2 m=8 rank 1: 1f1b / data parallel"] < 0.2  # one micro-batch of half the model
    rows = [row for row in payload["rows"] if row["variant"] == "1f1b" and row["rank"] == 0 and row["microbatches"] == 8]
    assert sorted(row["ranks"] for row in rows) == [2, 4]


def test_memory_ranks_are_checked_before_anything_starts() -> None:
    result = CliRunner().invoke(command, ["--parts", "memory", "--memory-ranks", "2,3"])
    assert result.exit_code != 0 and "integers >= 2 that divide the batch" in result.output
