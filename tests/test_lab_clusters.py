"""The RaPyDLI panel's clusters in a real JupyterLab, driven by Playwright in Debian's Chromium.

Clusters started everywhere a user starts them: from the command line (listed, restarted
and stopped from the panel), held by a kernel (listed, stopped), from the panel itself
(started, used by a notebook, restarted, stopped) and, on the real local Slurm
(``local_slurm``), from the panel's Start dialog with launcher options: a job that waits
in the queue shows PENDING with its reason and is cancelled by Stop, as is one started by
``rapydli cluster start``; a running one shows its job and nodes. The server and browser come from ``tests/lab_browser.py``.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from lab_browser import api_get, chromium, lab_env, lab_page, open_panel, require_chromium, running_lab, shot
from processes import engine_pids, wait_until_gone

require_chromium()

from playwright.sync_api import Page, expect  # noqa: E402 - only once the browser is known to exist

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]
expect.set_options(timeout=30_000)  # two busy cores: the page can take a while to update

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    base = tmp_path_factory.mktemp("lab-clusters")
    with running_lab(base, lab_env(base)) as server:
        yield server


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Chromium for both labs of this module (Playwright's sync API runs one at a time)."""
    with chromium(tmp_path_factory.mktemp("chromium")) as launched:
        yield launched


