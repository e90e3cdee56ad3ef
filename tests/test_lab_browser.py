"""The RaPyDLI panel in a real JupyterLab, driven by Playwright in Debian's Chromium.

A JupyterLab server runs on 127.0.0.1 with a token and a temporary ``RAPYDLI_HOME``
holding real runs made by the test (training, a sweep with a pruned trial, a batch with a
failed item) and two seeded ones (a live run, a scaling study). Screenshots go to the
test's temp folder (printed). Without
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

from playwright.sync_api import Page, expect, sync_playwright  # noqa: E402 - only once the browser is known to exist

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]
expect.set_options(timeout=30_000)  # two busy cores: the page can take a while to update


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def seed(store: RunStore) -> dict[str, str]:
    """What real runs cannot show on demand: a run that is still live, and a scaling study."""
    ids = {}
    ids["live"] = store.create_run("train", "cnn-live", {"lr": 0.01}, seed=1, world_size=2)
    store.log_metrics(ids["live"], [(s, "loss", 2.0 / s) for s in range(1, 6)])
    ids["scaling"] = store.create_run("scaling", "weak-scaling", {"workers": [1, 2, 4], "mode": "weak"})
    store.add_record(ids["scaling"], "scaling", "table", [
        {"workers": 1, "throughput": 100.0}, {"workers": 2, "throughput": 190.0}, {"workers": 4, "throughput": 340.0},
    ])  # fmt: skip
    store.finish_run(ids["scaling"])
    return ids


def make_real_runs(env: dict[str, str], root_dir: Path) -> dict[str, Any]:
    """Two training runs and a sweep with a pruned trial (tests/lab_runs.py, on 2 engines), and a
    batch of two notebook items, one failing (``rapydli batch``, outputs under the Lab root)."""
    made = subprocess.run([sys.executable, str(ROOT / "tests" / "lab_runs.py")], check=False, env=env, capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-3000:]
    ids = json.loads(made.stdout.strip().splitlines()[-1])
    assert "PRUNED" in ids["trial_states"], ids
    batch = subprocess.run(
        [sys.executable, "-m", "rapydli", "batch", str(ROOT / "tests" / "notebooks" / "params.ipynb"),
         "--grid", "x=2,-1", "--out", "batch-out", "--parallel", "2"],
        check=False, env=env, cwd=root_dir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert batch.returncode == 1 and "1 of 2 items failed" in batch.stderr, batch.stderr[-3000:]
    return ids


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A running ``jupyter lab`` with a token, the store it reads, real runs in it, and the
    folder screenshots go to."""
    base = tmp_path_factory.mktemp("lab")
    home, root_dir, config = base / "rapydli-home", base / "root", base / "jupyter-config"
    shots = base / "screenshots"
    root_dir.mkdir()
    shots.mkdir()
    (config / "labconfig").mkdir(parents=True)
    # No "would you like news?" toast over the page.
    (config / "labconfig" / "page_config.json").write_text(
        json.dumps({"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}})
    )
    # Every per-user folder (Jupyter, IPython profiles, caches) lives in the temp folder.
    env = {**os.environ, "RAPYDLI_HOME": str(home), "JUPYTER_CONFIG_DIR": str(config),
           "JUPYTER_DATA_DIR": str(base / "data"), "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
           "JUPYTERLAB_WORKSPACES_DIR": str(base / "workspaces"), "IPYTHONDIR": str(base / "ipython"),
           "XDG_CACHE_HOME": str(base / "cache"), "XDG_CONFIG_HOME": str(base / "xdg-config")}  # fmt: skip
    real = make_real_runs(env, root_dir)
    store = RunStore(home / "runs.db")
    ids = {**seed(store), **{k: v for k, v in real.items() if isinstance(v, str)}}
    (batch_run,) = [r for r in store.list_runs(kind="batch")[0] if r["parent"] is None]
    ids["batch"] = batch_run["id"]
    port, token = free_port(), "rapydli-test-token"
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
    print(f"\nscreenshots: {shots}")
    try:
        yield {"url": url, "token": token, "store": store, "ids": ids, "proc": psutil.Process(proc.pid), "env": env,
               "shots": shots, "root": root_dir}  # fmt: skip
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server stops its clusters on shutdown
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        store.close()
        subprocess.run([sys.executable, "-m", "rapydli", "cluster", "stop", "--all"], check=False, env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def page(lab: dict[str, Any]) -> Iterator[Page]:
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS, headless=True,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": lab["env"]["XDG_CACHE_HOME"],
                 "XDG_CACHE_HOME": lab["env"]["XDG_CACHE_HOME"], "XDG_CONFIG_HOME": lab["env"]["XDG_CONFIG_HOME"]},
        )  # fmt: skip
        context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
        tab = context.new_page()
        tab.set_default_timeout(60_000)
        tab.goto(f"{lab['url']}/lab?token={lab['token']}")
        expect(tab.locator("#jp-main-dock-panel")).to_be_visible(timeout=120_000)
        yield tab
        context.close()
        browser.close()


def shot(page: Page, lab: dict[str, Any], name: str, element: Any = None) -> None:
    """Save a screenshot (of the page, or of one element) into the test's screenshot folder."""
    (element or page).screenshot(path=str(lab["shots"] / f"{name}.png"))


def open_panel(page: Page) -> Any:
    panel = page.get_by_role("region", name="RaPyDLI", exact=True)
    if not panel.is_visible():
        page.locator('.jp-SideBar .lm-TabBar-tab[data-id="rapydli-panel"]').click()
    expect(panel).to_be_visible()
    return panel


def family_row(panel: Any, run_id: str) -> Any:
    return panel.locator(f'tr[data-run-id="{run_id}"]')


def test_runs_are_families_with_filters_and_no_mid_word_wrapping(page: Page, lab: dict[str, Any]) -> None:
    ids = lab["ids"]
    panel = open_panel(page)
    runs = panel.get_by_role("table", name="Run list")
    sweep = family_row(runs, ids["sweep"])
    expect(sweep).to_contain_text("3 trials")
    expect(sweep).to_contain_text(ids["sweep"][:7])
    expect(family_row(runs, ids["batch"])).to_contain_text("2 items")
    expect(family_row(runs, ids["batch"])).to_have_attribute("data-status", "failed")
    expect(runs.locator("tr.rapydli-Child")).to_have_count(0)  # families start collapsed
    expect(family_row(runs, ids["train_a"]).locator(".rapydli-Started")).to_have_text(re.compile(r"^(now|\d+[mhd] ago)$"))
    sweep.get_by_role("button", name=re.compile("^Expand")).click()
    expect(runs.locator("tr.rapydli-Child")).to_have_count(3)
    expect(runs.locator('tr.rapydli-Child[data-status="PRUNED"]')).to_have_count(1)
    family_row(runs, ids["batch"]).get_by_role("button", name=re.compile("^Expand")).click()
    expect(runs.locator('tr.rapydli-Child[data-kind="batch"][data-status="failed"]')).to_have_count(1)
    # nothing wraps at the default sidebar width: every name and meta line is one line high
    width = panel.evaluate("el => el.getBoundingClientRect().width")
    lines = runs.locator(".rapydli-RunName, .rapydli-Meta, .rapydli-Metric > div").evaluate_all(
        """els => els.map(e => {
            const range = document.createRange();
            range.selectNodeContents(e);
            const rects = [...range.getClientRects()].filter(r => r.width > 0);
            const lineHeight = Math.min(...rects.map(r => r.height));
            return new Set(rects.map(r => Math.round((r.top - rects[0].top) / lineHeight))).size;
        })"""
    )
    assert lines and max(lines) == 1, (width, lines)
    shot(page, lab, "panel-families")
    shot(page, lab, "panel-only", panel)

    panel.get_by_role("combobox", name="Filter by status").select_option("failed")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(1)  # the batch: it and one item failed
    panel.get_by_role("combobox", name="Filter by status").select_option("")
    panel.get_by_role("combobox", name="Filter by kind").select_option("trial")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(1)
    expect(family_row(runs, ids["sweep"])).to_be_visible()
    panel.get_by_role("combobox", name="Filter by kind").select_option("")
    panel.get_by_role("searchbox", name="Search runs").fill("mlp_dig")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(2)
    panel.get_by_role("searchbox", name="Search runs").fill("")
    expect(panel.locator(".rapydli-Pager")).to_contain_text("of 6 runs")  # 2 train, sweep, batch, live, scaling


def test_compare_two_runs(page: Page, lab: dict[str, Any]) -> None:
    ids = lab["ids"]
    panel = open_panel(page)
    runs = panel.get_by_role("table", name="Run list")
    for key in ("train_a", "train_b"):
        family_row(runs, ids[key]).get_by_role("checkbox").check()
    panel.get_by_role("button", name="Compare selected runs").click()
    view = page.get_by_role("region", name="Compare runs")
    plot = view.locator('[data-plot="compare"]')
    expect(plot.locator(".scatterlayer .trace")).to_have_count(2)
    diff = view.get_by_role("table", name="Parameters that differ")
    expect(diff.get_by_role("row")).to_have_count(2)  # header + config.lr only: same seed, same everything else
    expect(diff).to_contain_text("config.lr")
    expect(diff).to_contain_text("0.1")
    expect(diff).to_contain_text("0.03")
    expect(view.get_by_role("table", name="Final metrics")).to_contain_text("val_accuracy")
    view.get_by_role("combobox", name="Metric").select_option("step_time_s")
    expect(plot).to_contain_text("step_time_s (ms)")
    expect(plot.locator(".scatterlayer .trace")).to_have_count(2)
    view.get_by_role("combobox", name="Metric").select_option("loss")
    view.get_by_role("slider", name="Smoothing").fill("0.6")
    view.get_by_role("combobox", name="X axis").select_option("time")
    expect(plot).to_contain_text("seconds since start")
    expect(plot.locator(".scatterlayer .trace")).to_have_count(2)
    shot(page, lab, "compare-view")
    for key in ("train_a", "train_b"):
        family_row(open_panel(page).get_by_role("table", name="Run list"), ids[key]).get_by_role("checkbox").uncheck()


def test_run_view_has_params_unit_plots_ranks_hosts_and_distinct_titles(page: Page, lab: dict[str, Any]) -> None:
    ids = lab["ids"]
    runs = open_panel(page).get_by_role("table", name="Run list")
    family_row(runs, ids["train_a"]).locator(".rapydli-RunName").click()
    family_row(runs, ids["train_b"]).locator(".rapydli-RunName").click()
    tabs = page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text="train: mlp_digits")
    expect(tabs).to_have_count(2)
    titles = tabs.all_inner_texts()
    assert len(set(titles)) == 2, titles  # the short id tells them apart
    view = page.get_by_role("region", name=f"Run {ids['train_b']}")  # the tab opened last
    params = view.get_by_role("table", name="Parameters")
    expect(params.get_by_role("row", name=re.compile(r"^config\.lr "))).to_contain_text("0.03")  # nested config expanded
    expect(view.get_by_role("table", name="Run")).to_contain_text("hosts")
    for plot, traces in (("loss", 2), ("throughput", 1), ("time", 4), ("fraction", 2), ("rank-step_time_s", 2), ("rank-comm_wait_s", 2)):
        expect(view.locator(f'[data-plot="{plot}"] .scatterlayer .trace')).to_have_count(traces)
    expect(view.locator('[data-plot="time"]')).to_contain_text("ms")
    expect(view.locator('[data-plot="rank-step_time_s"]')).to_contain_text("rank 1")
    shot(page, lab, "run-view")


