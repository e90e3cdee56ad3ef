"""``rapydli bench model``: the end of a run keeping its model gathered (before), written in pieces (rd.train now) or not at all."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rapydli.bench.model import command, summarize


def test_ratios_are_paired_by_round_and_bytes_are_the_most_any_rank_held() -> None:
    rows = [
        {
            "round": r,
            "variant": v,
            "zero": 3,
            "seconds": s,
            "held_bytes": b,
            "assemble_s": 0.5 if v == "write" else None,
            "load_1m": 0.1,
            "other_cores": 0.0,
        }
        for r, times in enumerate([(1.0, 0.5, 0.01), (2.0, 0.8, 0.02)])
        for v, s, b in zip(("gather", "write", "none"), times, ([4 << 20, 0], [1 << 20, 2 << 20], [0, 0]), strict=True)
    ]
    found = summarize(rows)["zero3"]
    assert found["write"]["ratio_to_gather"] == pytest.approx(0.45) and found["write"]["ratio_high"] == pytest.approx(
        0.5
    )
    assert (
        found["write"]["verdict"] == "faster than gather in every round" and found["gather"]["held_mib_max_rank"] == 4.0
    )
    assert found["write"]["held_mib_max_rank"] == 2.0 and found["assemble_ms_when_asked"] == 500.0


@pytest.mark.mpi
def test_every_variant_runs_on_real_ranks_and_only_gather_builds_the_whole_model_on_rank_0(tmp_path: Path) -> None:
    out = tmp_path / "model.json"
    result = CliRunner().invoke(
        command, ["--size", "tiny", "--rounds", "2", "--json", str(out)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    written = json.loads(out.read_text())
    assert {(r["zero"], r["variant"]) for r in written["rows"]} == {
        (z, v) for z in (0, 3) for v in ("gather", "write", "none")
    }
    for row in written["rows"]:
        whole = row["held_bytes"][0] if row["variant"] == "gather" else None
        if row["variant"] == "none":
            assert row["held_bytes"] == [0, 0]
        elif whole is not None:
            assert row["held_bytes"][1] == 0 and whole > 0  # the whole model, on rank 0 only
    zero3_write = [r for r in written["rows"] if r["zero"] == 3 and r["variant"] == "write"]
    assert all(min(r["held_bytes"]) > 0 for r in zero3_write)  # at ZeRO-3 every rank writes its own pieces
    assert "result.model() when asked" in result.output
