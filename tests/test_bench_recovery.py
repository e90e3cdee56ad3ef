"""``rapydli bench recovery``: a rank SIGKILLed mid-run, measured from the kill to training again (fields, not timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rapydli.bench.recovery import command


@pytest.mark.engines
@pytest.mark.timeout(300)
def test_one_round_measures_a_killed_rank_to_training_again(tmp_path: Path) -> None:
    out = tmp_path / "recovery.json"
    result = CliRunner().invoke(command, ["-n", "2", "--repeat", "1", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    (row,) = payload["rows"]
    # the step-4 checkpoint is written in the background: under load it may not be complete when rank 1 dies
    assert row["resumed_from_step"] in (0, 4) and row["steps_redone"] == 6 - row["resumed_from_step"], row
    assert 0 < row["kill_to_noticed_s"] < row["kill_to_step_s"] and row["recovery_s"] > 0, row
    assert "not built yet" in payload["summary"]["goal <= 2 s (survivors go on)"]
    assert "load" in result.output


@pytest.mark.parametrize(
    ("args", "said"), [(["-n", "1"], "needs 2 or more engines"), (["--kill-at", "1"], "must be 2..12")]
)
def test_bad_input_is_refused_before_any_engine_starts(args: list[str], said: str) -> None:
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and said in result.output, result.output
