"""The RaPyDLI panel in a real JupyterLab, driven by Playwright in Debian's Chromium.

A JupyterLab server runs on 127.0.0.1 with a token and a temporary ``RAPYDLI_HOME``
seeded with runs by the test. Screenshots go to ``test-artifacts/``. Without
``/usr/bin/chromium`` the tests are skipped, unless ``RAPYDLI_REQUIRE_BROWSER=1``
(set by ``.ci/run``), where that is a failure. No browser is ever downloaded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from processes import engine_pids, wait_until_gone

from rapydli.experiments.store import RunStore

ROOT = Path(__file__).resolve().parents[1]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path(os.environ.get("RAPYDLI_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
REQUIRED = os.environ.get("RAPYDLI_REQUIRE_BROWSER") == "1"

if not CHROMIUM.exists():
    if REQUIRED:
        pytest.fail(f"RAPYDLI_REQUIRE_BROWSER=1 but {CHROMIUM} is missing (apt-get install chromium)", pytrace=False)
    pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium); browser tests skipped", allow_module_level=True)

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]
expect.set_options(timeout=30_000)  # two busy cores: the page can take a while to update


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seed(store: RunStore) -> dict[str, str]:
    """A finished training run with 30 steps, a live one, and a sweep of three trials."""
    ids = {}
    ids["done"] = store.create_run("train", "mlp-digits", {"lr": 0.1, "batch_size": 32, "epochs": 3}, seed=0, world_size=2)
    store.log_metrics(
        ids["done"],
        [(s, "loss", 2.3 * 0.9**s) for s in range(1, 31)] + [(s, "throughput", 800.0 + 5 * s) for s in range(1, 31)],
    )
    store.finish_run(ids["done"])
    ids["live"] = store.create_run("train", "cnn-live", {"lr": 0.01}, seed=1, world_size=2)
    store.log_metrics(ids["live"], [(s, "loss", 2.0 / s) for s in range(1, 6)])
    ids["sweep"] = store.create_run("sweep", "lr-sweep", {"metric": "val_loss", "direction": "minimize", "trials": 3})
    for i, lr in enumerate((0.3, 0.1, 0.03)):
        params = {"epochs": 3, "trial": i, "params": {"lr": lr, "width": 32 * (i + 1)}}  # as rd.sweep records them
        trial = store.create_run("trial", f"trial-{i}", params, parent=ids["sweep"])
        store.log_metrics(trial, [(1, "val_loss", 1.0 - lr)])
        store.add_record(trial, "trial_state", "scalar", "PRUNED" if i == 2 else "COMPLETE")
        store.finish_run(trial)
    store.log_metrics(ids["sweep"], [(3, "val_loss", 0.7)])
    store.finish_run(ids["sweep"])
    ids["scaling"] = store.create_run("scaling", "weak-scaling", {"workers": [1, 2, 4], "mode": "weak"})
    store.add_record(ids["scaling"], "scaling", "table", [
        {"workers": 1, "throughput": 100.0}, {"workers": 2, "throughput": 190.0}, {"workers": 4, "throughput": 340.0},
    ])  # fmt: skip
    store.finish_run(ids["scaling"])
    return ids


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A running ``jupyter lab`` with a token, and the store it reads."""
    base = tmp_path_factory.mktemp("lab")
    home, root_dir, config = base / "rapydli-home", base / "root", base / "jupyter-config"
    root_dir.mkdir()
    (config / "labconfig").mkdir(parents=True)
    # No "would you like news?" toast over the page.
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    store = RunStore(home / "runs.db")
    ids = seed(store)
    port, token = free_port(), "rapydli-test-token"
    # Every per-user folder (Jupyter, IPython profiles, caches) lives in the temp folder.
    env = {**os.environ, "RAPYDLI_HOME": str(home), "JUPYTER_CONFIG_DIR": str(config),
           "JUPYTER_DATA_DIR": str(base / "data"), "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"), "IPYTHONDIR": str(base / "ipython"),
           "XDG_CACHE_HOME": str(base / "cache"), "XDG_CONFIG_HOME": str(base / "xdg-config")}  # fmt: skip
    log = (base / "lab.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip", "127.0.0.1", f"--port={port}",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root_dir}", "--ServerApp.port_retries=0"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"{url}/rapydli/api/version?token={token}", timeout=5) as response:
                assert json.load(response)["api"] == 1
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"jupyter lab did not start:\n{(base / 'lab.log').read_text()}")
            time.sleep(0.5)
    try:
        yield {"url": url, "token": token, "store": store, "ids": ids, "proc": psutil.Process(proc.pid), "env": env}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server stops its clusters on shutdown
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        store.close()


