"""The notebook front door's display policy, in a real kernel through plain papermill: what a saved notebook keeps."""

from __future__ import annotations

import nbformat
import papermill
import pytest

PLOTLY = "application/vnd.plotly.v1+json"
WIDGET = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

CELLS = [
    "import plotly.express as px\n"
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
    # the user's own chart, after import rapydli
    "px.line(x=[1, 2, 3], y=[2, 1, 3], title='a plotly.express chart')",
    # rd.train's progress bar
    "bar = progress_bar(total=40, desc='train', unit='step')\nfor _ in range(40):\n    bar.update(1)\nbar.close()",
]
FIGURES = 4  # the live plot's last state, the recorded figure, the cell's result, the user's chart


@pytest.fixture(scope="module")
def executed(tmp_path_factory: pytest.TempPathFactory) -> nbformat.NotebookNode:
    folder = tmp_path_factory.mktemp("front")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in CELLS])
    nbformat.write(nb, folder / "in.ipynb")
    papermill.execute_notebook(
        str(folder / "in.ipynb"),
        str(folder / "out.ipynb"),
        kernel_name="python3",
        language="python",
        cwd=str(folder),
        progress_bar=False,
    )  # plain papermill, as users run it
    nb = nbformat.read(folder / "out.ipynb", as_version=4)
    nb.metadata["size"] = (folder / "out.ipynb").stat().st_size
    return nb


def _outputs(nb: nbformat.NotebookNode) -> list[dict]:
    return [o for cell in nb.cells for o in cell.get("outputs", []) if "data" in o]


@pytest.mark.notebook
def test_saved_figures_carry_their_png_beside_plotlys_json(executed: nbformat.NotebookNode) -> None:
    import base64

    figures = [o for o in _outputs(executed) if PLOTLY in o["data"]]
    assert len(figures) == FIGURES
    for figure in figures:
        png = base64.b64decode(figure["data"]["image/png"])
        assert png.startswith(b"\x89PNG") and 2_000 < len(png) < 150_000, len(png)
        assert "text/html" not in figure["data"]  # nothing that needs plotly.js from a CDN
    # nbconvert's HTML (what a viewer without JupyterLab's renderers shows) has every figure's image
    from nbconvert import HTMLExporter

    page, _ = HTMLExporter().from_notebook_node(executed)
    assert page.count('src="data:image/png;base64,') == FIGURES


@pytest.mark.notebook
def test_a_live_plot_leaves_no_widget_state(executed: nbformat.NotebookNode) -> None:
    """A live plot is a plain figure redrawn in place, not a FigureWidget (whose state carries ~5 MB of plotly's
    JavaScript, which plain papermill saves even for a closed widget): the notebook keeps only the progress bar's."""
    states = executed.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    assert states, "the progress bar's state is saved"
    assert not [s for s in states.values() if "_esm" in s["state"]], [
        s.get("model_name") for s in states.values()
    ]  # anywidget's
    assert executed.metadata["size"] < 300_000, executed.metadata["size"]


@pytest.mark.notebook
def test_saved_progress_bar_shows_its_final_state(executed: nbformat.NotebookNode) -> None:
    bars = [o for o in _outputs(executed) if WIDGET in o["data"] and "train" in o["data"].get("text/plain", "")]
    assert len(bars) == 1
    text = bars[0]["data"]["text/plain"]
    assert "100%" in text and "40/40" in text, text


@pytest.mark.notebook
@pytest.mark.browser
def test_every_figure_is_visible_in_nbconvert_html_offline(executed: nbformat.NotebookNode) -> None:
    """nbconvert's HTML of the executed notebook, opened in Chromium with every request off the file refused:
    each figure shows (its image loaded and on the page)."""
    from lab_browser import require_chromium
    from offline_html import visible_figures

    require_chromium()
    assert visible_figures(executed) == (FIGURES, FIGURES)
