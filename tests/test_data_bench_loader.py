"""``rapydli bench loader`` runs end to end on a tiny dataset (rapydli/bench/loader.py)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
from click.testing import CliRunner

from rapydli.bench.loader import command


def test_bench_loader_prints_targets_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "loader.json"
    args = [
        "--samples",
        "96",
        "--shape",
        "4,8",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--workers",
        "1",
        "--threads",
        "2",
        "--latency-ms",
        "0.2",
        "--step-ms",
        "0",
        "--rounds",
        "2",
        "--dir",
        str(tmp_path),
        "--json",
        str(out),
    ]
    before = {p.pid for p in psutil.Process().children(recursive=True)}  # e.g. the session's test hosts' sshd
    result = CliRunner().invoke(command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "== rapydli bench loader ==" in result.output
    targets = [line for line in result.output.splitlines() if line.startswith("target ")]
    assert len(targets) == 6 and all(
        line.endswith((" met", " not met")) or " unclear (the rounds span " in line for line in targets
    )
    assert all(" over 2 rounds)" in line for line in targets)  # each ratio with its range over the rounds
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert {(r["setting"], r["store"], r["loader"]) for r in rows} >= {
        ("throttled", "files", "dataloader"),
        ("throttled", "lmdb", "clairvoyant"),
        ("throttled", "lmdb", "clairvoyant+disk"),
        ("unthrottled", "files", "clairvoyant"),
        ("unthrottled", "lmdb", "clairvoyant threads"),
    }
    assert (
        len(rows) == 2 * 16
        and {r["round"] for r in rows} == {0, 1}
        and all(r["sps_e1"] > 0 and r["sps_e2"] > 0 for r in rows)
    )
    cached = next(r for r in rows if r["loader"] == "clairvoyant+disk" and r["store"] == "lmdb" and r["round"] == 0)
    ram, disk, storage = map(int, cached["last_epoch_hits_ram/disk/storage"].split("/"))
    # epoch 2 reads from storage only samples whose caching epoch 1 was still finishing (prefetch across epochs)
    assert ram + disk + storage == 96 and storage <= 16
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("rapydli-bench-loader-")]
    assert (
        not {p.pid for p in psutil.Process().children(recursive=True)} - before
    )  # every loader's workers were stopped
