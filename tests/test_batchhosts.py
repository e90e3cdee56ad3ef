"""Batch items on two real hosts over ssh (network namespaces, see ``nshosts``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.batch.hosts import HostPool
from rapydli.experiments.store.runstore import open_store
from rapydli.settings import STORE_PATH

NOTEBOOKS = Path(__file__).resolve().parent / "notebooks"


def test_a_pool_needs_hosts() -> None:
    with pytest.raises(ConfigError, match="names no host"):
        HostPool([","])
    assert HostPool(["h1,h2", "h3"]).hosts == ["h1", "h2", "h3"]


@pytest.mark.hosts
@pytest.mark.notebook
def test_batch_items_on_both_hosts_record_every_row_once(hosts, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    monkeypatch.delenv(STORE_PATH, raising=False)
    xs = [1, 2]  # one item per host, side by side
    summary = rd.batch(
        NOTEBOOKS / "host_records.ipynb",
        {"x": xs, "n": 20},
        parallel=2,
        hosts=hosts.names,
        ssh_command=hosts.ssh,
        out=tmp_path / "out",
        progress=False,
        timeout=240,
    )
    assert (summary["status"] == "finished").all(), summary[["status", "error"]].to_string()
    assert set(summary["host"]) == {"h1", "h2"}

    store = open_store()
    items = {row["run_id"]: row["x"] for _, row in summary.iterrows()}
    children = [run for run in store.list_runs(kind="train")[0] if run["parent"] in items]
    assert sorted(store.get_run(r)["status"] for r in items) == ["finished"] * len(xs)
    for run_id, x in items.items():
        records = store.records(run_id)
        assert {name: rec["value"] for name, rec in records.items() if name.startswith("r")} == {
            f"r{i}": x * 100 + i for i in range(20)
        }
    assert sorted(c["name"] for c in children) == [f"child-{x}" for x in xs]
    assert {c["host"] for c in children} == {"h1", "h2"}
    for child in children:
        steps = [m["step"] for m in store.metrics(child["id"])]
        assert steps == list(range(20)), steps  # every row arrived, none twice
    assert not any(Path(c["cwd"], ".rapydli-runs.db-journal").exists() for c in children)
    assert os.environ.get(STORE_PATH) is None  # the owner kept writing its own store


@pytest.mark.hosts
@pytest.mark.notebook
def test_an_item_timed_out_on_a_host_leaves_nothing_there(hosts, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    summary = rd.batch(
        NOTEBOOKS / "params.ipynb",
        {"sleep": 120.0},
        hosts=["h2"],
        ssh_command=hosts.ssh,
        out=tmp_path / "out",
        progress=False,
        timeout=20,
    )
    assert summary["status"].tolist() == ["failed"] and "timed out" in summary["error"][0]
    host = hosts.host("h2")
    deadline = time.monotonic() + 15
    while host.pids() != [host.sshd.pid] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert host.pids() == [host.sshd.pid], f"left on h2: {host.commands()}"
