"""The REST API under /rapydli/api/ against a real Jupyter server and a real run store.

pytest-jupyter's fixtures are imported into this module rather than loaded as a plugin
(``pytest_plugins``): as a plugin its autouse fixtures and call hook would apply to every
test of the session (closing event loops, cleaning up a ServerApp after each test). Its
async tests therefore run through :func:`on_server_loop`, on the loop the server uses.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import tornado.httpclient
from processes import engine_pids, wait_until_gone
from pytest_jupyter.jupyter_server import *  # noqa: F403 - the fixtures jp_fetch needs, for this module only

from rapydli.experiments.store.runstore import RunStore, open_store


def on_server_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Turn an async test into a sync one that runs on pytest-jupyter's event loop."""
    signature = inspect.signature(test)
    wants_loop = "jp_asyncio_loop" in signature.parameters
    params = list(signature.parameters.values())
    if not wants_loop:
        params.append(inspect.Parameter("jp_asyncio_loop", inspect.Parameter.KEYWORD_ONLY))

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        loop = kwargs["jp_asyncio_loop"] if wants_loop else kwargs.pop("jp_asyncio_loop")
        loop.run_until_complete(test(*args, **kwargs))

    run.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return run


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"rapydli.server": True}}}


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RunStore:
    """A fresh store in this test's own RAPYDLI_HOME (the server opens the same file)."""
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path / "home"))
    opened = open_store()
    assert opened is not None
    return opened


@pytest.fixture
def api(jp_fetch):
    async def call(*path: str, method: str = "GET", body: Any = None, **kwargs: Any) -> tuple[int, Any]:
        if body is not None and not isinstance(body, (str, bytes)):
            body = json.dumps(body)
        if method in ("POST", "PUT", "PATCH") and body is None:
            body = b""
        try:
            response = await jp_fetch("rapydli", "api", *path, method=method, body=body, **kwargs)
        except tornado.httpclient.HTTPClientError as exc:
            assert exc.response is not None, exc
            response = exc.response
        text = response.body.decode()
        return response.code, json.loads(text) if text else None

    async def raw(*path: str, **kwargs: Any) -> Any:
        """The response itself (for downloads), not its JSON."""
        return await jp_fetch("rapydli", "api", *path, **kwargs)

    call.raw = raw  # type: ignore[attr-defined]
    return call


def seed(store: RunStore) -> dict[str, str]:
    """Two training runs, a sweep with two trials: what the panel lists."""
    ids = {}
    ids["done"] = store.create_run("train", "mlp", {"lr": 0.1, "batch_size": 32}, seed=0, world_size=2)
    store.log_metrics(ids["done"], [(1, "loss", 1.0), (2, "loss", 0.5), (2, "throughput", 900.0)])
    store.finish_run(ids["done"])
    ids["live"] = store.create_run("train", "cnn", {"lr": 0.01}, seed=1)
    store.log_metrics(ids["live"], [(1, "loss", 2.0)])
    ids["sweep"] = store.create_run("sweep", "lr-sweep", {"metric": "val_loss", "direction": "minimize", "trials": 2})
    for i, lr in enumerate((0.1, 0.01)):
        trial = store.create_run(
            "trial", f"trial-{i}", {"epochs": 1, "trial": i, "params": {"lr": lr}}, parent=ids["sweep"]
        )
        store.log_metrics(trial, [(1, "val_loss", 1.0 - lr)])
        store.finish_run(trial, "finished" if i == 0 else "pruned")  # a trial's state is its run's status
    return ids


@on_server_loop
async def test_unauthenticated_requests_are_refused(jp_fetch, store: RunStore) -> None:
    for path, method in (
        ("runs", "GET"),
        ("clusters", "GET"),
        ("clusters", "POST"),
        ("version", "GET"),
        ("families", "GET"),
        ("compare", "GET"),
        ("runs/feedbeef0000", "PATCH"),
    ):
        with pytest.raises(tornado.httpclient.HTTPClientError) as info:
            await jp_fetch(
                "rapydli",
                "api",
                path,
                method=method,
                body=b"{}" if method in ("POST", "PATCH") else None,
                headers={"Authorization": ""},
            )
        assert info.value.code == 403, path


@on_server_loop
async def test_version(api) -> None:
    code, data = await api("version")
    assert code == 200
    assert data["version"] and data["api"] == 1


