"""Tensor-parallel layers on real MPI ranks: blocks equal the dense ones, training equals one process."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch import nn

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent


def _case(run_mpi, name: str, n: int = 2) -> str:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_tensor; cases_tensor.{name}()"
    return run_mpi(code, n=n, timeout=180).stdout


@pytest.mark.mpi
def test_mlp_and_attention_blocks_equal_the_dense_ones_with_one_allreduce_per_direction(run_mpi) -> None:
    assert _case(run_mpi, "block_equivalence").count("OK blocks") == 2


@pytest.mark.mpi
def test_training_tiny_lm_tensor_parallel_equals_one_process(run_mpi) -> None:
    assert _case(run_mpi, "training_equivalence").count("OK training") == 2


def test_bad_plans_name_what_is_wrong() -> None:
    from mpi4py import MPI

    from rapydli.parallel.tensor import TensorGroup, parallelize

    group = TensorGroup(MPI.COMM_SELF)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    with pytest.raises(ConfigError, match="'diagonal' is not a style; allowed: column, row, heads"):
        parallelize(model, {"0": "diagonal"}, group)
    with pytest.raises(ConfigError, match="names no module of the model; its linear layers are 0, 2"):
        parallelize(model, {"blocks.*": "column"}, group)
    with pytest.raises(ConfigError, match="'column' needs an nn.Linear, not a ReLU"):
        parallelize(model, {"1": "column"}, group)
    with pytest.raises(ConfigError, match="is not an attention module"):
        parallelize(model, {"0": "heads"}, group)
