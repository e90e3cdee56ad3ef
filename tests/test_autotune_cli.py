"""``rapydli tune conv2d`` / ``rapydli tune model`` from the command line."""

from __future__ import annotations

import json

from rapydli.cli import main


def test_tune_conv2d_prints_the_table_and_best(capsys, tmp_path) -> None:
    out_json = tmp_path / "t.json"
    code = main(
        [
            "tune",
            "conv2d",
            "--shape",
            "2,4,8,8,4,3,3,1,1",
            "--preset",
            "tiny",
            "--repetitions",
            "1",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "best:" in out and "torch_nchw" in out and "c_direct" in out
    data = json.loads(out_json.read_text())
    assert data["problem"] == "conv2d:2,4,8,8,4,3,3,1,1,1,1" and len(data["rows"]) >= 4


def test_bad_shape_is_a_one_line_error(capsys) -> None:
    assert main(["tune", "conv2d", "--shape", "2,4,8"]) == 2
    assert "--shape must be N,C,H,W,K,R,S" in capsys.readouterr().err
    assert main(["tune", "conv2d", "--shape", "2,4,8,8,4,0,3"]) == 2
    assert "ConvShape.r must be a positive integer" in capsys.readouterr().err


def test_tune_model_resnet_mini(capsys) -> None:
    code = main(
        [
            "tune",
            "model",
            "resnet-mini",
            "--batch",
            "2",
            "--preset",
            "tiny",
            "--repetitions",
            "1",
            "--strategy",
            "random",
            "--budget",
            "1",
            "--mode",
            "inference",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "stem.0" in out and "estimated conv time" in out


def test_threads_of_the_timed_runs_key_the_cache(capsys) -> None:
    argv = ["tune", "conv2d", "--shape", "1,2,6,6,2,3,3,1,1", "--preset", "tiny", "--repetitions", "1"]
    assert main([*argv, "--threads", "1"]) == 0
    assert "(measured 0," not in capsys.readouterr().out
    assert main([*argv, "--threads", "1"]) == 0
    assert "(measured 0," in capsys.readouterr().out  # the same problem at 1 thread: all cached
    assert main([*argv, "--threads", "2"]) == 0
    assert "(measured 0," not in capsys.readouterr().out  # 2 threads is another problem
    assert main([*argv, "--threads", "0"]) == 2


def test_tune_model_with_a_budget_prints_a_row_per_shape_as_it_goes(capsys, tmp_path) -> None:
    out_json = tmp_path / "m.json"
    code = main(
        [
            "tune",
            "model",
            "resnet-mini",
            "--batch",
            "2",
            "--preset",
            "tiny",
            "--repetitions",
            "1",
            "--budget-s",
            "20",
            "--threads",
            "1",
            "--json",
            str(out_json),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if "share" in line and "speedup" in line and "status" in line)
    assert sum(("tuned" in line or "skipped: budget" in line) for line in lines[header + 1 :]) >= 5  # 5+ unique shapes
    assert "where the time went (s): profile" in out and "skipped by the budget:" in out
    assert out.count("autotune: ") >= 1  # the one-line summary
    data = json.loads(out_json.read_text())
    assert {"compile", "validate", "time", "check"} <= set(data["time_s"]) and data["summary"].startswith("autotune: ")
    assert main(["tune", "model", "resnet-mini", "--budget-s", "0"]) == 2
