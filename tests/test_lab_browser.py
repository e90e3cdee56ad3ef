"""The RaPyDLI panel's runs in a real JupyterLab, driven by Playwright in Debian's Chromium.

The server (``tests/lab_browser.py``) reads a temporary ``RAPYDLI_HOME`` holding real runs
made by the test (training runs whose model is defined in their script, a sweep with a
pruned trial, a batch with a failed item) and seeded ones (a live run, a scaling study,
and enough plain finished runs to fill more than one page of the run list). Screenshots go
to the test's temp folder (printed). The clusters' browser tests are in
``tests/test_lab_clusters.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lab_browser import chromium, family_row, lab_env, lab_page, open_panel, require_chromium, running_lab, shot

from rapydli.experiments.store.runstore import RunStore

require_chromium()

from playwright.sync_api import Page, expect  # noqa: E402 - only once the browser is known to exist

pytestmark = [pytest.mark.browser, pytest.mark.timeout(420)]
expect.set_options(timeout=30_000)  # two busy cores: the page can take a while to update

ROOT = Path(__file__).resolve().parents[1]
#: Plain finished runs seeded before the others (so they are the oldest): with the 6 families
#: below they fill more than one page of the panel's run list (25 a page).
ARCHIVED = 30
FAMILIES = (
    8 + ARCHIVED
)  # 2 train, sweep, batch, live, scaling, a one-trial sweep, a straggling run, and the archived ones
#: The scaling study's tracker runs (seeded links: no tracker runs).
MLFLOW_URL = "http://127.0.0.1:5000/#/experiments/1/runs/a81c"
TENSORBOARD_DIR = "/tmp/tensorboard/weak-scaling"


def seed_archive(store: RunStore) -> None:
    """Store rows, no training: finished runs named ``... archive-NN`` with a final loss (long names
    that differ only at their end, as a sweep's or a planner's do)."""
    for i in range(ARCHIVED):
        run_id = store.create_run("train", f"plan dp2 pp1 tp1 zero1 archive-{i:02d}", {"lr": 0.001 * (i + 1)}, seed=i)
        store.log_metrics(run_id, [(1, "loss", 1.0 / (i + 1))])
        store.finish_run(run_id)


def seed(store: RunStore) -> dict[str, str]:
    """What real runs cannot show on demand: a run that is still live, and a scaling study."""
    ids = {}
    ids["live"] = store.create_run("train", "cnn-live", {"lr": 0.01}, seed=1, world_size=2)
    store.log_metrics(ids["live"], [(s, "loss", 2.0 / s) for s in (1, 2, 3, 6)])  # 4 and 5 died with an engine
    ids["scaling"] = store.create_run("scaling", "weak-scaling", {"workers": [1, 2, 4], "mode": "weak"})
    store.add_record(
        ids["scaling"],
        "scaling",
        "table",
        [
            {"workers": 1, "throughput": 100.0},
            {"workers": 2, "throughput": 190.0},
            {"workers": 4, "throughput": 340.0},
        ],
    )
    store.add_record(
        ids["scaling"], "tracker.mlflow", "json", {"id": "a81c", "url": MLFLOW_URL}
    )  # as the trackers link it
    store.add_record(ids["scaling"], "tracker.tensorboard", "json", {"id": ids["scaling"], "logdir": TENSORBOARD_DIR})
    store.finish_run(ids["scaling"])
    ids["one_trial"] = store.create_run("sweep", "one-trial-sweep", {"metric": "val_loss", "direction": "minimize"})
    trial = store.create_run("trial", "one-trial-sweep-trial-0", {"params": {"lr": 0.01}}, parent=ids["one_trial"])
    store.log_metrics(trial, [(10, "val_loss", 0.42)])
    store.finish_run(trial)
    store.finish_run(ids["one_trial"])
    # a run whose rank 1 straggled, then hung for a while (on_hang="wait"), and finished (the job records both as found)
    ids["straggling"] = store.create_run("train", "straggling", {"lr": 0.01}, seed=2, world_size=2)
    store.log_metrics(
        ids["straggling"],
        [
            (s, name, value)
            for s in range(1, 11)
            for name, value in (
                ("loss", 1.0 / s),
                ("step_time_s", 0.05),
                ("comm_wait_s", 0.03),
                ("step_time_s@rank1", 0.05),
                ("comm_wait_s@rank1", 0.0),
            )
        ],
    )
    store.add_record(
        ids["straggling"],
        "stragglers",
        "json",
        [{"rank": 1, "host": "n2", "busy_s": 0.05, "others_s": 0.02, "step": 10, "steps": 10, "text": STRAGGLER_TEXT}],
    )
    store.add_record(ids["straggling"], "hang", "json", {"diagnosis": HANG_TEXT, "action": "wait"})
    store.finish_run(ids["straggling"])
    return ids


STRAGGLER_TEXT = (
    "rank 1 (host n2) is a straggler: busy 50 ms per step against 20 ms on the other ranks (median of the last 10 "
    "steps); the others wait for it in the allreduce"
)
HANG_TEXT = "rank 1 never arrived at allreduce #11 on world, where rank 0 waits (4 MiB float32)"


def make_real_runs(env: dict[str, str], root_dir: Path) -> dict[str, Any]:
    """Two training runs and a sweep with a pruned trial (tests/lab_runs.py, on 2 engines), and a
    batch of two notebook items, one failing (``rapydli batch``, outputs under the Lab root)."""
    made = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "lab_runs.py")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    """A running ``jupyter lab`` with a token, the store it reads, and the runs in it."""
    base = tmp_path_factory.mktemp("lab")
    env = lab_env(base)
    (base / "root").mkdir()
    store = RunStore(Path(env["RAPYDLI_HOME"]) / "runs.db")
    seed_archive(store)
    real = make_real_runs(env, base / "root")
    ids = {**seed(store), **{k: v for k, v in real.items() if isinstance(v, str)}}
    (batch_run,) = [r for r in store.list_runs(kind="batch")[0] if r["parent"] is None]
    ids["batch"] = batch_run["id"]
    try:
        with running_lab(base, env) as server:
            yield {**server, "store": store, "ids": ids}
    finally:
        store.close()


@pytest.fixture(scope="module")
def page(lab: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Page]:
    with chromium(tmp_path_factory.mktemp("chromium")) as browser, lab_page(browser, lab) as tab:
        yield tab


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
    expect(family_row(runs, ids["train_a"]).locator(".rapydli-Started")).to_have_text(
        re.compile(r"^(now|\d+[mhd] ago)$")
    )
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
    # names cut at the default width still tell runs apart: their ends always show, whole
    tails = runs.locator(".rapydli-NameTail").evaluate_all(
        "els => els.map(e => [e.textContent, e.scrollWidth <= e.clientWidth, e.getBoundingClientRect().right])"
    )
    right = panel.evaluate("el => el.getBoundingClientRect().right")
    archived = [text for text, _, _ in tails if text.startswith("archive-")]
    assert len(archived) > 3 and len(set(archived)) == len(archived), tails
    assert all(whole and end <= right for _, whole, end in tails), (right, tails)
    shot(page, lab, "panel-families")
    shot(page, lab, "panel-only", panel)

    panel.get_by_role("combobox", name="Filter by status").select_option("failed")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(1)  # the batch: it and one item failed
    panel.get_by_role("combobox", name="Filter by status").select_option("")
    panel.get_by_role("combobox", name="Filter by kind").select_option("trial")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(2)  # the two sweeps
    expect(family_row(runs, ids["sweep"])).to_be_visible()
    panel.get_by_role("combobox", name="Filter by kind").select_option("")
    panel.get_by_role("searchbox", name="Search runs").fill("mlp_dig")
    expect(family_row(runs, ids["sweep"])).to_have_count(0)  # the search applied (the kind filter showed 2 rows too)
    expect(runs.locator("tr.rapydli-Family")).to_have_count(2)
    panel.get_by_role("searchbox", name="Search runs").fill("")
    expect(
        family_row(runs, ids["sweep"])
    ).to_be_visible()  # the cleared search applied: the next test starts unfiltered
    expect(panel.locator(".rapydli-Pager")).to_contain_text(f"of {FAMILIES} runs")


def test_the_run_list_pages(page: Page, lab: dict[str, Any]) -> None:
    panel = open_panel(page)
    runs = panel.get_by_role("table", name="Run list")
    pager = panel.locator(".rapydli-Pager")
    previous, following = (
        pager.get_by_role("button", name="Previous page"),
        pager.get_by_role("button", name="Next page"),
    )
    expect(pager).to_contain_text(f"1–25 of {FAMILIES} runs")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(25)
    expect(previous).to_be_disabled()
    expect(family_row(runs, lab["ids"]["sweep"])).to_be_visible()  # newest first: the real runs are on page 1
    following.click()
    expect(pager).to_contain_text(f"26–{FAMILIES} of {FAMILIES} runs")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(FAMILIES - 25)
    expect(following).to_be_disabled()
    expect(runs.locator(".rapydli-RunName", has_text="archive-00")).to_have_count(1)  # the oldest is on the last page
    expect(family_row(runs, lab["ids"]["sweep"])).to_have_count(0)
    shot(page, lab, "panel-page-2", panel)
    previous.click()
    expect(pager).to_contain_text(f"1–25 of {FAMILIES} runs")
    following.click()
    expect(pager).to_contain_text("26–")
    panel.get_by_role("searchbox", name="Search runs").fill("archive-0")  # a new filter starts at page 1
    expect(pager).to_contain_text("1–10 of 10 runs")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(10)
    panel.get_by_role("searchbox", name="Search runs").fill("")
    expect(pager).to_contain_text(f"1–25 of {FAMILIES} runs")


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
    expect(params.get_by_role("row", name=re.compile(r"^config\.lr "))).to_contain_text(
        "0.03"
    )  # nested config expanded
    expect(view.get_by_role("table", name="Run")).to_contain_text("hosts")
    for plot, traces in (
        ("loss", 2),
        ("throughput", 1),
        ("time", 4),
        ("fraction", 2),
        ("rank-step_time_s", 2),
        ("rank-comm_wait_s", 2),
    ):
        expect(view.locator(f'[data-plot="{plot}"] .scatterlayer .trace')).to_have_count(traces)
    expect(view.locator('[data-plot="time"]')).to_contain_text("ms")
    expect(view.locator('[data-plot="rank-step_time_s"]')).to_contain_text("rank 1")
    shot(page, lab, "run-view")

    # the code the run names: its own (defined in its script, as in a notebook) and the module function
    expect(params.get_by_role("row", name=re.compile(r"^sources"))).to_have_count(0)  # code is not a parameter
    source = view.get_by_role("region", name="Source")
    mine = source.locator('details[data-origin="notebook"]')
    expect(mine.locator("summary")).to_have_text("digits_mlp · defined in the notebook")
    code = mine.get_by_label("Source of digits_mlp")
    expect(code).to_be_visible()
    lines = code.inner_text().splitlines()
    assert (
        lines[0] == "def digits_mlp() -> object:"
        and "    model = models.mlp()" in lines
        and lines[-1] == "    return model"
    ), lines
    assert "mono" in code.evaluate("el => getComputedStyle(el).fontFamily").lower()
    library = source.locator('details[data-origin="module"]')
    expect(library.locator("summary")).to_contain_text("data_fn: rapydli.zoo.datasets:digits")
    expect(library.locator("pre")).to_contain_text("def digits(val_fraction: float = 0.2")
    mine.locator("summary").click()  # collapsible
    expect(code).to_be_hidden()
    mine.locator("summary").click()
    expect(code).to_be_visible()
    source.scroll_into_view_if_needed()
    shot(page, lab, "run-source")


def test_run_view_names_the_straggler_marks_its_rank_and_shows_the_hang(page: Page, lab: dict[str, Any]) -> None:
    runs = open_panel(page).get_by_role("table", name="Run list")
    family_row(runs, lab["ids"]["straggling"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {lab['ids']['straggling']}")
    expect(view.get_by_label("Straggler")).to_have_text(STRAGGLER_TEXT)
    expect(view.get_by_label("Hang diagnosis")).to_have_text(f"hang: {HANG_TEXT}")
    for plot in ("rank-step_time_s", "rank-comm_wait_s"):
        expect(view.locator(f'[data-plot="{plot}"]')).to_contain_text("rank 1 (straggler)")
    colour = view.locator('[data-plot="rank-step_time_s"] .scatterlayer .trace').nth(1).locator("path.js-line")
    assert "214, 39, 40" in colour.evaluate("el => getComputedStyle(el).stroke")  # #d62728: it stands out
    shot(page, lab, "run-straggler")


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
    # why: the report the pruner stopped it at, and the bar that report missed
    trial_id = pruned.get_attribute("data-run-id")
    decision = lab["store"].records(trial_id)["prune"]["value"]
    reports = {m["step"]: m["value"] for m in lab["store"].metrics(trial_id) if m["name"] == "val_loss"}
    assert decision["step"] in reports and decision["metric"] == "val_loss", (decision, reports)
    assert decision["value"] is None or decision["value"] == pytest.approx(reports[decision["step"]])
    assert decision["pruner"] == "SuccessiveHalvingPruner" and decision["rule"], decision
    why = pruned.locator(".rapydli-Prune")
    expect(why).to_contain_text(f"step {decision['step']}: val_loss")
    expect(why).to_contain_text(decision["rule"])
    expect(trials.locator('tr[data-state="COMPLETE"] .rapydli-Prune')).to_have_text(["", ""])
    expect(view.locator('[data-plot="best-so-far"] .scatterlayer .trace')).to_have_count(2)
    intermediate = view.locator('[data-plot="intermediate"]')
    expect(intermediate.locator(".scatterlayer .trace")).to_have_count(3 + (decision["value"] is not None))
    expect(intermediate).to_contain_text("(pruned)")
    if decision["value"] is not None:  # an x where the pruner judged it
        expect(intermediate).to_contain_text("pruned here")
    expect(view.locator('[data-plot="parcoords"] .main-svg').first).to_be_visible()
    expect(view).to_contain_text("parameter importance needs 5 completed trials")
    view.get_by_role("heading", name=re.compile("Trials")).scroll_into_view_if_needed()
    shot(page, lab, "sweep-view")


def test_best_so_far_of_one_complete_trial_is_legible(page: Page, lab: dict[str, Any]) -> None:
    family_row(open_panel(page).get_by_role("table", name="Run list"), lab["ids"]["one_trial"]).locator(
        ".rapydli-RunName"
    ).click()
    view = page.get_by_role("region", name=f"Run {lab['ids']['one_trial']}")
    best = view.locator('[data-plot="best-so-far"]')
    expect(best.locator(".scatterlayer .point")).to_have_count(1)
    expect(best).to_contain_text("1 complete trial")
    layout = best.evaluate("el => ({x: el.layout.xaxis.tickvals, y: el.layout.yaxis.range})")
    assert layout["x"] == [0] and layout["y"][0] < 0.42 < layout["y"][1], (
        layout
    )  # one tick at trial 0, the value in view


def test_find_a_sweep_see_why_trials_were_pruned_compare_the_best_two_and_tag_the_winner(
    page: Page, lab: dict[str, Any]
) -> None:
    """The researcher's path through the panel, start to end, without leaving JupyterLab."""
    ids, store = lab["ids"], lab["store"]
    panel = open_panel(page)
    runs = panel.get_by_role("table", name="Run list")
    # find the sweep, and which of its trials were pruned and why
    panel.get_by_role("combobox", name="Filter by kind").select_option("sweep")
    expect(runs.locator("tr.rapydli-Family")).to_have_count(2)  # it and the one-trial sweep
    sweep = family_row(runs, ids["sweep"])
    if sweep.get_by_role("button", name=re.compile("^Expand")).count():
        sweep.get_by_role("button", name=re.compile("^Expand")).click()
    expect(runs.locator('tr.rapydli-Child[data-status="PRUNED"]')).to_have_attribute(
        "title", re.compile(r"pruned at step \d+ with val_loss")
    )
    sweep.locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {ids['sweep']}")
    trials = view.get_by_role("table", name="Trials table")
    expect(trials.locator('tr[data-state="PRUNED"] .rapydli-Prune')).to_contain_text(re.compile(r"step \d+: val_loss"))

    # pick the best two: best first, tick the top two, compare them
    view.get_by_role("combobox", name="Order trials").select_option("best")
    rows = trials.locator("tbody tr")
    expect(rows.first).to_have_attribute("data-state", "COMPLETE")
    best_two = [rows.nth(i).get_attribute("data-run-id") for i in (0, 1)]
    finals = {t: store.final_metrics(t)["val_loss"] for t in best_two}
    complete = [
        r["id"] for r in store.list_runs(parent=ids["sweep"])[0] if r["status"] == "finished"
    ]  # a trial's state is its run's status
    assert sorted(complete) == sorted(best_two) and finals[best_two[0]] <= finals[best_two[1]], (complete, finals)
    for i in (0, 1):
        rows.nth(i).get_by_role("checkbox").check()
    shot(page, lab, "done-sweep")
    view.get_by_role("button", name="Compare selected trials").click()
    compare = page.get_by_role("region", name="Compare runs").filter(
        has=page.locator(f'th[data-run-id="{best_two[0]}"]')
    )
    expect(compare.locator('[data-plot="compare"] .scatterlayer .trace')).to_have_count(2)
    expect(compare.get_by_role("combobox", name="Metric")).to_have_value("val_loss")

    # read what differs: the sampled lr (as the trial's parameter and in its config), and which is better
    diff = compare.get_by_role("table", name="Parameters that differ")
    sampled = [store.get_run(t)["params"]["params"]["lr"] for t in best_two]
    lr_row = diff.get_by_role("row", name=re.compile(r"^params\.lr "))
    for value in sampled:
        expect(lr_row).to_contain_text(f"{value:.4g}")
    final_row = compare.get_by_role("table", name="Final metrics").get_by_role("row", name=re.compile(r"^val_loss "))
    best_cell = final_row.locator(".rapydli-Best")
    expect(best_cell).to_have_count(1)
    column = best_cell.evaluate("td => td.cellIndex")
    winner = diff.locator("thead th[data-run-id]").nth(column - 1).get_attribute("data-run-id")
    assert winner == best_two[0]

    # tag the winner, in its column of the compare view
    column_head = compare.locator(f'th[data-run-id="{winner}"]')
    column_head.get_by_role("textbox").fill("winner")
    column_head.get_by_role("textbox").press("Enter")
    expect(column_head.locator('.rapydli-Tag[data-tag="winner"]')).to_be_visible()
    deadline = time.monotonic() + 30
    while store.tags(winner) != ["winner"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert store.tags(winner) == ["winner"] and store.tags(best_two[1]) == []
    shot(page, lab, "done-compare")
    expect(family_row(runs, winner).locator(".rapydli-Tag")).to_have_text("winner")  # the panel shows it too
    panel.get_by_role("combobox", name="Filter by kind").select_option("")
    store.set_tags(winner, [])


def test_batch_view_shows_the_failed_item_and_opens_its_notebook(page: Page, lab: dict[str, Any]) -> None:
    ids = lab["ids"]
    family_row(open_panel(page).get_by_role("table", name="Run list"), ids["batch"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {ids['batch']}")
    items = view.get_by_role("table", name="Items table")
    expect(items.locator("tbody tr")).to_have_count(2)
    failed = items.locator('tr[data-status="failed"]')
    expect(failed).to_contain_text(
        'code cell 3 (In [4]), line 5: raise ValueError("x must be positive")'
    )  # nb.cells[3] of params.ipynb
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
    expect(family_row(runs, ids["train_a"])).to_be_visible()  # the cleared search applied
    shot(page, lab, "tagged")
    store.set_tags(ids["train_b"], [])  # the store is the truth: the panel follows it
    expect(family_row(runs, ids["train_b"]).locator(".rapydli-Tag")).to_have_count(0)


def test_live_run_and_scaling_views(page: Page, lab: dict[str, Any]) -> None:
    # The live run: new metrics appear while it runs, and polling stops when it ends.
    live = lab["ids"]["live"]
    family_row(open_panel(page), live).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {live}")
    loss = view.locator('[data-plot="loss"]')
    expect(loss.locator(".scatterlayer .point")).to_have_count(4)
    # it restarts from its checkpoint of step 5: the rows its engines never sent come from there, then it goes on
    lab["store"].log_metrics(live, [(s, "loss", 2.0 / s) for s in (4, 5)])
    lab["store"].add_record(live, "restarts", "json", [{"resumed_from_step": 5, "cause": "rank 1 died", "ranks": [1]}])
    lab["store"].log_metrics(live, [(s, "loss", 2.0 / s) for s in range(7, 11)])
    expect(loss.locator(".scatterlayer .point")).to_have_count(10)
    expect(loss.locator(".shapelayer path")).to_have_count(1)  # the restart, marked while the run goes on
    assert loss.evaluate("el => Array.from(el.data[0].x)") == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # in step order
    lab["store"].finish_run(live)
    expect(view).to_have_attribute("data-status", "finished")
    expect(view.get_by_role("table", name="Run")).to_contain_text("finished")

    family_row(open_panel(page), lab["ids"]["scaling"]).locator(".rapydli-RunName").click()
    view = page.get_by_role("region", name=f"Run {lab['ids']['scaling']}")
    scaling = view.locator('[data-plot="scaling"]')
    expect(scaling.locator(".scatterlayer .trace")).to_have_count(3)  # speedup, ideal, efficiency
    expect(scaling).to_contain_text("efficiency")
    trackers = view.get_by_role(
        "region", name="Trackers"
    )  # the study in MLflow (a link, to a new tab) and TensorBoard (its folder)
    mlflow = trackers.get_by_role("link", name="Open in mlflow")
    expect(mlflow).to_have_attribute("href", MLFLOW_URL)
    expect(mlflow).to_have_attribute("target", "_blank")
    expect(trackers.locator('li[data-tracker="tensorboard"]')).to_have_text(f"tensorboard: {TENSORBOARD_DIR}")
    expect(trackers.get_by_role("link")).to_have_count(1)
    shot(page, lab, "trackers", trackers)


def test_commands_are_in_the_palette(page: Page) -> None:
    page.keyboard.press("Control+Shift+c")
    palette = page.locator("#command-palette")
    palette.locator("input").fill("RaPyDLI")
    expect(palette.get_by_text("RaPyDLI: Start Cluster…")).to_be_visible()
    expect(palette.get_by_text("RaPyDLI: Insert %%distributed Cell")).to_be_visible()
    page.keyboard.press("Escape")


def test_one_cluster_panel(page: Page) -> None:
    # ipyparallel's own cluster panel (installed with ipyparallel) is disabled by RaPyDLI's page config: ours lists the same clusters
    disabled = page.evaluate(
        "() => JSON.parse(document.getElementById('jupyter-config-data').textContent).disabledExtensions"
    )
    assert "ipyparallel-labextension" in disabled, disabled
    tabs = page.locator(".jp-SideBar .lm-TabBar-tab")
    expect(page.locator('.jp-SideBar .lm-TabBar-tab[data-id="rapydli-panel"]')).to_have_count(1)
    titles = [t.lower() for t in tabs.evaluate_all("els => els.map(e => (e.title || '') + ' ' + (e.dataset.id || ''))")]
    assert not any("parallel" in t or "ipp" in t for t in titles), titles


#: A cell drawing a live plot as rd.train does, then one figure of the user's own.
LIVE_CELL = """import time
import plotly.express as px
from rapydli.widgets.live import LivePlot
plot = LivePlot(title="live in the lab")
plot.show()
for step in range(1, 61):
    plot({"kind": "train", "step": step, "loss": 1.0 / step, "samples_per_s": 100.0 + step, "step_time_s": 0.01,
          "comm_time_s": 0.001, "comm_wait_s": 0.0})
    time.sleep(0.02)
plot.close()
print("drawn", plot.redraws, "times")"""


def test_a_live_plot_saved_by_jupyterlab_is_light_and_shows_again_without_running(
    page: Page, lab: dict[str, Any]
) -> None:
    """JupyterLab runs a live-plotting cell and saves the notebook: one light figure is kept (plotly's JSON and its
    PNG, no widget state), and the notebook opened again shows it before anything runs."""
    import nbformat

    path = lab["root"] / "live.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(LIVE_CELL)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    tab = page.context.new_page()
    tab.set_default_timeout(120_000)
    try:
        tab.goto(f"{lab['url']}/lab/tree/live.ipynb?token={lab['token']}")
        notebook = tab.locator(".jp-NotebookPanel:visible")
        expect(tab.get_by_role("button", name="Python 3 (ipykernel) | Idle")).to_be_visible()  # the kernel is up
        notebook.locator(".jp-Cell").first.click()
        notebook.get_by_role("button", name="Run this cell and advance (Shift+Enter)").click()
        expect(
            notebook.locator('.jp-OutputArea-output[data-mime-type="application/vnd.jupyter.stdout"]')
        ).to_contain_text("drawn", timeout=120_000)
        expect(
            notebook.locator(".jp-OutputArea-output.js-plotly-plot .main-svg").first
        ).to_be_visible()  # drawn by plotly.js
        tab.keyboard.press("Control+s")
        tab.wait_for_function(
            "() => !document.querySelector('.jp-NotebookPanel .jp-mod-dirty, .lm-TabBar-tab.jp-mod-dirty')"
        )
        deadline = time.monotonic() + 60
        while not (saved := nbformat.read(path, as_version=4)).cells[0].get("outputs") and time.monotonic() < deadline:
            time.sleep(0.2)
        size = path.stat().st_size
        figures = [o for o in saved.cells[0].outputs if "application/vnd.plotly.v1+json" in o.get("data", {})]
        assert len(figures) == 1 and figures[0]["data"]["image/png"], saved.cells[0].outputs
        assert size < 200_000 and "widgets" not in saved.metadata, (size, list(saved.metadata))
        tab.reload()  # the saved file again: its outputs are shown before any cell runs
        notebook = tab.locator(".jp-NotebookPanel:visible")
        # plotly's interactive figure, or its PNG where JupyterLab does not trust the file's outputs
        shown = notebook.locator(".jp-OutputArea-output.js-plotly-plot .main-svg, .jp-OutputArea-output img").first
        expect(shown).to_be_visible()
        assert shown.evaluate("el => el.tagName === 'IMG' ? el.naturalWidth : el.getBoundingClientRect().width") > 300
        shot(tab, lab, "live-plot-saved")
    finally:
        tab.close()
