"""The live view of a sweep: a table of trials and a figure (metric per trial, parallel coordinates).

:class:`SweepView` is fed the sweep's table (one row per trial) whenever a trial starts,
reports or ends; redraws are rate-limited. In a notebook it shows a widget box; on
:meth:`SweepView.close` it leaves the static figure and table in the output (papermill).
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING, Any

from rapydli.experiments.figures import fill_sweep_figure, sweep_figure
from rapydli.widgets.display import FigureSlot, display_live, in_kernel, replace_with_figure

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd


class SweepView:
    """Table + figure of a running sweep, updated at most ``max_redraws_per_s`` times a second.

    Parameters
    ----------
    metric, params
        The metric the sweep optimises and the names of the swept parameters.
    live
        Show it in the notebook with ipywidgets (default: inside a Jupyter kernel): a
        :class:`~rapydli.widgets.display.FigureSlot` redrawn in place and an HTML table.
    """

    def __init__(
        self, metric: str, params: list[str], live: bool | None = None, max_redraws_per_s: float = 4.0
    ) -> None:
        import pandas as pd

        self.metric, self.params = metric, list(params)
        self.live = in_kernel() if live is None else live
        self.table = pd.DataFrame(columns=["trial", "state", *self.params, "value"])
        self.figure = sweep_figure(self.table, metric, self.params, title="sweep")
        self.min_interval = 1.0 / max_redraws_per_s
        self.redraws = 0
        self._last = 0.0
        self._pending = False
        self._lock = threading.Lock()
        self._handle: Any = None
        self.html: Any = None
        self.box: Any = None
        self.slot: FigureSlot | None = None
        if self.live:
            import ipywidgets as widgets

            self.html = widgets.HTML()
            self.slot = FigureSlot()  # redrawn while the sweep runs, settled (with its PNG) after
            self.slot.redraw(self.figure)
            self.box = widgets.VBox([self.slot.output, self.html])

    def live_again(self) -> None:
        """Draw the next sweep on a fresh figure (after :meth:`close` settled the last one)."""
        if self.slot is not None and not self.slot.live:
            self.figure = sweep_figure(self.table.iloc[0:0], self.metric, self.params, title="sweep")
            self.slot.redraw(self.figure)

    def update(self, table: pd.DataFrame, force: bool = False) -> None:
        """Take the latest table; redraw if the last redraw is old enough (or ``force``)."""
        with self._lock:
            self.table, self._pending = table, True
            if not force and time.monotonic() - self._last < self.min_interval:
                return
            fill_sweep_figure(self.figure, table, self.metric, self.params)
            if self.slot is not None:
                self.slot.redraw(self.figure)
            if self.html is not None:
                self.html.value = table.to_html(index=False, float_format=lambda v: f"{v:.4g}")
            self.redraws += 1
            self._last, self._pending = time.monotonic(), False

    def show(self) -> None:
        """Display the view in the notebook (nothing outside a kernel)."""
        if self.box is not None:
            self._handle = display_live(self.box, "(live sweep view: shown while the sweep runs)")

    def close(self) -> None:
        """Final redraw; settle the figure (its PNG too), and in the cell's output leave the figure and the table."""
        self.update(self.table, force=True)
        if self.slot is not None:
            self.slot.settle(self.figure)
        if self._handle is not None:
            from IPython.display import HTML, display

            replace_with_figure(self._handle, self.figure, widget=self.box)
            display(HTML(self.table.to_html(index=False)))
            self._handle = None
