"""A data-parallel run checkpointed on 2 ranks resumes on 1 and on 3 (real mpiexec ranks).

Every sample of the interrupted epoch is served exactly once across the interruption;
keeping the global batch (grad_accum) on 1 rank gives the parameters of the uninterrupted
2-rank run; 3 ranks cannot keep it (2 x grad_accum 1 does not divide by 3) and say so,
and ``on_resize="scale"`` goes on with the learning rate scaled.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CHECKPOINT_STEP, STOP, BATCH, SAMPLES = 6, 7, 8, 192


def _run(run_mpi, tmp_path: Path, n: int, phase: str, stop: int | None, on_resize: str = "keep", check: bool = True):
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_resize; cases_resize.main({str(tmp_path)!r}, {phase!r}, {stop!r}, {on_resize!r})"
    return run_mpi(code, n=n, timeout=180, check=check)


def _served(tmp_path: Path, phase: str, ranks: int, first: int | None = None) -> list[int]:
    served = []
    for rank in range(ranks):
        lines = [int(x) for x in (tmp_path / f"{phase}-rank{rank}.txt").read_text().split()]
        served += lines[:first] if first is not None else lines
    return served


@pytest.fixture
def interrupted(run_mpi, tmp_path: Path) -> Path:
    """A 2-rank run that checkpoints after step 6 and dies in step 7 (its samples of step 7 are lost)."""
    _run(run_mpi, tmp_path, 2, "before", STOP)
    assert (tmp_path / "ckpt" / "checkpoint.pt").exists()
    return tmp_path


@pytest.mark.mpi
def test_resume_on_one_rank_sees_every_sample_once_and_equals_the_uninterrupted_run(run_mpi, interrupted: Path) -> None:
    _run(run_mpi, interrupted, 1, "after", None)
    after = json.loads((interrupted / "after.json").read_text())
    assert after["start_step"] == CHECKPOINT_STEP and after["grad_accum"] == 2  # the global batch of 16 kept
    served = _served(interrupted, "before", 2, first=CHECKPOINT_STEP * BATCH) + _served(interrupted, "after", 1)
    assert Counter(served) == Counter(range(SAMPLES))  # each sample of the epoch exactly once

    (interrupted / "ckpt" / "checkpoint.pt").unlink()
    _run(run_mpi, interrupted, 2, "whole", None)
    whole = json.loads((interrupted / "whole.json").read_text())
    for a, b in zip(whole["params"], after["params"]):
        assert max(abs(x - y) for x, y in zip(a, b)) < 1e-5
    assert after["lr"] == pytest.approx(whole["lr"][CHECKPOINT_STEP:])


@pytest.mark.mpi
def test_resume_on_three_ranks_needs_scale_and_then_sees_every_sample_once(run_mpi, interrupted: Path) -> None:
    refused = _run(run_mpi, interrupted, 3, "keep3", None, check=False)
    assert refused.returncode != 0
    assert "needs grad_accum=2/3, not an integer" in refused.stdout + refused.stderr
    assert "on_resize='scale'" in refused.stdout + refused.stderr

    _run(run_mpi, interrupted, 3, "after3", None, on_resize="scale")
    after = json.loads((interrupted / "after3.json").read_text())
    before = json.loads((interrupted / "before.json").read_text())
    assert after["start_step"] == CHECKPOINT_STEP and after["grad_accum"] == 1
    assert after["lr"][0] == pytest.approx(before["lr"][0] * 3 / 2)  # linear scaling with the global batch
    served = _served(interrupted, "before", 2, first=CHECKPOINT_STEP * BATCH) + _served(interrupted, "after3", 3)
    assert Counter(served) == Counter(range(SAMPLES))
    assert len(after["losses"]) == (SAMPLES - CHECKPOINT_STEP * BATCH * 2) // (BATCH * 3)
    assert sum(after["losses"]) / len(after["losses"]) < before["losses"][0]  # training goes on: the loss keeps falling
