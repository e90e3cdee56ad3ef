"""``rapydli bench trainer`` runs on 2 ranks and reports every variant, ratio and target."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rapydli.bench.trainer import command, summarize


def test_summary_targets_from_rows() -> None:
    rows = [
        {"model": "m", "variant": "trainer", "step_ms": 8.0, "hidden_fraction": 0.5},
        {"model": "m", "variant": "ddp_gloo", "step_ms": 10.0},
        {"model": "m", "variant": "no_comm", "step_ms": 7.5},
    ]
    summary = summarize(rows)
    assert summary["m: trainer / ddp step"] == pytest.approx(0.8)
    assert summary["m: target trainer <= 0.85x ddp"] == "met"
    assert summary["m: trainer overhead over no-comm"] == pytest.approx(8.0 / 7.5 - 1)
    assert summary["m: target overhead <= 10%"] == "met"
    assert summary["m: comm hidden behind backward"] == 0.5


@pytest.mark.mpi
def test_bench_trainer_runs_on_two_ranks(tmp_path) -> None:
    path = tmp_path / "trainer.json"
    result = CliRunner().invoke(
        command, ["-n", "2", "--models", "mlp", "--steps", "2", "--rounds", "1", "--allreduce", "mpi", "--json", str(path)]
    )
    assert result.exit_code == 0, result.output
    assert "mlp: target trainer <= 0.85x ddp:" in result.output
    payload = json.loads(path.read_text())
    assert {row["variant"] for row in payload["rows"]} == {"trainer", "ddp_gloo", "no_comm"}
    assert all(row["step_ms"] > 0 for row in payload["rows"])
    assert 0.0 <= payload["rows"][0]["hidden_fraction"] <= 1.0


def test_unknown_model_is_rejected() -> None:
    result = CliRunner().invoke(command, ["--models", "vgg"])
    assert result.exit_code != 0 and "unknown model(s) vgg" in result.output
