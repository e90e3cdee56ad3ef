"""``rapydli bench trainer`` runs on 2 ranks and reports every variant, ratio and target."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from rapydli.bench import live
from rapydli.bench import trainer as trainer_bench
from rapydli.bench.trainer import command, summarize
from rapydli.trainer.task import WARMUP_STEPS


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
    assert not any("autotune" in key for key in summary)  # no trainer_autotune row, no autotune lines


def test_summary_with_autotune_variant() -> None:
    rows = [
        {"model": "conv", "variant": "trainer", "step_ms": 9.0, "hidden_fraction": 0.5},
        {"model": "conv", "variant": "ddp_gloo", "step_ms": 10.0},
        {"model": "conv", "variant": "no_comm", "step_ms": 8.5},
        {"model": "conv", "variant": "trainer_autotune", "step_ms": 7.0, "hidden_fraction": 0.6, "tune_s": 12.0},
        {"model": "flat", "variant": "trainer", "step_ms": 4.0, "hidden_fraction": 0.2},
        {"model": "flat", "variant": "ddp_gloo", "step_ms": 4.4},
        {"model": "flat", "variant": "no_comm", "step_ms": 3.0},
        {"model": "flat", "variant": "trainer_autotune", "step_ms": 4.2, "hidden_fraction": 0.2, "tune_s": 0.0},
    ]
    summary = summarize(rows)
    # the plain lines still judge the plain trainer (communication only): 0.9 is not met even though autotune is
    assert summary["conv: trainer / ddp step"] == pytest.approx(0.9)
    assert summary["conv: target trainer <= 0.85x ddp"] == "not met"
    assert summary["conv: trainer overhead over no-comm"] == pytest.approx(9.0 / 8.5 - 1)
    assert summary["conv: comm hidden behind backward"] == 0.5
    assert summary["conv: trainer+autotune / ddp step"] == pytest.approx(0.7)
    assert summary["conv: trainer+autotune / trainer step"] == pytest.approx(7.0 / 9.0)
    assert summary["conv: target trainer <= 0.85x ddp with autotune"] == "met"
    assert summary["flat: trainer+autotune / ddp step"] == pytest.approx(4.2 / 4.4)
    assert summary["flat: trainer+autotune / trainer step"] == pytest.approx(1.05)
    assert summary["flat: target trainer <= 0.85x ddp with autotune"] == "not met"
    assert summary["flat: target trainer <= 0.85x ddp"] == "not met"  # 4.0 / 4.4 = 0.91


def test_summary_ratios_carry_their_rounds_and_a_noisy_target_is_unclear() -> None:
    # round 2 was slowed for the trainer alone: the rounds of trainer / ddp span 0.8 to 0.95
    rows = [
        {"model": "m", "variant": "trainer", "step_ms": 8.0, "rounds_ms": [8.0, 9.5, 8.1], "hidden_fraction": 0.5},
        {"model": "m", "variant": "ddp_gloo", "step_ms": 10.0, "rounds_ms": [10.0, 10.0, 10.0]},
        {"model": "m", "variant": "no_comm", "step_ms": 7.5, "rounds_ms": [7.9, 7.5, 7.5]},
    ]
    summary = summarize(rows)
    assert summary["m: trainer / ddp step"] == pytest.approx(0.81)  # the median of the per-round ratios
    assert summary["m: trainer / ddp step, range"] == "0.8 to 0.95 over 3 rounds"
    assert summary["m: target trainer <= 0.85x ddp"].startswith(
        "unclear (the rounds span 0.8 to 0.95 around the target 0.85"
    )
    assert summary["m: trainer overhead over no-comm, range"] == "+1.27% to +26.67% over 3 rounds"
    assert summary["m: target overhead <= 10%"].startswith("unclear")


@pytest.mark.parametrize(("flag", "forwarded"), [([], "--autotune"), (["--no-autotune"], "--no-autotune")])
def test_autotune_flag_reaches_the_worker(monkeypatch, flag, forwarded) -> None:
    seen: list[list[str]] = []

    def fake_run(argv, n, **kwargs):  # what the ranks would write, without starting them
        seen.append(list(argv))
        rows = [
            {"model": "mlp", "variant": "trainer", "step_ms": 4.0, "hidden_fraction": 0.2},
            {"model": "mlp", "variant": "ddp_gloo", "step_ms": 5.0},
            {"model": "mlp", "variant": "no_comm", "step_ms": 3.9},
        ]
        Path(argv[argv.index("--out") + 1]).write_text(json.dumps(rows))
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(trainer_bench.mpirun, "run", fake_run)
    result = CliRunner().invoke(command, ["--models", "mlp", "--no-live", *flag])
    assert result.exit_code == 0, result.output
    assert forwarded in seen[0] and ({"--autotune", "--no-autotune"} - {forwarded}).isdisjoint(seen[0])
    assert "mlp: trainer / ddp step: 0.8" in result.output


@pytest.mark.mpi
def test_bench_trainer_runs_on_two_ranks(tmp_path) -> None:
    path = tmp_path / "trainer.json"
    argv = [
        "-n",
        "2",
        "--models",
        "mlp",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--allreduce",
        "mpi",
        "--live-steps",
        "4",
        "--live-rounds",
        "1",
        "--json",
        str(path),
    ]
    result = CliRunner().invoke(command, argv)
    assert result.exit_code == 0, result.output
    assert "mlp: target trainer <= 0.85x ddp:" in result.output and "mlp: target live cost <= 2%:" in result.output
    assert "mlp: target trainer <= 0.85x ddp with autotune:" in result.output  # --autotune is the default
    payload = json.loads(path.read_text())
    rows = {row["variant"]: row for row in payload["rows"]}
    assert set(rows) == {
        "trainer",
        "trainer_autotune",
        "ddp_gloo",
        "no_comm",
        "checkpoint",
        "live",
        "quiet",
        "per_call",
    }
    saved = rows[
        "checkpoint"
    ]  # 5 warm-up + 40 steps of the MLP: a save every 10 and one at the end, against a blocking write
    assert saved["saves"] == 5 and saved["save_ms"] > 0 and saved["sync_write_ms"] > 0 and saved["write_ms"] > 0
    assert saved["thread_ms"] == saved["thread_ms"] and 0 <= saved["steps_during_write"] <= 40  # a number (not NaN)
    assert "mlp: target checkpoint cost <= 5%:" in result.output
    assert all(
        rows[variant]["step_ms"] > 0
        for variant in ("trainer", "trainer_autotune", "ddp_gloo", "no_comm", "live", "quiet")
    )
    assert 0.0 <= rows["trainer"]["hidden_fraction"] <= 1.0
    # the MLP has no convolution: an empty plan, applied without error, tuned once before the rounds
    tuned = rows["trainer_autotune"]
    assert tuned["tuned_convs"] == 0 and tuned["plan"] is None and 0.0 <= tuned["tune_s"] < 60
    assert 0.0 <= tuned["hidden_fraction"] <= 1.0 and tuned["bucket_mb"] == rows["trainer"]["bucket_mb"]
    assert "tune_s" not in rows["trainer"]
    assert payload["summary"]["mlp: trainer+autotune / ddp step"] == pytest.approx(
        tuned["step_ms"] / rows["ddp_gloo"]["step_ms"]
    )
    assert rows["live"]["rows_received"] == 4 + WARMUP_STEPS  # every step's row reached the plot while it ran
    per_call = [row for row in payload["rows"] if row["variant"] == "per_call"]
    assert [row["rank"] for row in per_call] == [0, 1] and all(row["should_stop_us"] > 0 for row in per_call)
    assert all(0 < row["lag_ms_median"] <= row["lag_ms_max"] for row in per_call)  # every latency row arrived


def test_checkpoint_cost_summary() -> None:
    rows = [
        {"model": "m", "variant": "trainer", "step_ms": 10.0, "hidden_fraction": 0.5},
        {"model": "m", "variant": "ddp_gloo", "step_ms": 11.0},
        {"model": "m", "variant": "no_comm", "step_ms": 9.0},
        {
            "model": "m",
            "variant": "checkpoint",
            "step_ms": 10.0,
            "save_ms": 15.0,
            "thread_ms": 5.0,
            "sync_write_ms": 80.0,
            "saves": 4,
            "every": 10,
        },
    ]
    summary = summarize(rows)
    assert summary["m: checkpoint cost per step at checkpoint_every=50"] == pytest.approx(
        20.0 / 500.0
    )  # the copy and the thread's toll
    assert summary["m: of which the writer thread"] == pytest.approx(5.0 / 500.0)
    assert summary["m: synchronous write / trainer checkpoint"] == pytest.approx(4.0)
    assert summary["m: target checkpoint cost <= 5%"] == "met"
    assert summary["m: trainer / ddp step"] == pytest.approx(10.0 / 11.0)


def test_live_summary_from_rows() -> None:
    rows = [
        {"model": "m", "variant": "live", "step_ms": 10.1, "round_ms": [10.1, 12.2, 9.0]},
        {"model": "m", "variant": "quiet", "step_ms": 10.0, "round_ms": [10.0, 12.0, 10.0]},
        {"model": "m", "variant": "tracked", "step_ms": 10.2, "round_ms": [10.2, 12.2, 9.45]},
        {"model": None, "variant": "per_call", "rank": 0, "emit_us": 2.0, "publish_us": 50.0, "should_stop_us": 18.0,
         "lag_ms_median": 120.0, "lag_ms_max": 1200.0},
    ]  # fmt: skip
    summary = live.summarize(rows)
    assert summary["m: live metrics cost (median over rounds of streamed / quiet step - 1)"] == pytest.approx(0.01)
    assert summary["m: target live cost <= 2%"] == "met"
    assert summary["m: tracker cost (median over rounds of tracked / live step - 1)"] == pytest.approx(
        10.2 / 10.1 - 1
    )  # paired with live
    assert summary["m: tracker cost range over rounds"] == "+0.00% to +5.00% over 3 rounds"
    assert summary["m: target tracker cost <= 2%"].startswith(
        "unclear (the rounds span +0.00% to +5.00% around the target +2.00%"
    )
    assert summary["m: emit + should_stop per step, share of step"] == pytest.approx(20e-6 / 10e-3)
    assert summary["target: a row reaches the notebook within 1 s"] == "not met"


def test_unknown_model_is_rejected() -> None:
    result = CliRunner().invoke(command, ["--models", "vgg"])
    assert result.exit_code != 0 and "unknown model(s) vgg" in result.output


def test_live_bench_refuses_an_unknown_model() -> None:
    result = CliRunner().invoke(live.command, ["--models", "mlp,vgg"])
    assert result.exit_code != 0 and "unknown model(s) vgg; allowed: resnet_mini, mlp, mlp_pipelined" in result.output


@pytest.mark.engines
def test_live_bench_measures_a_pipelined_run_with_its_live_timeline(tmp_path) -> None:
    path = tmp_path / "live.json"
    argv = [
        "-n",
        "2",
        "--models",
        "mlp_pipelined",
        "--steps",
        "4",
        "--rounds",
        "1",
        "--allreduce",
        "mpi",
        "--json",
        str(path),
    ]
    result = CliRunner().invoke(live.command, argv)
    assert result.exit_code == 0, result.output
    assert (
        "mlp_pipelined: target live cost <= 2%:" in result.output
        and "mlp_pipelined: tracker cost range over rounds:" in result.output
    )
    rows = {row["variant"]: row for row in json.loads(path.read_text())["rows"] if row["model"] == "mlp_pipelined"}
    assert (
        rows["live"]["pipeline_stages"] == 2
        and rows["quiet"]["timeline_rows_received"] == 0
        and rows["tracked"]["step_ms"] > 0
    )
    assert rows["live"]["rows_received"] == 4 + WARMUP_STEPS
    assert rows["live"]["timeline_rows_received"] == 2 * (
        4 + WARMUP_STEPS
    )  # both ranks' every step reached the timeline
    assert rows["live"]["timeline_redraws"] >= 1
