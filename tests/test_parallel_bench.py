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
        {"part": "throughput", "variant": "rapydli", "step_ms": 10.0},
        {"part": "throughput", "variant": "torch", "step_ms": 12.0},
        {"part": "throughput", "variant": "torch", "timed_out": True},
    ]
    summary = summarize(rows)
    assert summary["bubble 1f1b p=2 m=4: target within 10%"] == "met"
    assert summary["bubble 1f1b p=2 m=8: target within 10%"] == "not met"
    assert "bubble gpipe p=2 m=1: target within 10%" not in summary  # the target is for m >= 4
    assert summary["throughput 1f1b: torch step / rapydli step"] == pytest.approx(1.2)
    assert summary["throughput target rapydli >= 1.0x torch"] == "met"
    assert summary["torch.distributed.pipelining launches that timed out"] == 1


@pytest.mark.mpi
def test_memory_part_gpipe_grows_with_m_1f1b_with_p(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    result = CliRunner().invoke(command, ["--parts", "memory", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    summary = json.loads(out.read_text())["summary"]
    for m in (2, 4, 8):
        for rank in (0, 1):
            measured = summary[f"memory m={m} rank {rank}: gpipe / 1f1b"]
            theory = summary[f"memory m={m} rank {rank}: theory (live micro-batches)"]
            assert measured == pytest.approx(theory, rel=0.1), (m, rank)
    assert summary["memory m=8 rank 1: 1f1b / data parallel"] < 0.2  # one micro-batch of half the model
