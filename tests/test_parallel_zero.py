"""ZeRO stages 1 and 2 on real MPI ranks: the same parameters as data parallel, 1/N of the state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_zero_equals_data_parallel_with_adamw_and_sgd_momentum_and_a_share_of_the_state(
    run_mpi, tmp_path: Path, ranks: int
) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero; cases_zero.equivalence({str(tmp_path)!r}); cases_zero.unused()"
    result = run_mpi(code, n=ranks, timeout=180)
    assert result.stderr.count("OK unused") == ranks  # ZeRO-2 leaves a parameter no rank used alone, as DDP does
    for row in json.loads((tmp_path / "zero.json").read_text()):
        for name in ("adamw", "sgd"):
            for stage in (1, 2):
                share = row[f"{name}_zero{stage}_bytes"] / (row[f"{name}_full_bytes"] / ranks)
                assert share == pytest.approx(1.0, rel=0.05), (name, stage, share)

    from mpi4py import MPI

    from rapydli.parallel.zero import ShardedOptimizer

    shard = torch.load(
        tmp_path / "adamw-zero2-rank0.pt", weights_only=False
    )  # written by 2 or 3 ranks; this process is 1
    net = nn.Sequential(nn.Linear(40, 96), nn.Tanh(), nn.Linear(96, 40), nn.LayerNorm(40), nn.Linear(40, 5)).double()
    single = ShardedOptimizer(
        net.parameters(), lambda ps: torch.optim.AdamW(ps), MPI.COMM_SELF, stage=1, bucket_mb=0.01
    )
    with pytest.raises(ConfigError, match=f"written by {ranks} ranks .* this run has 1 ranks"):
        single.load_state_dict(shard)
    own = single.state_dict()
    with pytest.raises(ConfigError, match="belongs to data-parallel rank 1, not to rank 0"):
        single.load_state_dict({**own, "rank": 1})


def test_a_stage_that_does_not_exist_is_refused() -> None:
    from mpi4py import MPI

    from rapydli.parallel.zero import ShardedOptimizer

    with pytest.raises(ConfigError, match="zero=3 is invalid: one of 1, 2"):
        ShardedOptimizer(nn.Linear(2, 2).parameters(), lambda ps: torch.optim.SGD(ps, lr=0.1), MPI.COMM_SELF, stage=3)


@pytest.mark.mpi
def test_trainer_with_zero_equals_plain_data_parallel_and_resumes(run_mpi, tmp_path: Path) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero_trainer; cases_zero_trainer.main({str(tmp_path)!r})"
    result = run_mpi(code, n=2, timeout=240)
    assert result.stderr.count("OK zero trainer") == 2
    assert sorted(p.name for p in (tmp_path / "adamw-zero2").iterdir()) == [
        "checkpoint.pt",
        "part-s0-t0-d0-step8.pt",
        "part-s0-t0-d1-step8.pt",
    ]


@pytest.mark.mpi
def test_zero_clips_by_the_global_norm_as_data_parallel_does(run_mpi) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero_trainer; cases_zero_trainer.clipped()"
    result = run_mpi(code, n=2, timeout=240)
    assert result.stderr.count("OK clipped") == 2


def _trainer_case(run_mpi, function: str, n: int, *args: object):
    arguments = ", ".join(repr(a) for a in args)
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero_trainer; cases_zero_trainer.{function}({arguments})"
    return run_mpi(code, n=n, timeout=240)


@pytest.mark.mpi
def test_a_zero_checkpoint_of_two_ranks_resumes_on_one_and_on_three_as_the_uninterrupted_run(
    run_mpi, tmp_path: Path
) -> None:
    result = _trainer_case(run_mpi, "resized", 3, str(tmp_path))
    assert result.stderr.count("OK resized") == 3


@pytest.mark.mpi
def test_a_checkpoint_is_complete_only_when_every_part_is_written(run_mpi, tmp_path: Path) -> None:
    result = _trainer_case(run_mpi, "crash_between_parts", 2, str(tmp_path))
    assert result.stderr.count("OK crash") == 2


@pytest.mark.mpi
def test_bytes_per_rank_approach_the_zero_formulas(run_mpi, tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    _trainer_case(run_mpi, "memory", 2, str(out))
    n = 2
    for row in json.loads(out.read_text()):
        psi = row["parameters"]
        formulas = {
            "zero0": 16 * psi,
            "zero1": 8 * psi + 8 * psi / n,
            "zero2": 4 * psi + 12 * psi / n,
            "zero3": 16 * psi / n,
        }  # fp32 AdamW
        for layout, expected in formulas.items():
            measured = sum(row[layout].values())
            assert measured == pytest.approx(expected, rel=0.10), (layout, row[layout], expected)
        assert row["zero1"]["optimizer_state"] == pytest.approx(8 * psi / n, rel=0.05)
        assert (
            row["zero2"]["grads"] < 1.25 * 4 * psi / n
        )  # its slice, and at most three whole buckets (one layer each) in flight
        layer = 4 * (128 * 128 + 128)  # bytes of one hidden layer, a block of its own at ZeRO-3
        assert (
            4 * psi / n <= row["zero3"]["params"] <= 4 * psi / n + 2 * layer + 4 * 32 * n
        )  # its slices, two whole layers at once
