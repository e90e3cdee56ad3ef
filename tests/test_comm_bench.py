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
    assert "target auto >= 0.95x best of the others at every size (paired)" in result.output
    assert "raise --max-bytes" in result.output  # the ring target needs >= 1 MiB messages
    saved = json.loads(out.read_text())
    sizes = sorted({row["bytes"] for row in saved["raw_rows"]})
    assert sizes == [4, 16, 64, 256, 1024]
    for row in saved["raw_rows"]:
        assert row["algorithm"] in {"ring", "mpi", "shm", "auto", "mpi4py", "gloo"}
        assert row["busbw_GBps"] == pytest.approx(row["algbw_GBps"] * 2 * (2 - 1) / 2)
        assert row["algbw_GBps"] == pytest.approx(row["bytes"] / (row["time_us"] * 1e-6) / 1e9)
        assert row["min_time_us"] <= row["time_us"]
        assert len(row["rep_times_us"]) == row["reps"] and min(row["rep_times_us"]) == pytest.approx(row["min_time_us"])
    assert len(saved["raw_rows"]) == 6 * len(sizes)  # shm too: both ranks share this node
    table = saved["auto_table"]
    assert table["sizes"] == sizes and set(table["choices"]) <= {"mpi", "ring", "shm"}
    assert json.loads(open(table["path"]).read())["choices"] == table["choices"]


def test_summarize_ratios_and_targets() -> None:
    rows = []
    for nbytes, busbw in (
        (4, {"ring": 1, "mpi": 2, "auto": 2, "mpi4py": 2}),
        (1 << 20, {"ring": 9.5, "mpi": 10, "auto": 9, "mpi4py": 10}),
    ):
        for name, value in busbw.items():
            rows.append({"bytes": nbytes, "algorithm": name, "time_us": 1.0, "busbw_GBps": value})
    table, summary = summarize(rows)
    assert table[1]["ring/mpi4py"] == pytest.approx(0.95)
    assert table[1]["auto/best"] == pytest.approx(0.9) and table[0]["auto/best"] == pytest.approx(1.0)
    assert summary["target ring >= 0.9x MPI native at >= 1 MB (median)"] == "met"
    assert summary["target auto >= 0.95x best of the others at every size (median)"] == "not met at 1 of 2 sizes"


def test_summarize_paired_ratios_compare_algorithms_within_each_rep() -> None:
    # rep by rep, mpi4py takes 0.9x, 2.5x and 2x ring's time: the paired ratio is the median
    # 2.0, where the ratio of the two median times says 2.5
    reps = {
        "ring": [10.0, 20.0, 30.0],
        "mpi4py": [9.0, 50.0, 60.0],
        "mpi": [12.0, 21.0, 33.0],
        "auto": [11.0, 24.0, 30.0],
    }
    rows = [
        {
            "bytes": 1 << 20,
            "algorithm": name,
            "time_us": sorted(times)[1],
            "busbw_GBps": 1 / sorted(times)[1],
            "rep_times_us": times,
        }
        for name, times in reps.items()
    ]
    table, summary = summarize(rows)
    assert table[0]["ring/mpi4py"] == pytest.approx(2.5)
    assert table[0]["ring/mpi4py@paired"] == pytest.approx(2.0)
    # best of the others = ring (lowest median time); auto against it, rep by rep: 10/11, 20/24, 30/30
    assert table[0]["auto/best@paired"] == pytest.approx(10 / 11)
    assert (
        table[0]["ring/mpi4py@paired middle half"] == "1.45 to 2.25"
    )  # the reps' ratios 0.9, 2.0, 2.5: lower to upper quartile
    assert summary["target ring >= 0.9x MPI native at >= 1 MB (paired)"] == "met"
    # auto's reps: 0.83, 0.91, 1.0 against 0.95: the middle half (0.87 to 0.95) spans the target
    assert summary["target auto >= 0.95x best of the others at every size (paired)"].startswith(
        "unclear at 1 of 1 sizes"
    )
    rows[-1]["rep_times_us"] = [
        12.0,
        25.0,
        36.0,
    ]  # auto slower than ring in every rep: the whole middle half below 0.95
    assert (
        summarize(rows)[1]["target auto >= 0.95x best of the others at every size (paired)"]
        == "not met at 1 of 1 sizes"
    )


def test_bench_allreduce_host_options_are_checked_before_any_rank_starts() -> None:
    result = CliRunner().invoke(command, ["--interface", "lo"])
    assert "apply to --hosts only" in str(result.exception)
    result = CliRunner().invoke(command, ["--hosts", "h1,h2", "--interface", "nosuch0"])
    assert "interface 'nosuch0' does not exist here" in str(result.exception)