@pytest.fixture(scope="module")
def page(lab: dict[str, Any]) -> Iterator[Page]:
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": lab["env"]["XDG_CACHE_HOME"],
                 "XDG_CACHE_HOME": lab["env"]["XDG_CACHE_HOME"], "XDG_CONFIG_HOME": lab["env"]["XDG_CONFIG_HOME"]},
        )  # fmt: skip
        context = browser.new_context(viewport={"width": 1400, "height": 900})
        tab = context.new_page()
        tab.set_default_timeout(60_000)
        tab.goto(f"{lab['url']}/lab?token={lab['token']}")
        expect(tab.locator("#jp-main-dock-panel")).to_be_visible(timeout=120_000)
        yield tab
        context.close()
        browser.close()


def open_panel(page: Page) -> Any:
    panel = page.get_by_role("region", name="RaPyDLI", exact=True)
    if not panel.is_visible():
        page.locator('.jp-SideBar .lm-TabBar-tab[data-id="rapydli-panel"]').click()
    expect(panel).to_be_visible()
    return panel


def test_panel_lists_seeded_runs_and_sweeps(page: Page, lab: dict[str, Any]) -> None:
    panel = open_panel(page)
    runs = panel.get_by_role("table", name="Run list")
    expect(runs.get_by_role("row", name=re.compile("mlp-digits"))).to_contain_text("finished")
    expect(runs.get_by_role("row", name=re.compile("cnn-live"))).to_contain_text("running")
    expect(runs.get_by_role("row", name=re.compile("mlp-digits"))).to_contain_text("0.0975")
    expect(panel.get_by_role("list", name="Sweep list")).to_contain_text("lr-sweep")
    panel.get_by_role("combobox", name="Filter by status").select_option("running")
    expect(runs.get_by_role("row")).to_have_count(2)  # header + the live run
    panel.get_by_role("combobox", name="Filter by kind").select_option("sweep")
    panel.get_by_role("combobox", name="Filter by status").select_option("")
    expect(runs.get_by_role("row")).to_have_count(2)  # header + the sweep
    expect(runs.get_by_role("row", name=re.compile("lr-sweep"))).to_be_visible()
    panel.get_by_role("combobox", name="Filter by kind").select_option("")
    panel.get_by_role("combobox", name="Filter by status").select_option("")
    expect(runs.get_by_role("row", name=re.compile("mlp-digits"))).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "lab-panel-runs.png"))


def test_run_view_plots_and_follows_a_live_run(page: Page, lab: dict[str, Any]) -> None:
    panel = open_panel(page)
    panel.get_by_role("row", name=re.compile("mlp-digits")).click()
    view = page.get_by_role("tabpanel", name="train: mlp-digits")
    expect(view.get_by_role("table", name="Parameters")).to_contain_text("batch_size")
    loss = view.locator('[data-plot="loss"]')
    expect(loss.locator(".main-svg").first).to_be_visible()
    expect(loss.locator(".scatterlayer .trace")).to_have_count(1)
    expect(loss.locator(".scatterlayer .point")).to_have_count(30)  # markers plotly drew
    expect(view.locator('[data-plot="throughput"] .main-svg').first).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "lab-run-view.png"))

    # The live run: new metrics appear while it runs, and polling stops when it ends.
    live = lab["ids"]["live"]
    panel = open_panel(page)
    panel.get_by_role("row", name=re.compile("cnn-live")).click()
    view = page.get_by_role("tabpanel", name="train: cnn-live")
    loss = view.locator('[data-plot="loss"]')
    expect(loss.locator(".scatterlayer .point")).to_have_count(5)
    lab["store"].log_metrics(live, [(s, "loss", 2.0 / s) for s in range(6, 11)])
    expect(loss.locator(".scatterlayer .point")).to_have_count(10)
    lab["store"].finish_run(live)
    expect(view.locator(".rapydli-RunView")).to_have_attribute("data-status", "finished")
    expect(view.get_by_role("table", name="Run")).to_contain_text("finished")
    page.screenshot(path=str(ARTIFACTS / "lab-run-view-live.png"))


def test_sweep_and_scaling_views(page: Page, lab: dict[str, Any]) -> None:
    panel = open_panel(page)
    panel.get_by_role("list", name="Sweep list").get_by_text("lr-sweep").click()
    view = page.get_by_role("tabpanel", name="sweep: lr-sweep")
    trials = view.get_by_role("table", name="Trials table")
    expect(trials.get_by_role("row")).to_have_count(4)
    expect(trials.get_by_role("row", name=re.compile("trial-2"))).to_contain_text("PRUNED")
    expect(trials.get_by_role("columnheader")).to_have_text(["trial", "state", "lr", "width", "val_loss"])
    parcoords = view.locator('[data-plot="parcoords"]')
    expect(parcoords.locator(".main-svg").first).to_be_visible()
    parcoords.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "lab-sweep-view.png"))

    panel = open_panel(page)
    panel.get_by_role("row", name=re.compile("weak-scaling")).click()
    view = page.get_by_role("tabpanel", name="scaling: weak-scaling")
    scaling = view.locator('[data-plot="scaling"]')
    expect(scaling.locator(".scatterlayer .trace")).to_have_count(3)  # speedup, ideal, efficiency
    expect(scaling).to_contain_text("efficiency")
    scaling.scroll_into_view_if_needed()
    page.screenshot(path=str(ARTIFACTS / "lab-scaling-view.png"))


