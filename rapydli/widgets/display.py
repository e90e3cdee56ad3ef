"""Showing things in a Jupyter kernel: live widgets, and figures that a saved notebook keeps.

The mechanics under the front door's live-display policy (:mod:`rapydli.notebook`) and
the widgets: whether this is a kernel, displaying a widget with a text fallback and
replacing it by a static figure when it is done, and making every plotly figure also
carry HTML beside plotly's JSON, so a saved notebook reads outside JupyterLab (nbconvert,
VS Code, other viewers) and stays small: the HTML loads plotly.js from plotly's CDN
(:data:`~rapydli.experiments.figures.STATIC_RENDERERS`), a live widget is closed once its
static figure replaces it, and headless runs save only the state of widgets still shown
(:func:`rapydli.experiments.batch.saved_widgets.shown_widget_state`).
"""

from __future__ import annotations

import threading
import time
from typing import Any


def in_kernel() -> bool:
    """True when running inside a Jupyter kernel (a notebook, also under papermill)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class _WidgetOutput:
    """Displays a widget with a one-line text fallback (a static notebook shows that, not the widget's state)."""

    def __init__(self, widget: Any, text: str) -> None:
        self.widget, self.text = widget, text

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        view = {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}
        return {"application/vnd.jupyter.widget-view+json": view, "text/plain": self.text}


def display_live(widget: Any, text: str = "(live plot: shown while the cell runs)") -> Any:
    """Display ``widget`` in the notebook and return the display handle (None outside a kernel)."""
    if not in_kernel():
        return None
    from IPython.display import display

    static_figures()
    return display(_WidgetOutput(widget, text), display_id=True)


def static_figures() -> None:
    """Make the plotly figures this kernel shows readable outside JupyterLab.

    Switches plotly's default renderer to
    :data:`~rapydli.experiments.figures.STATIC_RENDERERS` when it is plotly's own
    kernel default (``plotly_mimetype``); a renderer the user chose (or ``PLOTLY_RENDERER``)
    is kept. Then plotly's set-up (a few hundred bytes that load plotly.js from its CDN)
    goes into the running cell's output, once per kernel, now: before any live display,
    whose final figure (drawn later in an earlier output) needs it first. Nothing happens
    outside a kernel.
    """
    if not in_kernel():
        return
    import plotly.io as pio

    from rapydli.experiments.figures import STATIC_RENDERERS

    if pio.renderers.default == "plotly_mimetype":
        pio.renderers.default = STATIC_RENDERERS
    pio.renderers._activate_pending_renderers()  # what plotly does at the first show(); a no-op after


def figure_bundle(figure: Any) -> dict[str, Any]:
    """The MIME bundle a plotly figure (or its dict) leaves in a notebook's output.

    After :func:`static_figures`: plotly's JSON and HTML that draws the figure with
    plotly.js from its CDN (no copy of plotly.js in the notebook).
    """
    import plotly.graph_objects as go
    import plotly.io as pio

    static_figures()
    fig_dict = (figure if isinstance(figure, go.Figure) else go.Figure(figure)).to_dict()
    # what plotly.io.show builds (``Figure._repr_mimebundle_`` would activate the renderers
    # again, inlining plotly.js once more on every call)
    bundle: dict[str, Any] = pio.renderers._build_mime_bundle(fig_dict)
    return bundle or pio.renderers["plotly_mimetype"].to_mimebundle(fig_dict)


def replace_with_figure(handle: Any, figure: Any, widget: Any = None) -> None:
    """Replace a live display with a static plotly figure (kept in a saved notebook, e.g. by papermill).

    Plotly figures display themselves through ``_ipython_display_``, which ignores display
    ids, so the handle is updated with :func:`figure_bundle` instead. ``widget``, the live
    widget the display showed, is closed then: JupyterLab forgets its model, so a saved
    notebook does not carry its state (a ``FigureWidget``'s holds ~5 MB of JavaScript).
    """
    handle.update(figure_bundle(figure), raw=True)
    if widget is not None:
        widget.close()


class FigureSlot:
    """Where a panel shows its figure: a live ``FigureWidget`` while a run draws on it, then a
    static copy (:meth:`settle`), whose widget is closed.

    A panel outlives its runs, so its figure cannot be replaced in the cell's output as a
    live plot's is; the slot is an ``Output`` widget inside the panel whose content is
    swapped instead. A saved notebook then keeps a light static figure (plotly's JSON and
    HTML that loads plotly.js from its CDN), not the widget's ~5 MB of JavaScript.
    Create it in the cell that displays the panel (it sets up the static figures there).
    """

    def __init__(self) -> None:
        import ipywidgets as widgets

        static_figures()
        self.output = widgets.Output()
        self._live: Any = None

    @property
    def live(self) -> bool:
        """Whether a live ``FigureWidget`` is shown (else a static figure, or nothing yet)."""
        return self._live is not None

    def show_live(self, figure_widget: Any) -> None:
        """Show ``figure_widget`` (a ``FigureWidget`` a run draws on) in the slot."""
        self._close_live()
        self._live = figure_widget
        view = {"model_id": figure_widget.model_id, "version_major": 2, "version_minor": 0}
        self.output.outputs = ({"output_type": "display_data", "metadata": {},
                                "data": {"application/vnd.jupyter.widget-view+json": view, "text/plain": "(live plot)"}},)  # fmt: skip

    def settle(self) -> Any:
        """Show a static copy of the live figure and close its widget; the static ``go.Figure`` (None if none was live)."""
        import plotly.graph_objects as go

        if self._live is None:
            return None
        static = go.Figure(self._live)
        self.output.outputs = ({"output_type": "display_data", "metadata": {}, "data": figure_bundle(static)},)
        self._close_live()
        return static

    def _close_live(self) -> None:
        if self._live is not None:
            self._live.close()
            self._live = None


class LiveFigure:
    """A figure redrawn from metrics rows at a bounded rate, shown live in a notebook.

    Subclasses build ``self.figure`` (a ``FigureWidget`` when ``widget``) and implement
    :meth:`flush`, which draws what arrived and counts ``redraws``.
    """

    caption = "(live plot: shown while the cell runs)"

    def __init__(self, max_redraws_per_s: float, widget: bool | None) -> None:
        self.widget = in_kernel() if widget is None else widget
        self.figure: Any = None
        self.min_interval = 1.0 / max_redraws_per_s
        self.redraws = 0
        self._last_draw = 0.0
        self._handle: Any = None
        self._lock = threading.Lock()

    def flush(self) -> None:
        """Draw what arrived since the last redraw."""
        raise NotImplementedError

    def tick(self) -> None:
        """Redraw if the last redraw is at least ``1 / max_redraws_per_s`` old."""
        if time.monotonic() - self._last_draw >= self.min_interval:
            self.flush()

    def show(self) -> None:
        """Display the figure in the notebook (nothing outside a kernel)."""
        if self.widget:
            self._handle = display_live(self.figure, self.caption)

    def static(self) -> Any:
        """A plain ``go.Figure`` copy of the current figure."""
        import plotly.graph_objects as go

        return go.Figure(self.figure)

    def close(self) -> None:
        """Draw what is left; in a notebook, leave a static figure in the cell's output.

        The widget is closed then and ``figure`` becomes the static ``go.Figure``.
        """
        self.flush()
        if self._handle is not None:
            static = self.static()
            replace_with_figure(self._handle, static, widget=self.figure)
            self.figure, self._handle = static, None
