"""The run store: real SQLite files, real concurrent writer processes."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import rapydli as rd
from rapydli import settings
from rapydli.errors import ConfigError, NotFoundError, StoreError
from rapydli.experiments.store import runstore as store_mod
from rapydli.experiments.store.runstore import RunStore, open_store


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    s = RunStore(tmp_path / "runs.db")
    yield s
    s.close()


def test_create_log_finish_roundtrip(store: RunStore) -> None:
    run_id = store.create_run("train", "mlp", {"lr": 0.1, "layers": [2, 3]}, world_size=2, seed=7)
    store.log_metrics(run_id, [(1, "loss", 0.9), (2, "loss", 0.7), (2, "acc", 0.5)])
    store.add_artifact(run_id, "out.ipynb", "notebook")
    store.add_record(run_id, "accuracy", "scalar", 0.93)
    run = store.get_run(run_id)
    assert run["status"] == "running" and run["ended"] is None
    store.finish_run(run_id, "failed", error="boom")
    run = store.get_run(run_id)
    assert (run["kind"], run["name"], run["params"], run["world_size"], run["seed"]) == (
        "train",
        "mlp",
        {"lr": 0.1, "layers": [2, 3]},
        2,
        7,
    )
    assert run["status"] == "failed" and run["error"] == "boom" and run["duration"] >= 0
    assert run["host"] and run["pid"] > 0
    assert set(run["versions"]) == {"python", "torch", "mpi4py", "mpi", "rapydli"}
    assert run["versions"]["rapydli"] == rd.__version__
    assert run["git_commit"] is None or len(run["git_commit"]) == 40
    rows = store.metrics(run_id)
    assert [(r["step"], r["name"], r["value"]) for r in rows] == [(1, "loss", 0.9), (2, "loss", 0.7), (2, "acc", 0.5)]
    assert [r["name"] for r in store.metrics(run_id, since=rows[0]["seq"])] == ["loss", "acc"]
    assert store.metrics(run_id, since=rows[-1]["seq"]) == []
    assert store.artifacts(run_id)[0]["path"].endswith("out.ipynb")
    assert store.records(run_id) == {"accuracy": {"type": "scalar", "value": 0.93}}
    assert store.final_metrics(run_id) == {"loss": 0.7, "acc": 0.5, "accuracy": 0.93}


def test_wal_mode_and_schema_version(store: RunStore) -> None:
    conn = sqlite3.connect(store.path)
    assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert conn.execute("SELECT version FROM schema_version").fetchone()[0] == store_mod.SCHEMA_VERSION
    assert store.schema_version == store_mod.SCHEMA_VERSION


def test_migration_path_from_older_and_refusal_of_newer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "runs.db"
    RunStore(path).close()
    # a future migration is applied on open, and the version moves on
    monkeypatch.setattr(store_mod, "MIGRATIONS", [*store_mod.MIGRATIONS, "ALTER TABLE runs ADD COLUMN future TEXT"])
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", store_mod.SCHEMA_VERSION + 1)
    upgraded = RunStore(path)
    assert upgraded.schema_version == store_mod.SCHEMA_VERSION
    columns = [row[1] for row in sqlite3.connect(path).execute("PRAGMA table_info(runs)")]
    assert "future" in columns
    upgraded.close()
    # an older rapydli refuses a newer file instead of corrupting it
    monkeypatch.setattr(store_mod, "SCHEMA_VERSION", store_mod.SCHEMA_VERSION - 1)
    with pytest.raises(StoreError, match="newer"):
        RunStore(path)


def test_unreadable_file_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="unreadable"):
        RunStore(path)


@pytest.mark.parametrize("bad", ["", "../etc/passwd", "a b", "x;DROP TABLE runs", "a" * 65, 5, None])
def test_unsafe_ids_are_rejected(store: RunStore, bad: object) -> None:
    with pytest.raises(NotFoundError):
        store.get_run(bad)  # type: ignore[arg-type]


def test_unknown_id_and_bad_kind(store: RunStore) -> None:
    with pytest.raises(NotFoundError, match="no run 'deadbeef0000'"):
        store.get_run("deadbeef0000")
    with pytest.raises(NotFoundError):
        store.finish_run("deadbeef0000")
    with pytest.raises(ConfigError, match="kind must be one of"):
        store.create_run("training", "x", {})
    with pytest.raises(ConfigError, match="status"):
        store.list_runs(status="done")


def test_list_filters_pagination_and_prefix(store: RunStore) -> None:
    ids = [store.create_run("trial", f"t{i}", {"i": i}, parent=None) for i in range(5)]
    other = store.create_run("sweep", "s", {})
    store.finish_run(ids[0])
    rows, total = store.list_runs(kind="trial")
    assert total == 5 and [r["name"] for r in rows] == ["t4", "t3", "t2", "t1", "t0"]
    rows, total = store.list_runs(kind="trial", limit=2, offset=1)
    assert total == 5 and [r["name"] for r in rows] == ["t3", "t2"]
    rows, total = store.list_runs(status="finished")
    assert total == 1 and rows[0]["id"] == ids[0]
    assert store.resolve(other[:8]) == other
    child = store.create_run("trial", "c", {}, parent=other)
    assert [r["id"] for r in store.list_runs(parent=other)[0]] == [child]


def test_parent_defaults_to_environment(store: RunStore, monkeypatch: pytest.MonkeyPatch) -> None:
    parent = store.create_run("batch", "nb", {})
    monkeypatch.setenv(settings.PARENT_RUN, parent)
    child = store.create_run("train", "m", {})
    assert store.get_run(child)["parent"] == parent


WRITER = """
import sys
from rapydli.experiments.store.runstore import RunStore
store = RunStore(sys.argv[1])
worker = int(sys.argv[2])
run_id = store.create_run("trial", f"w{worker}", {"worker": worker})
for step in range(200):
    store.log_metrics(run_id, [(step, "loss", float(step)), (step, "acc", 1.0)])
    if step % 50 == 0:
        store.heartbeat(run_id)
