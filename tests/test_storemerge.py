"""Store files of work on other hosts merged into the owner's store."""

from __future__ import annotations

from pathlib import Path

from rapydli.experiments.store import merge as storemerge
from rapydli.experiments.store.runstore import RunStore


def test_a_job_store_merges_once_however_often_merged(tmp_path: Path) -> None:
    owner = RunStore(tmp_path / "owner.db")
    item = owner.create_run("batch", "item", {"x": 1})
    path = storemerge.job_store(owner, item, tmp_path / "job.db")
    job = RunStore(path)  # what the job's process opens through RAPYDLI_STORE_PATH
    child = job.create_run("train", "child", {}, parent=item)
    job.log_metrics(child, [(step, "loss", 1.0 / (step + 1)) for step in range(5)])
    job.add_record(item, "y", "scalar", 2)
    job.add_artifact(item, tmp_path / "out.ipynb", "notebook")
    job.finish_run(item)
    job.close()
    assert owner.get_run(item)["status"] == "running"  # nothing reached the owner yet

    first = storemerge.merge(owner, path)
    again = storemerge.merge(owner, path)
    assert first["metrics"] == 5 and again["metrics"] == 0
    assert owner.get_run(item)["status"] == "finished"
    assert owner.get_run(child)["parent"] == item
    assert [m["step"] for m in owner.metrics(child)] == [0, 1, 2, 3, 4]
    assert owner.records(item)["y"]["value"] == 2 and len(owner.artifacts(item)) == 1