def test_sweep_view_shows_the_pruned_trial(page: Page, lab: dict[str, Any]) -> None:
    ids = lab["ids"]
    family_row(open_panel(page).get_by_role("table", name="Run list"), ids["sweep"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {ids['sweep']}")
    trials = view.get_by_role("table", name="Trials table")
    expect(trials.locator("tbody tr")).to_have_count(3)
    pruned = trials.locator('tr[data-state="PRUNED"]')
    expect(pruned).to_have_count(1)
    expect(pruned).to_contain_text("PRUNED")
    expect(pruned).to_contain_text("9")  # lr 9.0 diverged
    expect(view.locator('[data-plot="best-so-far"] .scatterlayer .trace')).to_have_count(2)
    intermediate = view.locator('[data-plot="intermediate"]')
    expect(intermediate.locator(".scatterlayer .trace")).to_have_count(3)
    expect(intermediate).to_contain_text("(pruned)")
    expect(view.locator('[data-plot="parcoords"] .main-svg').first).to_be_visible()
    expect(view).to_contain_text("parameter importance needs 5 completed trials")
    view.get_by_role("heading", name=re.compile("Trials")).scroll_into_view_if_needed()
    shot(page, lab, "sweep-view")


def test_batch_view_shows_the_failed_item_and_opens_its_notebook(page: Page, lab: dict[str, Any]) -> None:
    ids = lab["ids"]
    family_row(open_panel(page).get_by_role("table", name="Run list"), ids["batch"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {ids['batch']}")
    items = view.get_by_role("table", name="Items table")
    expect(items.locator("tbody tr")).to_have_count(2)
    failed = items.locator('tr[data-status="failed"]')
    expect(failed).to_contain_text("cell 4: ValueError: x must be positive")
    expect(items.locator('tr[data-status="finished"]')).to_contain_text("4")  # y = x * factor recorded
    expect(view.get_by_role("region", name="Report")).to_contain_text("report")
    shot(page, lab, "batch-view")
    failed.get_by_role("link", name="open").click()
    expect(page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab.lm-mod-current")).to_contain_text(".ipynb")
    expect(page.locator(".jp-NotebookPanel:visible")).to_contain_text("x must be positive")
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.get_by_role("menuitem", name="Close All Tabs").click()  # later tests want no notebook open
    # Lab may ask to save the output notebook it just opened: discard, it is the batch's record
    page.wait_for_function("() => document.querySelector('.jp-Dialog') || !document.querySelector('.jp-NotebookPanel')")
    if page.get_by_role("dialog").count():
        page.get_by_role("dialog").get_by_role("button", name="Discard").click()
    expect(page.locator(".jp-NotebookPanel")).to_have_count(0)


def test_tags_and_note_round_trip(page: Page, lab: dict[str, Any]) -> None:
    ids, store = lab["ids"], lab["store"]
    runs = open_panel(page).get_by_role("table", name="Run list")
    family_row(runs, ids["train_b"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {ids['train_b']}")
    view.get_by_role("textbox", name="New tag").fill("winner")
    view.get_by_role("textbox", name="New tag").press("Enter")
    expect(view.locator('.rapydli-Tag[data-tag="winner"]')).to_be_visible()
    view.get_by_role("textbox", name="Note").fill("lr 0.03 generalises better")
    view.get_by_role("button", name="Save note").click()
    expect(view.get_by_role("alert")).to_be_hidden()
    deadline = time.monotonic() + 30
    while store.get_run(ids["train_b"])["note"] is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.tags(ids["train_b"]) == ["winner"]
    assert store.get_run(ids["train_b"])["note"] == "lr 0.03 generalises better"
    runs = open_panel(page).get_by_role("table", name="Run list")
    expect(family_row(runs, ids["train_b"]).locator(".rapydli-Tag")).to_have_text("winner")
    open_panel(page).get_by_role("searchbox", name="Search runs").fill("winner")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(1)
    open_panel(page).get_by_role("searchbox", name="Search runs").fill("")
    shot(page, lab, "tagged")
    store.set_tags(ids["train_b"], [])  # the store is the truth: the panel follows it
    expect(family_row(runs, ids["train_b"]).locator(".rapydli-Tag")).to_have_count(0)


def test_live_run_and_scaling_views(page: Page, lab: dict[str, Any]) -> None:
    # The live run: new metrics appear while it runs, and polling stops when it ends.
    live = lab["ids"]["live"]
    family_row(open_panel(page), live).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {live}")
    loss = view.locator('[data-plot="loss"]')
    expect(loss.locator(".scatterlayer .point")).to_have_count(5)
    lab["store"].log_metrics(live, [(s, "loss", 2.0 / s) for s in range(6, 11)])
    expect(loss.locator(".scatterlayer .point")).to_have_count(10)
    lab["store"].finish_run(live)
    expect(view).to_have_attribute("data-status", "finished")
    expect(view.get_by_role("table", name="Run")).to_contain_text("finished")

    family_row(open_panel(page), lab["ids"]["scaling"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {lab['ids']['scaling']}")
    scaling = view.locator('[data-plot="scaling"]')
    expect(scaling.locator(".scatterlayer .trace")).to_have_count(3)  # speedup, ideal, efficiency
    expect(scaling).to_contain_text("efficiency")


@pytest.mark.engines
def test_a_cli_started_cluster_is_listed_and_stopped_from_the_panel(page: Page, lab: dict[str, Any]) -> None:
    started = subprocess.run([sys.executable, "-m", "rapydli", "cluster", "start", "-n", "2"],
                             check=False, env=lab["env"], capture_output=True, text=True, timeout=180)  # fmt: skip
    assert started.returncode == 0, started.stderr
    cluster_id = started.stdout.strip()
    record = json.loads((Path(lab["env"]["RAPYDLI_HOME"]) / "clusters" / f"{cluster_id}.json").read_text())
    pids = [engine["pid"] for engine in record["engines"].values()]
    assert all(psutil.pid_exists(pid) for pid in pids)
    panel = open_panel(page)
    row = panel.get_by_role("listitem", name=f"Cluster {cluster_id}")
    expect(row).to_contain_text("2/2 engines")
    expect(row).to_contain_text("CLI")
    expect(row).to_have_attribute("data-state", "running")
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 2 engines")
    shot(page, lab, "cluster-cli", panel)
    row.get_by_role("button", name=f"Stop cluster {cluster_id}").click()
    expect(row).to_have_attribute("data-state", "stopping", timeout=5_000)  # the row answers at once
    expect(row).to_have_count(0, timeout=120_000)
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 0 engines")
    _, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
    assert not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def test_errors_are_shown_in_the_panel(page: Page, lab: dict[str, Any]) -> None:
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
    expect(panel).to_contain_text("No running cluster.")
    shot(page, lab, "panel-error", panel)
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
    shot(page, lab, "cluster-running")

    # A notebook attaches to the panel's cluster through the inserted cells and runs on it.
    with urllib.request.urlopen(f"{lab['url']}/rapydli/api/clusters?token={lab['token']}", timeout=10) as response:
        listed = json.load(response)["clusters"]
    ours = [c for c in listed if c["origin"] == "server"]
    assert len(ours) == 1, listed
    cluster = ours[0]
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
    shot(page, lab, "notebook-attached")

    panel.get_by_role("button", name=re.compile("^Stop cluster")).click()
    expect(panel).to_contain_text("No running cluster.", timeout=60_000)
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 0 engines")
    assert wait_until_gone(before, timeout=15, root=lab["proc"].pid) == set()
    shot(page, lab, "cluster-stopped")