@on_server_loop
async def test_launchers_list_their_options_and_the_start_form_fields(api) -> None:
    code, data = await api("launchers")
    launchers = {launcher["name"]: launcher for launcher in data["launchers"]}
    assert code == 200 and set(launchers) == {"local", "ssh", "slurm", "srun", "pbs"}
    slurm = launchers["slurm"]
    assert slurm["form"] == ["partition", "nodes", "timelimit"]  # shown as fields; the others as key=value
    assert set(slurm["form"]) <= set(slurm["options"]) and slurm["options"]["nodes"]["type"] == "int"
    assert launchers["local"]["form"] == [] and all(
        set(spec["form"]) <= set(spec["options"]) for spec in launchers.values()
    )


@on_server_loop
async def test_runs_list_filters_and_pages(api, store: RunStore) -> None:
    ids = seed(store)
    code, data = await api("runs")
    assert code == 200 and data["total"] == 5
    assert {r["id"] for r in data["runs"]} >= {ids["done"], ids["live"], ids["sweep"]}
    code, data = await api("runs", params={"kind": "train"})
    assert data["total"] == 2 and [r["id"] for r in data["runs"]] == [ids["live"], ids["done"]]
    code, data = await api("runs", params={"kind": "train", "status": "finished"})
    assert [r["id"] for r in data["runs"]] == [ids["done"]]
    assert data["runs"][0]["final"] == {"loss": 0.5, "throughput": 900.0}
    code, data = await api("runs", params={"limit": "2", "offset": "1"})
    assert data["total"] == 5 and len(data["runs"]) == 2


@on_server_loop
async def test_run_detail_and_sweep_table(api, store: RunStore, tmp_path: Path) -> None:
    ids = seed(store)
    notebook = tmp_path / "out.ipynb"
    notebook.write_text("{}")
    store.add_artifact(ids["done"], notebook, "notebook")
    code, run = await api("runs", ids["done"])
    assert code == 200
    assert run["params"] == {"lr": 0.1, "batch_size": 32} and run["status"] == "finished"
    assert run["world_size"] == 2 and run["seed"] == 0
    assert [a["path"] for a in run["artifacts"]] == [str(notebook.resolve())]
    code, sweep = await api("sweeps", ids["sweep"])
    assert code == 200 and sweep["metric"] == "val_loss"
    assert [t["name"] for t in sweep["trials"]] == ["trial-0", "trial-1"]
    assert [t["final"]["val_loss"] for t in sweep["trials"]] == pytest.approx([0.9, 0.99])
    assert [t["sampled"] for t in sweep["trials"]] == [{"lr": 0.1}, {"lr": 0.01}]
    assert [t["state"] for t in sweep["trials"]] == ["COMPLETE", "PRUNED"]
    code, data = await api("sweeps", ids["done"])
    assert code == 404 and "not a sweep" in data["error"]


@on_server_loop
async def test_metrics_are_incremental(api, store: RunStore) -> None:
    ids = seed(store)
    code, first = await api("runs", ids["live"], "metrics")
    assert code == 200 and first["status"] == "running"
    assert [(m["step"], m["name"], m["value"]) for m in first["metrics"]] == [(1, "loss", 2.0)]
    code, empty = await api("runs", ids["live"], "metrics", params={"since": str(first["cursor"])})
    assert empty["metrics"] == [] and empty["cursor"] == first["cursor"]
    store.log_metrics(ids["live"], [(2, "loss", 1.5), (3, "loss", 1.2)])
    store.finish_run(ids["live"])
    code, more = await api("runs", ids["live"], "metrics", params={"since": str(first["cursor"])})
    assert [m["step"] for m in more["metrics"]] == [2, 3] and more["cursor"] > first["cursor"]
    assert more["status"] == "finished"


@pytest.mark.parametrize("bad", ["..", "a.b", "x" * 70, "..%2F..%2Fetc%2Fpasswd", "-rf"])
@on_server_loop
async def test_malformed_ids_are_400(api, store: RunStore, bad: str) -> None:
    for path in (
        ("runs", bad),
        ("runs", bad, "metrics"),
        ("sweeps", bad),
        ("clusters", bad),
        ("batches", bad),
        ("runs", bad, "artifacts", "0"),
    ):
        code, data = await api(*path)
        assert code == 400, (path, data)
        assert "must be 1-64 letters" in data["error"]


