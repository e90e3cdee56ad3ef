"""ZeRO-3 (fully sharded parameters) through TrainConfig on real MPI ranks: one process's parameters, 1/N of them kept.

The rank-side code is ``cases_zero3``; the models are the hybrid-parallelism tests' (GPT-2-,
Llama- and BERT-style, float64).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent


def _run(run_mpi, n: int, call: str) -> tuple[list[dict], str]:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero3; cases_zero3.{call}"
    result = run_mpi(code, n=n, timeout=300)
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")], result.stderr


CASES = [
    ["gpt2", {"grad_clip": 0.05}],  # tied wte / lm_head in the root unit, fused QKV Conv1D, the loss from labels; clipped over the slices
    ["llama", {"grad_accum": 2, "batch_size": 2}],  # an embedding block of its own, GQA, SwiGLU; two micro-steps a step
    ["bert", {}],  # the pooler is called under no_grad: it never has a gradient and must not move (weight decay included)
]


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 4])
def test_zero3_trains_what_one_process_trains_and_keeps_a_slice_of_every_parameter(run_mpi, ranks: int) -> None:
    cases = CASES if ranks == 2 else CASES[:1]
    rows, stderr = _run(run_mpi, ranks, f"equivalence({json.dumps(cases)!r})")
    assert stderr.count("OK zero3") == ranks
    assert [row["model"] for row in rows] == [name for name, _ in cases]
    for row in rows:
        assert row["worst"] < 1e-10 and row["loss"] < 1e-10 and row["val_loss"] < 1e-10, row
        assert row["placeholders"] == 1, row  # between steps no rank holds a whole trained parameter
        assert len(row["kept"]) == ranks and all(row["whole"] / ranks <= kept < row["whole"] / ranks + 8 * ranks for kept in row["kept"]), row
        assert row["prefetched"] > 0, row  # the next block's gather started ahead of its use
        assert not row["pooler_moved"], row
        if "grad_clip" in row["fields"]:
            assert row["grad_norm"] is not None and row["grad_norm"] < 1e-10, row
    assert rows[0]["units"] == ["h.0", "h.1", ""]  # GPT-2's blocks; its embeddings, final norm and tied head are the root
    if ranks == 2:
        assert rows[1]["units"] == ["embed_tokens", "layers.0", "layers.1", ""] and rows[2]["units"] == ["encoder", "pooler", "classifier"]


@pytest.mark.mpi
def test_a_zero3_checkpoint_resumes_under_zero3_zero2_and_in_one_process(run_mpi, tmp_path: Path) -> None:
    rows, stderr = _run(run_mpi, 2, f"resumed({str(tmp_path)!r})")
    assert stderr.count("OK resumed") == 2
    assert [row["target"] for row in rows] == ["zero3", "zero2", "one"]
    for row in rows:
        assert row["step"] == 2 and row["worst"] < 1e-10, row
    assert sorted(p.name for p in (tmp_path / "cut").iterdir()) == ["checkpoint.pt", "part-s0-t0-d0-step2.pt", "part-s0-t0-d1-step2.pt"]


def test_zero3_with_pipeline_or_tensor_parallelism_is_refused_before_anything_starts() -> None:
    from rapydli.parallel.layout import Layout
    from rapydli.trainer.config import TrainConfig

    with pytest.raises(ConfigError, match=r"TrainConfig.zero=3 runs on data parallelism alone .* pipeline_stages=2, tensor_parallel=1: .* zero=0, 1 or 2"):
        TrainConfig(zero=3, pipeline_stages=2)
    with pytest.raises(ConfigError, match=r"zero=3 runs on data parallelism alone .* tensor_parallel=2"):
        TrainConfig(zero=3, tensor_parallel=2)
    with pytest.raises(ConfigError, match=r"zero=3 runs on data parallelism alone"):
        Layout(world_size=4, tensor=2, zero=3)
    with pytest.raises(ConfigError, match=r"TrainConfig.zero=4 is invalid: must be an integer in \[0, 3\]"):
        TrainConfig(zero=4)
    assert TrainConfig(zero=3).zero == 3 and Layout(world_size=2, zero=3).sharded
