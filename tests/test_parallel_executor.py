"""rapydli.parallel.executor on real MPI ranks: pipelined training == one process on the global batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from rapydli.errors import ConfigError
from rapydli.parallel.executor import cut

TESTS = Path(__file__).resolve().parent

SCRIPT = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import pipeline_cases
pipeline_cases.run_cases(sys.argv[1] if len(sys.argv) > 1 else {{cases!r}})
"""


def run_cases(run_mpi, n: int, cases: list[list]) -> list[dict]:
    result = run_mpi(SCRIPT.format(cases=json.dumps(cases)), n=n, timeout=240)
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert [row["case"] for row in rows] == cases
    return rows


@pytest.mark.mpi
def test_two_stages_equal_one_process_for_both_schedules_and_any_microbatches(run_mpi) -> None:
    cases = [[2, schedule, m, 8, "float64"] for schedule in ("gpipe", "1f1b") for m in (1, 2, 4)] + [
        [2, "1f1b", 3, 10, "float64"],  # 10 samples in 3 micro-batches of 4, 3, 3
        [2, "gpipe", 3, 10, "float64"],
        [2, "gpipe", 4, 10, "float64"],  # 3, 3, 2, 2
        [2, "gpipe", 4, 8, "float32"],
        [2, "1f1b", 3, 10, "float32"],
        [2, "gpipe", 3, 10, "float32"],
    ]
    for row in run_cases(run_mpi, 2, cases):
        tolerance = 1e-10 if row["case"][4] == "float64" else 1e-5
        assert row["worst"] <= tolerance, row


@pytest.mark.mpi
def test_three_stages_equal_one_process(run_mpi) -> None:
    cases = [[3, schedule, m, 8, "float64"] for schedule in ("gpipe", "1f1b") for m in (1, 2, 4)] + [
        [3, "1f1b", 3, 7, "float32"]
    ]
    for row in run_cases(run_mpi, 3, cases):
        assert row["bounds"][0] == 0 and row["bounds"][-1] == 7 and len(row["bounds"]) == 4  # "auto" split
        assert row["worst"] <= (1e-10 if row["case"][4] == "float64" else 1e-5), row


@pytest.mark.mpi
def test_two_replicas_of_two_stages_equal_one_process(run_mpi) -> None:
    cases = [[2, "1f1b", 4, 8, "float64"], [2, "gpipe", 3, 6, "float32"]]
    for row in run_cases(run_mpi, 4, cases):
        assert row["worst"] <= (1e-10 if row["case"][4] == "float64" else 1e-5), row


def test_a_batch_is_cut_into_microbatches_or_refused_clearly() -> None:
    parts = cut(torch.arange(10), 3)
    assert [p.tolist() for p in parts] == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]
    pairs = cut((torch.arange(4), torch.arange(4) * 2), 2)
    assert [[t.tolist() for t in pair] for pair in pairs] == [[[0, 1], [0, 2]], [[2, 3], [4, 6]]]
    with pytest.raises(
        ConfigError, match="a batch of 3 samples cannot be cut into microbatches=4: lower microbatches to at most 3"
    ):
        cut(torch.zeros(3, 2), 4)


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_stage_that_raises_ends_every_rank_naming_stage_and_action(run_mpi, schedule: str) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import pipeline_cases; pipeline_cases.failing_stage(2, {schedule!r})"
    result = run_mpi(code, n=2, timeout=120, check=False)
    assert result.returncode != 0
    assert "StageFailure: pipeline stage 1 failed in forward(1) of step 0: ValueError: loss blew up" in result.stderr


TRAINER = f"""
import sys, json
sys.path.insert(0, {str(TESTS)!r})
import pipeline_cases
pipeline_cases.trainer_run(json.loads({{config!r}}), {{before}}, {{task!r}})
"""


@pytest.mark.mpi
def test_an_interrupted_stage_says_which_action_it_was_in(run_mpi) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import pipeline_cases; pipeline_cases.interrupted_stages()"
    out = run_mpi(code, n=2, timeout=120).stdout
    assert "rank 0: pipeline stage 0 was in recv_gradient(0) of step 0" in out
    assert "rank 1: pipeline stage 1 was in recv_activation(0) of step 0" in out