@pytest.fixture(scope="module")
def page(browser: Any, lab: dict[str, Any]) -> Iterator[Page]:
    with lab_page(browser, lab) as tab:
        yield tab


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` still running (zombies count as gone)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.NoSuchProcess:
            continue
    return running


def left_after(pids: list[int], timeout: float = 15.0) -> list[int]:
    """Those of ``pids`` still running after waiting up to ``timeout`` seconds for them to end."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive(pids)


def start_from_dialog(
    page: Page, panel: Any, n: int, launcher: str = "local", fields: dict[str, str] | None = None, other: str = ""
) -> None:
    """Fill the Start dialog (engines, launcher, its option fields and key=value lines) and start."""
    panel.get_by_role("button", name="Start cluster").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("spinbutton", name="Engines").fill(str(n))
    dialog.get_by_role("combobox", name="Launcher").select_option(launcher)
    for key, value in (fields or {}).items():
        dialog.get_by_label(key, exact=True).fill(value)
    if other:
        dialog.get_by_role("textbox", name="Other launcher options").fill(other)
    dialog.get_by_role("button", name="Start").click()
    expect(dialog).to_have_count(0)


def test_errors_are_shown_in_the_panel(page: Page, lab: dict[str, Any]) -> None:
    panel = open_panel(page)
    panel.get_by_role("button", name="Insert %%distributed cell").click()
    alert = panel.get_by_role("alert")
    expect(alert).to_contain_text("Open a notebook first")
    page.wait_for_timeout(2500)  # a poll in between does not hide it
    expect(alert).to_contain_text("Open a notebook first")
    panel.get_by_role("button", name="Dismiss error").click()
    expect(alert).to_have_count(0)

    start_from_dialog(page, panel, 0)
    expect(alert).to_contain_text("'n' (engines) must be an integer 1..64")
    expect(alert).to_contain_text("HTTP 400")
    expect(panel).to_contain_text("No running cluster.")
    shot(page, lab, "panel-error", panel)
    panel.get_by_role("button", name="Dismiss error").click()
    # launcher options: the dialog lists the allowed ones, and the server names a wrong one
    panel.get_by_role("button", name="Start cluster").click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_role("combobox", name="Launcher").select_option("slurm")
    expect(dialog.get_by_label("partition", exact=True)).to_be_visible()
    expect(dialog).to_contain_text("slurm options: nodes, ntasks_per_node, cpus_per_task")
    shot(page, lab, "start-dialog-slurm", dialog)
    dialog.get_by_role("button", name="Cancel").click()
    start_from_dialog(page, panel, 2, "slurm", other="partitio=debug")
    expect(alert).to_contain_text("launcher 'slurm' has no option 'partitio': allowed are")
    panel.get_by_role("button", name="Dismiss error").click()
    start_from_dialog(page, panel, 2, "slurm", other="partition debug")
    expect(alert).to_contain_text("launcher option 'partition debug' is not key=value")
    panel.get_by_role("button", name="Dismiss error").click()
    expect(panel).to_contain_text("No running cluster.")


def test_the_start_dialog_waits_for_the_servers_launchers(browser: Any, lab: dict[str, Any]) -> None:
    """A Start dialog opened before the server said its launchers offers them all once it has, not only the local fallback."""
    held: list[Any] = []
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        tab = context.new_page()
        tab.set_default_timeout(60_000)
        tab.route(
            "**/rapydli/api/launchers**", lambda route: held.append(route)
        )  # the server's answer held back, as on a loaded machine
        # a workspace of its own, reset: the other tests' saved layout (the panel open) is not restored under the click that opens it
        tab.goto(f"{lab['url']}/lab/workspaces/launchers-held?reset&token={lab['token']}")
        expect(tab.locator("#jp-main-dock-panel")).to_be_visible(timeout=120_000)
        panel = open_panel(tab)
        deadline = time.monotonic() + 60
        while not held and time.monotonic() < deadline:
            tab.wait_for_timeout(100)
        assert held, "the panel never asked for the launchers"
        panel.get_by_role("button", name="Start cluster").click()
        tab.wait_for_timeout(1000)
        expect(tab.get_by_role("dialog")).to_have_count(0)  # not opened with the local fallback alone
        for route in held:
            route.continue_()
        dialog = tab.get_by_role("dialog")
        dialog.get_by_role("combobox", name="Launcher").select_option("slurm")
        expect(dialog.get_by_label("partition", exact=True)).to_be_visible()
        dialog.get_by_role("button", name="Cancel").click()
        expect(dialog).to_have_count(0)
    finally:
        context.close()


@pytest.mark.engines
def test_a_cli_started_cluster_is_listed_restarted_and_stopped_from_the_panel(page: Page, lab: dict[str, Any]) -> None:
    started = subprocess.run([sys.executable, "-m", "rapydli", "cluster", "start", "-n", "2"],
                             check=False, env=lab["env"], capture_output=True, text=True, timeout=180)  # fmt: skip
    assert started.returncode == 0, started.stderr
    cluster_id = started.stdout.strip()
    record_file = Path(lab["env"]["RAPYDLI_HOME"]) / "clusters" / f"{cluster_id}.json"
    pids = [engine["pid"] for engine in json.loads(record_file.read_text())["engines"].values()]
    assert alive(pids) == pids
    panel = open_panel(page)
    row = panel.get_by_role("listitem", name=f"Cluster {cluster_id}")
    expect(row).to_contain_text("2/2 engines")
    expect(row).to_contain_text("CLI")
    expect(row).to_have_attribute("data-state", "running")
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 2 engines")
    shot(page, lab, "cluster-cli", panel)

    # where every rank stands, asked from the record of a cluster this server did not start
    row.get_by_role("button", name=f"Where cluster {cluster_id} stands").click()
    dialog = page.get_by_role("dialog")
    expect(dialog).to_contain_text(f"Where cluster {cluster_id} stands")
    expect(dialog.locator(".rapydli-WhereText")).to_have_text("ranks 0, 1: idle (no task running)")
    expect(dialog.get_by_role("table", name="Ranks").locator("tbody tr")).to_have_count(2)
    dialog.get_by_role("button", name="Close").click()
    expect(dialog).to_have_count(0)

    row.get_by_role("button", name=f"Restart cluster {cluster_id}").click()
    expect(row).to_have_attribute("data-state", "restarting", timeout=5_000)  # the row answers at once
    expect(row).to_have_attribute("data-state", "running", timeout=180_000)
    expect(row).to_contain_text("2/2 engines")
    fresh = [engine["pid"] for engine in json.loads(record_file.read_text())["engines"].values()]
    assert len(fresh) == 2 and not set(fresh) & set(pids) and left_after(pids) == []  # new engines, the old ones gone

    row.get_by_role("button", name=f"Stop cluster {cluster_id}").click()
    expect(row).to_have_attribute("data-state", "stopping", timeout=5_000)
    expect(row).to_have_count(0, timeout=120_000)
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 0 engines")
    assert left_after(fresh) == []


@pytest.mark.engines
def test_a_cluster_held_by_a_kernel_is_listed_and_stopped_from_the_panel(page: Page, lab: dict[str, Any]) -> None:
    holder = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "lab_cluster_holder.py")],
        env=lab["env"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        cluster_id = holder.stdout.readline().strip()  # type: ignore[union-attr]
        assert cluster_id, holder.stderr.read()  # type: ignore[union-attr]
        engines = sorted(engine_pids(holder.pid))
        assert len(engines) >= 2, engines
        panel = open_panel(page)
        row = panel.get_by_role("listitem", name=f"Cluster {cluster_id}")
        expect(row).to_contain_text("2/2 engines")
        expect(row.locator(".rapydli-Origin")).to_have_text("kernel")
        expect(
            row.get_by_role("button", name=f"Restart cluster {cluster_id}")
        ).to_be_disabled()  # the kernel restarts it
        expect(row.get_by_role("button", name=f"Restart cluster {cluster_id}")).to_have_attribute(
            "title", re.compile("Held by a kernel")
        )
        shot(page, lab, "cluster-kernel", panel)
        row.get_by_role("button", name=f"Stop cluster {cluster_id}").click()
        expect(row).to_have_count(0, timeout=120_000)
        assert left_after(engines) == []  # its engines, mpiexec and controller are gone
        holder.stdin.close()  # type: ignore[union-attr]
        assert holder.wait(60) == 0, holder.stderr.read()  # type: ignore[union-attr]  # the kernel's own stop still works
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(10)


@pytest.mark.engines
def test_start_restart_and_stop_a_cluster_from_the_panel(page: Page, lab: dict[str, Any]) -> None:
    before = engine_pids(lab["proc"].pid)
    panel = open_panel(page)
    start_from_dialog(page, panel, 2)
    clusters = panel.get_by_role("list", name="Cluster list")
    expect(clusters.locator(".rapydli-Cluster")).to_have_count(1)
    expect(clusters).to_contain_text("2/2 engines", timeout=240_000)
    expect(clusters).to_contain_text("running")
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 2 engines")
    assert len(engine_pids(lab["proc"].pid) - before) >= 2
    logged = lab["log"].read_text()  # the Lab terminal: the controller's and engines' logs stay in their files
    assert "[IPController" not in logged and "[IPEngine" not in logged, logged[-2000:]
    shot(page, lab, "cluster-running")

    # A notebook attaches to the panel's cluster through the inserted cells and runs on it.
    ours = [c for c in api_get(lab, "clusters")["clusters"] if c["origin"] == "server"]
    assert len(ours) == 1, ours
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

    # Restart: fresh engines (new processes), running again; then stop.
    row = clusters.locator(f'[data-cluster-id="{cluster["id"]}"]')
    engines = engine_pids(lab["proc"].pid) - before
    row.get_by_role("button", name=f"Restart cluster {cluster['id']}").click()
    expect(row).to_have_attribute("data-state", "restarting", timeout=5_000)
    expect(row).to_have_attribute("data-state", "running", timeout=180_000)
    expect(row).to_contain_text("2/2 engines")
    restarted = [c for c in api_get(lab, "clusters")["clusters"] if c["id"] == cluster["id"]][0]
    assert restarted["engines_alive"] == 2 and restarted["attach_id"]
    assert left_after(sorted(engines)) == []  # the old engines (and controller) made way for new ones
    assert len(engine_pids(lab["proc"].pid) - before) >= 2

    panel.get_by_role("button", name=re.compile("^Stop cluster")).click()
    expect(panel).to_contain_text("No running cluster.", timeout=60_000)
    expect(page.locator(".rapydli-StatusItem")).to_have_text("RaPyDLI: 0 engines")
    assert wait_until_gone(before, timeout=15, root=lab["proc"].pid) == set()
    shot(page, lab, "cluster-stopped")
    page.get_by_role("menuitem", name="File", exact=True).click()
    page.get_by_role("menuitem", name="Close All Tabs").click()
    page.wait_for_function("() => document.querySelector('.jp-Dialog') || !document.querySelector('.jp-NotebookPanel')")
    if page.get_by_role("dialog").count():
        page.get_by_role("dialog").get_by_role("button", name=re.compile("Discard|Don't Save")).click()


# -- on the real local Slurm -------------------------------------------------------------------


@pytest.fixture(scope="module")
def slurm_lab(local_slurm: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A second lab whose server reaches the local Slurm (``SLURM_CONF`` is set by ``local_slurm``)."""
    base = tmp_path_factory.mktemp("lab-slurm")
    with running_lab(base, lab_env(base)) as server:
        yield {**server, "slurm": local_slurm}


@pytest.fixture(scope="module")
def slurm_page(browser: Any, slurm_lab: dict[str, Any]) -> Iterator[Page]:
    with lab_page(browser, slurm_lab) as tab:
        yield tab


@pytest.mark.slurm
@pytest.mark.engines
def test_a_slurm_cluster_from_the_panel_shows_its_job_and_a_pending_one_is_cancelled(
    slurm_page: Page, slurm_lab: dict[str, Any]
) -> None:
    page, slurm = slurm_page, slurm_lab["slurm"]
    panel = open_panel(page)
    clusters = panel.get_by_role("list", name="Cluster list")
    row, job = clusters.locator(".rapydli-Cluster"), clusters.locator(".rapydli-Job")

    # partition "down": the job waits in the queue, shown with its reason, and Stop cancels it
    start_from_dialog(page, panel, 2, "slurm", {"partition": "down", "timelimit": "00:05:00"}, other="cpus_per_task=1")
    expect(job).to_have_text(re.compile(r"^job \d+: PENDING \(PartitionDown\)$"))
    expect(row).to_have_attribute("data-state", "starting")
    job_id = re.match(r"job (\d+)", job.inner_text()).group(1)  # type: ignore[union-attr]
    assert job_id in slurm.queue()
    assert "TimeLimit=00:05:00" in slurm.run("scontrol", "-o", "show", "job", job_id).stdout
    shot(page, slurm_lab, "cluster-slurm-pending", panel)
    row.get_by_role("button", name=re.compile("^Stop cluster")).click()
    expect(row).to_have_count(0, timeout=60_000)
    assert job_id not in slurm.queue()

    # started from the command line, its queued job is shown too, and Stop cancels it
    cli = subprocess.Popen([sys.executable, "-m", "rapydli", "cluster", "start", "-n", "2", "--launcher", "slurm", "--timeout", "120",
                            "partition=down"], env=slurm_lab["env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        expect(row.locator(".rapydli-Origin")).to_have_text("CLI")
        expect(job).to_have_text(re.compile(r"^job \d+: PENDING \(PartitionDown\)$"))
        job_id = re.match(r"job (\d+)", job.inner_text()).group(1)  # type: ignore[union-attr]
        assert job_id in slurm.queue()
        row.get_by_role("button", name=re.compile("^Stop cluster")).click()
        expect(row).to_have_count(0, timeout=60_000)
        assert job_id not in slurm.queue()
        _, err = cli.communicate(timeout=60)  # the command waiting for its engines gives up
        assert cli.returncode != 0 and f"job {job_id}" in err, err
    finally:
        if cli.poll() is None:
            cli.send_signal(signal.SIGINT)  # Ctrl-C cancels its job
            cli.communicate(timeout=60)

    # partition "debug" on both nodes: the job runs the engines; the row shows it and its nodes
    start_from_dialog(page, panel, 2, "slurm", {"partition": "debug", "nodes": "2"})
    expect(row).to_have_attribute("data-state", "running", timeout=240_000)
    expect(row).to_contain_text("2/2 engines")
    expect(job).to_have_text(re.compile(r"^job \d+: RUNNING on n\[1-2\]$"))
    job_id = re.match(r"job (\d+)", job.inner_text()).group(1)  # type: ignore[union-attr]
    assert job_id in slurm.queue()
    shot(page, slurm_lab, "cluster-slurm-running", panel)
    row.get_by_role("button", name=re.compile("^Stop cluster")).click()
    expect(row).to_have_count(0, timeout=60_000)
    assert job_id not in slurm.queue()
