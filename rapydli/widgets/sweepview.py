"""The live view of a sweep: a table of trials and a figure (metric per trial, parallel coordinates).

:class:`SweepView` is fed the sweep's table (one row per trial) whenever a trial starts,
reports or ends; redraws are rate-limited. In a notebook it shows a widget box; on
:meth:`SweepView.close` it leaves the static figure and table in the output (papermill).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from rapydli.widgets.live import display_live, in_kernel, replace_with_figure

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
_COLOURS = {"COMPLETE": "#2a9d8f", "PRUNED": "#e9c46a", "FAIL": "#e76f51", "RUNNING": "#8ecae6"}


def sweep_figure(table: pd.DataFrame, metric: str, params: list[str], widget: bool = False, title: str = "") -> Any:
    """Metric of every trial (coloured by state) and a parallel-coordinates plot of params -> metric."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    base = make_subplots(
        rows=1, cols=2, column_widths=[0.4, 0.6], specs=[[{"type": "xy"}, {"type": "domain"}]],
        subplot_titles=(f"{metric} per trial", "parameters -> " + metric),
    )  # fmt: skip
    for state in STATES:
        base.add_scatter(x=[], y=[], mode="markers", name=state.lower(), marker={"color": _COLOURS[state], "size": 10}, row=1, col=1)
    base.add_trace(go.Parcoords(dimensions=[]), row=1, col=2)
    base.update_layout(title=title, template="plotly_white", height=360, margin={"t": 70, "b": 40})
    base.update_xaxes(title_text="trial", row=1, col=1)
    base.update_yaxes(title_text=metric, row=1, col=1)
    figure = go.FigureWidget(base) if widget else base
    fill_figure(figure, table, metric, params)
    return figure


def fill_figure(figure: Any, table: pd.DataFrame, metric: str, params: list[str]) -> None:
    """Put ``table``'s trials into a figure made by :func:`sweep_figure`."""
    with figure.batch_update():
        for trace, state in zip(figure.data[: len(STATES)], STATES):
            rows = table[(table["state"] == state) & table["value"].notna()] if len(table) else table
            trace.x = tuple(rows["trial"]) if len(rows) else ()
            trace.y = tuple(rows["value"]) if len(rows) else ()
        figure.data[len(STATES)].dimensions = _dimensions(table, metric, params)


def _dimensions(table: pd.DataFrame, metric: str, params: list[str]) -> list[dict[str, Any]]:
    if not len(table):
        return []
    done = table[table["value"].notna()]
    if not len(done):
        return []
    dims = []
    for name in [*params, "value"]:
        column = done[name]
        if column.map(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)).all():
            dims.append({"label": name if name != "value" else metric, "values": [float(v) for v in column]})
        else:  # categorical: codes with the labels as ticks
            labels = sorted({str(v) for v in column})
            codes = {label: i for i, label in enumerate(labels)}
            dims.append({"label": name, "values": [codes[str(v)] for v in column], "tickvals": list(range(len(labels))), "ticktext": labels})
    return dims


class SweepView:
    """Table + figure of a running sweep, updated at most ``max_redraws_per_s`` times a second.

    Parameters
    ----------
    metric, params
        The metric the sweep optimises and the names of the swept parameters.
    widget
        Use ipywidgets and a ``FigureWidget`` (default: inside a Jupyter kernel).
    """

    def __init__(self, metric: str, params: list[str], widget: bool | None = None, max_redraws_per_s: float = 10.0) -> None:
        import pandas as pd

        self.metric, self.params = metric, list(params)
        self.widget = in_kernel() if widget is None else widget
        self.table = pd.DataFrame(columns=["trial", "state", *self.params, "value"])
        self.figure = sweep_figure(self.table, metric, self.params, widget=self.widget, title="sweep")
        self.min_interval = 1.0 / max_redraws_per_s
        self.redraws = 0
        self._last = 0.0
        self._pending = False
        self._lock = threading.Lock()
        self._handle: Any = None
        self.html: Any = None
        self.box: Any = None
        if self.widget:
            import ipywidgets as widgets

            self.html = widgets.HTML()
            self.box = widgets.VBox([self.figure, self.html])

    def update(self, table: pd.DataFrame, force: bool = False) -> None:
        """Take the latest table; redraw if the last redraw is old enough (or ``force``)."""
        with self._lock:
            self.table, self._pending = table, True
            if not force and time.monotonic() - self._last < self.min_interval:
                return
            fill_figure(self.figure, table, self.metric, self.params)
            if self.html is not None:
                self.html.value = table.to_html(index=False, float_format=lambda v: f"{v:.4g}")
            self.redraws += 1
            self._last, self._pending = time.monotonic(), False

    def show(self) -> None:
        """Display the view in the notebook (nothing outside a kernel)."""
        if self.box is not None:
            self._handle = display_live(self.box, "(live sweep view: shown while the sweep runs)")

    def close(self) -> None:
        """Final redraw; in a notebook, leave the static figure (and table) in the output."""
        self.update(self.table, force=True)
        if self._handle is not None:
            import plotly.graph_objects as go
            from IPython.display import HTML, display

            replace_with_figure(self._handle, go.Figure(self.figure))
            display(HTML(self.table.to_html(index=False)))
            self._handle = None