def trainer_params(run_mpi, n: int, config: dict, before: int | None = None, task: str = "classify") -> dict:
    result = run_mpi(TRAINER.format(config=json.dumps(config), before=before, task=task), n=n, timeout=240)
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def assert_same(pipelined: dict, single: dict, tolerance: float = 1e-5, losses: bool = True) -> None:
    assert pipelined["step"] == single["step"]
    assert sorted(pipelined["params"]) == sorted(single["params"])
    for key, values in single["params"].items():
        ref = torch.tensor(values)
        got = torch.tensor(pipelined["params"][key])
        assert float((got - ref).abs().max() / ref.abs().max()) <= tolerance, key
    # a resumed run's history starts where it resumed
    assert len(pipelined["losses"]) >= 2 and pipelined["val"]
    if losses:  # the logged training loss is the first replica's (as in data parallelism), not the batch's
        assert pipelined["losses"] == pytest.approx(single["losses"][-len(pipelined["losses"]) :], rel=1e-5)
    assert pipelined["val"] == pytest.approx(single["val"][-len(pipelined["val"]) :], rel=1e-5)


@pytest.mark.mpi
def test_trainer_with_pipeline_stages_equals_one_process_and_resumes_exactly(run_mpi, tmp_path) -> None:
    base = {
        "batch_size": 12,
        "max_steps": 4,
        "lr": 0.05,
        "optimizer": "sgd",
        "eval_every": 2,
        "workers": 2,
        "grad_clip": 1.0,
    }
    single = trainer_params(run_mpi, 1, base)
    piped = trainer_params(
        run_mpi,
        2,
        {**base, "pipeline_stages": 2, "microbatches": 4, "pipeline_schedule": "1f1b", "pipeline_split": "3"},
    )
    assert_same(piped, single)
    resumed = trainer_params(
        run_mpi,
        2,
        {
            **base,
            "pipeline_stages": 2,
            "microbatches": 3,
            "pipeline_schedule": "gpipe",
            "checkpoint_dir": str(tmp_path / "ck"),
        },
        before=2,
    )
    assert_same(resumed, single)
    files = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert files == ["checkpoint.pt", "part-s0-t0-d0-step4.pt", "part-s1-t0-d0-step4.pt"]


@pytest.mark.mpi
def test_trainer_two_replicas_of_two_stages_equals_one_process(run_mpi) -> None:
    base = {"max_steps": 3, "lr": 0.05, "optimizer": "sgd", "workers": 4}
    single = trainer_params(run_mpi, 1, {**base, "batch_size": 16})
    hybrid = trainer_params(
        run_mpi, 4, {**base, "batch_size": 8, "pipeline_stages": 2, "microbatches": 2, "pipeline_split": "auto"}
    )
    assert_same(hybrid, single, losses=False)


@pytest.mark.mpi
def test_a_regression_loss_fn_and_custom_metrics_run_pipelined_as_in_one_process(run_mpi) -> None:
    """loss_fn=nn.MSELoss() on the last stage, metrics "mae" and a callable, averaged over the replicas."""
    base = {"max_steps": 4, "lr": 0.05, "optimizer": "sgd", "eval_every": 2, "workers": 4}
    single = trainer_params(run_mpi, 1, {**base, "batch_size": 12}, task="regress")
    assert set(single["metrics"]) == {"val_loss", "val_mae", "val_worst_error"}  # no accuracy for regression
    piped = {**base, "pipeline_stages": 2, "microbatches": 3, "pipeline_split": "3"}
    for n, batch, schedule in ((2, 12, "gpipe"), (4, 6, "1f1b")):  # 2 stages; 2 stages x 2 replicas
        run = trainer_params(run_mpi, n, {**piped, "batch_size": batch, "pipeline_schedule": schedule}, task="regress")
        assert_same(run, single, losses=n == 2)
        assert sorted(run["metrics"]) == sorted(single["metrics"])
        for name, values in single["metrics"].items():
            assert run["metrics"][name] == pytest.approx(values, rel=1e-5), (n, name)
