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
def test_zero_equals_data_parallel_with_a_share_of_the_state(run_mpi, tmp_path: Path, ranks: int) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero; cases_zero.equivalence({str(tmp_path)!r})"
    run_mpi(code, n=ranks, timeout=180)
    for row in json.loads((tmp_path / "zero.json").read_text()):
        for stage in (1, 2):
            share = row[f"zero{stage}_bytes"] / (row["full_bytes"] / ranks)
            assert share == pytest.approx(1.0, rel=0.05), (stage, share)

    from mpi4py import MPI

    from rapydli.parallel.zero import ShardedOptimizer

    shard = torch.load(tmp_path / "zero2-rank0.pt", weights_only=False)  # written by 2 or 3 ranks; this process is 1
    net = nn.Sequential(nn.Linear(40, 96), nn.Tanh(), nn.Linear(96, 40), nn.LayerNorm(40), nn.Linear(40, 5)).double()
    single = ShardedOptimizer(net.parameters(), lambda ps: torch.optim.AdamW(ps), MPI.COMM_SELF, stage=2)
    with pytest.raises(ConfigError, match=f"written by {ranks} ranks .* this run has 1 ranks"):
        single.load_state_dict(shard)


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
    assert sorted(p.name for p in (tmp_path / "zero2").iterdir()) == ["checkpoint.pt", "optimizer-rank0.pt", "optimizer-rank1.pt"]


def test_zero_2_refuses_a_global_gradient_clip() -> None:
    from rapydli.trainer.config import TrainConfig

    with pytest.raises(ConfigError, match="zero=2 keeps only this rank's slice"):
        TrainConfig(zero=2, grad_clip=1.0)
