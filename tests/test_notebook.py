"""The notebook front door's display policy, in a real kernel through papermill: what a saved notebook keeps."""

from __future__ import annotations

import nbformat
import papermill
import pytest

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLOTLYJS_HEADER = "* plotly.js v"  # the licence header that opens the inlined library
CDN = "https://cdn.plot.ly/plotly-"

CELLS = [
    "import plotly.graph_objects as go\n"
    "import rapydli as rd\n"
    "from rapydli.notebook import progress_bar\n"
    "from rapydli.widgets.live import LivePlot",
    # the live plot as rd.train leaves it when it ends
    "plot = LivePlot(title='live')\n"
    "plot.show()\n"
    "for step in range(1, 6):\n"
    "    plot({'kind': 'train', 'step': step, 'loss': 1.0 / step, 'samples_per_s': 100.0,\n"
    "          'step_time_s': 0.01, 'comm_time_s': 0.001, 'comm_wait_s': 0.0})\n"
    "plot.close()",
    "rd.record('curve', go.Figure(go.Scatter(x=[1, 2], y=[3, 4])))",
    "go.Figure(go.Bar(x=[1], y=[2]), layout={'title': 'a figure as a cell result'})",
    # rd.train's progress bar
    "bar = progress_bar(total=40, desc='train', unit='step')\n"
    "for _ in range(40):\n"
    "    bar.update(1)\n"
    "bar.close()",
]


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    folder = tmp_path_factory.mktemp("front")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    nbformat.write(nb, folder / "in.ipynb")
    papermill.execute_notebook(str(folder / "in.ipynb"), str(folder / "out.ipynb"), kernel_name="python3",
                               language="python", cwd=str(folder), progress_bar=False,
                               engine_name="rapydli")  # fmt: skip  (as make demo and batch items run)
    nb = nbformat.read(folder / "out.ipynb", as_version=4)
    nb.metadata["size"] = (folder / "out.ipynb").stat().st_size
    return nb


def _outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for cell in nb.cells for o in cell.get("outputs", []) if "data" in o]


@pytest.mark.notebook
def test_saved_figures_carry_html_that_loads_plotly_from_its_cdn(executed: nbformat.NotebookNode) -> None:
    figures = [o for o in _outputs(executed) if PLOTLY in o["data"]]
    assert len(figures) == 3  # the live plot's last state, the recorded figure, the cell's result
    for figure in figures:
        html = figure["data"]["text/html"]
        assert "Plotly.newPlot" in html and CDN in html
    # no copy of plotly.js (4.9 MB) in the notebook: the HTML loads it from plotly's CDN
    assert not any(PLOTLYJS_HEADER in o["data"].get("text/html", "") for o in _outputs(executed))

    # nbconvert's HTML (what a viewer without JupyterLab's renderers shows) has every figure's div and call
    from nbconvert import HTMLExporter

    page, _ = HTMLExporter().from_notebook_node(executed)
    assert page.count('class="plotly-graph-div"') == 3 and page.count("Plotly.newPlot(") == 3
    assert page.count(PLOTLYJS_HEADER) == 0


@pytest.mark.notebook
def test_a_closed_live_plot_leaves_no_widget_state(executed: nbformat.NotebookNode) -> None:
    """The live plot's FigureWidget (its state carries ~5 MB of plotly's JavaScript) is closed when its
    static figure replaces it: the saved notebook keeps only the progress bar's widgets."""
    states = executed.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert states, "the progress bar's state is saved"
    assert not [s for s in states.values() if "_esm" in s["state"]], [s.get("model_name") for s in states.values()]  # anywidget's
    assert executed.metadata["size"] < 200_000, executed.metadata["size"]


@pytest.mark.notebook
def test_saved_progress_bar_shows_its_final_state(executed: nbformat.NotebookNode) -> None:
    bars = [o for o in _outputs(executed) if WIDGET in o["data"] and "train" in o["data"].get("text/plain", "")]
    assert len(bars) == 1
    text = bars[0]["data"]["text/plain"]
    assert "100%" in text and "40/40" in text, text


@pytest.mark.notebook
@pytest.mark.browser
def test_every_figure_is_drawn_in_a_browser_from_nbconvert_html(executed: nbformat.NotebookNode, tmp_path) -> None:
    """nbconvert's HTML of the executed notebook, opened in Chromium: every figure is drawn (an SVG in its
    div). plotly's CDN is answered with the plotly.js of the installed plotly (no network in tests)."""
    from pathlib import Path

    import plotly
    from lab_browser import chromium, require_chromium
    from nbconvert import HTMLExporter

    require_chromium()
    page_html, _ = HTMLExporter().from_notebook_node(executed)
    (tmp_path / "nb.html").write_text(page_html)
    plotly_js = (Path(plotly.__file__).parent / "package_data" / "plotly.min.js").read_bytes()
    with chromium(tmp_path / "chromium") as browser:
        context = browser.new_context(viewport={"width": 1200, "height": 900})
        context.route("https://cdn.plot.ly/**", lambda route: route.fulfill(body=plotly_js, content_type="application/javascript"))
        offline = lambda url: url.startswith("http") and not url.startswith("https://cdn.plot.ly/")  # noqa: E731
        context.route(offline, lambda route: route.abort())  # mathjax, require.js: not needed, not reached
        tab = context.new_page()
        tab.set_default_timeout(300_000)  # a busy machine: Chromium parses plotly.js once per figure
        tab.goto((tmp_path / "nb.html").as_uri(), wait_until="domcontentloaded")
        tab.wait_for_function("[...document.querySelectorAll('.plotly-graph-div')].every(d => d.querySelector('.main-svg'))")
        drawn = tab.evaluate("[...document.querySelectorAll('.plotly-graph-div')].map(d => d.querySelector('.main-svg') !== null)")
        context.close()
    assert drawn == [True, True, True], drawn