store.add_record(run_id, "done", "scalar", worker)
store.finish_run(run_id)
"""


def test_concurrent_writer_processes_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    RunStore(path).close()
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    procs = [subprocess.Popen([sys.executable, str(script), str(path), str(w)]) for w in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    store = RunStore(path)
    rows, total = store.list_runs(kind="trial", status="finished")
    assert total == 4
    for run in rows:
        metrics = store.metrics(run["id"])
        assert len(metrics) == 400
        assert sorted(m["step"] for m in metrics if m["name"] == "loss") == list(range(200))
        assert store.records(run["id"])["done"]["value"] == run["params"]["worker"]


def test_dead_process_is_marked_interrupted_on_open(tmp_path: Path) -> None:
    path = tmp_path / "runs.db"
    code = textwrap.dedent(
        f"""
        import os
        from rapydli.experiments.store.runstore import RunStore
        s = RunStore({str(path)!r})
        print(s.create_run("train", "dies", {{}}), flush=True)
        os._exit(9)
        """
    )
    dead_id = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout.strip()
    live = RunStore(path)
    alive_id = live.create_run("train", "lives", {})
    assert live.get_run(dead_id)["status"] == "interrupted"  # marked when `live` opened
    reopened = RunStore(path)
    assert reopened.get_run(alive_id)["status"] == "running"  # this process is alive
    assert "stopped without finishing" in reopened.get_run(dead_id)["error"]


def test_other_host_runs_need_a_stale_heartbeat(store: RunStore) -> None:
    fresh = store.create_run("train", "remote-fresh", {})
    stale = store.create_run("train", "remote-stale", {})
    with sqlite3.connect(store.path) as conn:
        conn.execute("UPDATE runs SET host = 'node-17', pid = 1 WHERE id IN (?, ?)", (fresh, stale))
        conn.execute("UPDATE runs SET heartbeat = heartbeat - 3600 WHERE id = ?", (stale,))
    assert store.mark_interrupted(stale_after=600) == [stale]
    assert store.get_run(fresh)["status"] == "running"


def test_public_runs_and_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    s = open_store()
    assert s is not None and s.path == tmp_path / "home" / "runs.db"
    run_id = s.create_run("train", "mlp", {"lr": 0.5})
    s.log_metrics(run_id, [(1, "loss", 1.0), (2, "loss", 0.5)])
    s.finish_run(run_id)
    s.create_run("sweep", "sw", {})
    frame = rd.runs(kind="train")
    assert list(frame["id"]) == [run_id] and frame.loc[0, "status"] == "finished"
    assert isinstance(frame.loc[0, "started"], pd.Timestamp)
    assert len(rd.runs()) == 2 and rd.runs(status="failed").empty
    record = rd.run(run_id)
    assert record.params == {"lr": 0.5}
    assert list(record.history()["loss"]) == [1.0, 0.5]
    assert store_mod.current_run_id() == s.list_runs(kind="sweep")[0][0]["id"]
    with pytest.raises(NotFoundError):
        rd.run("nope")


def test_store_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAPYDLI_STORE", "off")
    assert open_store() is None
    with pytest.raises(StoreError, match="disabled"):
        rd.runs()


def test_a_write_interrupted_inside_its_transaction_does_not_block_the_next(store: RunStore) -> None:
    """Ctrl-C can land between a write's BEGIN and its COMMIT (it did in CI, right after BEGIN IMMEDIATE): every later
    write then failed with 'cannot start a transaction within a transaction' and the run could not be recorded interrupted."""
    run_id = store.create_run("train", "cut", {"lr": 0.1})
    store._conn.execute("BEGIN IMMEDIATE")  # as a write left it when the interrupt came before its COMMIT or ROLLBACK
    store._conn.execute("UPDATE runs SET name = 'half-written' WHERE id = ?", (run_id,))
    store.finish_run(run_id, status="interrupted")
    assert (
        store.get_run(run_id)["status"] == "interrupted" and store.get_run(run_id)["name"] == "cut"
    )  # the cut write is gone

    def interrupted(conn: object) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store._write(interrupted)
    assert not store._conn.in_transaction
    store.log_metrics(run_id, [(1, "loss", 0.5)])
    assert [row["value"] for row in store.metrics(run_id)] == [0.5]