@on_server_loop
async def test_unknown_ids_are_404(api, store: RunStore) -> None:
    for path in (
        ("runs", "feedbeef0000"),
        ("runs", "feedbeef0000", "metrics"),
        ("sweeps", "feedbeef0000"),
        ("clusters", "c0000000000"),
        ("batches", "feedbeef0000"),
        ("runs", "feedbeef0000", "artifacts", "0"),
    ):
        code, data = await api(*path)
        assert code == 404 and "no " in data["error"], path
    code, data = await api("clusters", "c0000000000", method="DELETE")
    assert code == 404
    code, data = await api("clusters", "c0000000000", "restart", method="POST")
    assert code == 404


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("{not json", "not valid JSON"),
        ([2], "JSON object"),
        ({"launcher": "bogus"}, "unknown launcher"),
        ({"n": 0}, "'n'"),
        ({"n": "2"}, "'n'"),
        ({"options": {"mpi_cmd": 3}}, "list of strings"),
        ({"options": {"shell": "rm -rf /"}}, "no option 'shell'"),
        ({"code": "import os"}, "unknown field"),
    ],
)
@on_server_loop
async def test_bad_cluster_requests_are_400(api, store: RunStore, body: Any, message: str) -> None:
    code, data = await api("clusters", method="POST", body=body)
    assert code == 400 and message in data["error"]
    code, data = await api("clusters")
    assert data["clusters"] == []


@on_server_loop
async def test_bad_query_arguments_are_400(api, store: RunStore) -> None:
    for params in ({"kind": "bogus"}, {"status": "ok"}, {"limit": "0"}, {"offset": "x"}):
        code, data = await api("runs", params=params)
        assert code == 400 and data["error"], params
    code, data = await api("runs", "feedbeef0000", "metrics", params={"since": "x"})
    assert code == 400 and "since" in data["error"]


async def wait_for(api, cluster_id: str, states: set[str], timeout: float = 150) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, entry = await api("clusters", cluster_id)
        assert code == 200, entry
        if entry["state"] in states:
            return entry
        await asyncio.sleep(0.5)
    raise AssertionError(f"cluster {cluster_id} never reached {states}: {entry}")


async def wait_gone(api, cluster_id: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        code, entry = await api("clusters", cluster_id)
        if code == 404:
            return
        assert entry["state"] == "stopping", entry
        await asyncio.sleep(0.3)
    raise AssertionError(f"cluster {cluster_id} was never stopped")


def assert_no_engines(before: set[int], timeout: float = 15) -> None:
    assert wait_until_gone(before, timeout) == set()


@pytest.mark.engines
@pytest.mark.timeout(240)
@on_server_loop
async def test_start_status_stop_a_real_cluster(api, store: RunStore) -> None:
    before = engine_pids()
    code, entry = await api("clusters", method="POST", body={"n": 2, "launcher": "local"})
    assert code == 202 and entry["state"] == "starting" and entry["n"] == 2
    running = await wait_for(api, entry["id"], {"running", "failed"})
    assert running["state"] == "running", running["error"]
    assert running["engines_alive"] == 2
    assert len(engine_pids() - before) >= 2
    # Notebooks can attach to it: the cluster is published under its attach id.
    from rapydli.cluster import Cluster

    assert running["attach_id"] in [record["id"] for record in Cluster.detached()]
    code, listed = await api("clusters")
    assert [c["id"] for c in listed["clusters"]] == [entry["id"]]
    # where every rank stands, asked from outside the engines: both idle here
    code, where = await api("clusters", entry["id"], "where")
    assert code == 200 and [r["rank"] for r in where["ranks"]] == [0, 1], where
    assert all(r["error"] is None and r["where"] == "idle (no task running)" for r in where["ranks"]), where
    assert where["text"] == "ranks 0, 1: idle (no task running)"
    code, stopped = await api("clusters", entry["id"], method="DELETE")
    assert code == 202 and stopped["state"] == "stopping"  # answered at once; stopped in the background
    await wait_gone(api, entry["id"])
    code, listed = await api("clusters")
    assert listed["clusters"] == []
    assert running["attach_id"] not in [record["id"] for record in Cluster.detached()]
    assert_no_engines(before)


@pytest.mark.engines
@pytest.mark.timeout(240)
@on_server_loop
async def test_server_shutdown_stops_its_clusters(api, jp_serverapp, store: RunStore) -> None:
    before = engine_pids()
    code, entry = await api("clusters", method="POST", body={"n": 2})
    assert code == 202
    (app,) = jp_serverapp.extension_manager.extension_apps["rapydli.server"]
    await app.stop_extension()  # what the server calls on shutdown; waits for the start in progress
    code, listed = await api("clusters")
    assert listed["clusters"] == []
    assert_no_engines(before)
