"""``rapydli bench allreduce``: runs on real ranks, writes the table and the auto measurement."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from rapydli.bench.allreduce import command, summarize


@pytest.mark.mpi
def test_bench_allreduce_small_run_writes_rows_and_targets(tmp_path) -> None:
    out = tmp_path / "allreduce.json"
    result = CliRunner().invoke(command, ["-n", "2", "--max-bytes", "1024", "--max-reps", "5", "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "target auto >= 0.95x best of the others at every size (median)" in result.output
    assert "target auto >= 0.95x best of the others at every size (min)" in result.output
    assert "raise --max-bytes" in result.output  # the ring target needs >= 1 MiB messages
    saved = json.loads(out.read_text())
    sizes = sorted({row["bytes"] for row in saved["raw_rows"]})
    assert sizes == [4, 16, 64, 256, 1024]
    for row in saved["raw_rows"]:
        assert row["algorithm"] in {"ring", "mpi", "auto", "mpi4py", "gloo"}
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["min_time_us"] <= row["time_us"]
    assert len(saved["raw_rows"]) == 5 * len(sizes)
    table = saved["auto_table"]
    assert table["sizes"] == sizes and set(table["choices"]) <= {"mpi", "ring"}
    assert json.loads(open(table["path"]).read())["choices"] == table["choices"]


def test_summarize_ratios_and_targets() -> None:
    rows = []
    for nbytes, busbw in ((4, {"ring": 1, "mpi": 2, "auto": 2, "mpi4py": 2}), (1 << 20, {"ring": 9.5, "mpi": 10, "auto": 9, "mpi4py": 10})):
        for name, value in busbw.items():
            rows.append({"bytes": nbytes, "algorithm": name, "time_us": 1.0, "busbw_GBps": value})
    table, summary = summarize(rows)
    assert table[1]["ring/mpi4py"] == pytest.approx(0.95)
    assert table[1]["auto/best"] == pytest.approx(0.9) and table[0]["auto/best"] == pytest.approx(1.0)
    assert summary["target ring >= 0.9x MPI native at >= 1 MB (median)"] == "met"
    assert summary["target auto >= 0.95x best of the others at every size (median)"] == "not met at 1 of 2 sizes"