def test_errors_are_shown_in_the_panel(page: Page) -> None:
    panel = open_panel(page)
    panel.get_by_role("button", name="Insert %%distributed cell").click()
    alert = panel.get_by_role("alert")
    expect(alert).to_contain_text("Open a notebook first")
    page.wait_for_timeout(2500)  # a poll in between does not hide it
    expect(alert).to_contain_text("Open a notebook first")
    panel.get_by_role("button", name="Dismiss error").click()
    expect(alert).to_have_count(0)

    panel.get_by_role("button", name="Start cluster").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("spinbutton", name="Engines").fill("0")
    dialog.get_by_role("button", name="Start").click()
    expect(alert).to_contain_text("'n' (engines) must be an integer 1..64")
    expect(alert).to_contain_text("HTTP 400")
    expect(panel).to_contain_text("No cluster started from this server.")
    page.screenshot(path=str(ARTIFACTS / "lab-panel-error.png"))
    panel.get_by_role("button", name="Dismiss error").click()


def test_commands_are_in_the_palette(page: Page) -> None:
    page.keyboard.press("Control+Shift+c")
    palette = page.locator("#command-palette")
    palette.locator("input").fill("RaPyDLI")
    expect(palette.get_by_text("RaPyDLI: Start Cluster…")).to_be_visible()
    expect(palette.get_by_text("RaPyDLI: Insert %%distributed Cell")).to_be_visible()
    page.keyboard.press("Escape")


@pytest.mark.engines
def test_start_and_stop_a_cluster_from_the_panel(page: Page, lab: dict[str, Any]) -> None:
    before = engine_pids(lab["proc"].pid)
    panel = open_panel(page)
    panel.get_by_role("button", name="Start cluster").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("spinbutton", name="Engines").fill("2")
    dialog.get_by_role("button", name="Start").click()
    clusters = panel.get_by_role("list", name="Cluster list")
    expect(clusters.locator(".rapydli-Cluster")).to_have_count(1)
    expect(clusters).to_contain_text("2/2 engines", timeout=240_000)
    expect(clusters).to_contain_text("running")
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 2 engines")
    assert len(engine_pids(lab["proc"].pid) - before) >= 2
    page.screenshot(path=str(ARTIFACTS / "lab-cluster-running.png"))

    # A notebook attaches to the panel's cluster through the inserted cells and runs on it.
    with urllib.request.urlopen(f"{lab['url']}/rapydli/api/clusters?token={lab['token']}", timeout=10) as response:
        (cluster,) = json.load(response)["clusters"]
    page.keyboard.press("Control+Shift+c")
    page.locator("#command-palette input").fill("New Notebook")
    page.keyboard.press("Enter")
    page.get_by_role("dialog").get_by_role("button", name="Select").click()  # the default Python 3 kernel
    notebook = page.locator(".jp-NotebookPanel:visible")
    cells = notebook.locator(".jp-Cell")
    expect(cells).to_have_count(1)  # the new notebook is ready
    expect(page.locator(".jp-NotebookPanel-toolbar").filter(has_text="Python 3")).to_be_visible()
    page.wait_for_timeout(500)  # the notebook tracker's focus change lands
    panel.get_by_role("button", name="Insert %%distributed cell").click()
    expect(panel.get_by_role("alert")).to_have_count(0)
    expect(cells.nth(1)).to_contain_text(f'rd.Cluster.attach("{cluster["attach_id"]}")')
    expect(cells.nth(2)).to_contain_text("%%distributed")
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile("^Run All Cells")).click()
    output = cells.nth(2).locator(".jp-OutputArea")
    expect(output).to_contain_text("rank 1 of 2", timeout=180_000)
    expect(output).to_contain_text("rank 0 of 2")
    page.screenshot(path=str(ARTIFACTS / "lab-notebook-attached.png"))

    panel.get_by_role("button", name=re.compile("^Stop cluster")).click()
    expect(panel).to_contain_text("No cluster started from this server.", timeout=60_000)
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 0 engines")
    assert wait_until_gone(before, timeout=15, root=lab["proc"].pid) == set()
    page.screenshot(path=str(ARTIFACTS / "lab-cluster-stopped.png"))
