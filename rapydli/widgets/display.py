"""Showing things in a Jupyter kernel: figures that travel with the notebook, drawn live while a run goes.

The mechanics under the front door's live-display policy (:mod:`rapydli.notebook`) and
the widgets. Every plotly figure a notebook kernel shows carries two outputs side by side
(:data:`~rapydli.experiments.figures.STATIC_RENDERERS`): plotly's JSON, which JupyterLab
and VS Code draw interactively, and a PNG of the same figure
(:func:`~rapydli.experiments.figure_image.figure_png`, some tens of KB), which nbconvert's
HTML (also offline), GitHub, nbviewer and a PDF show. No copy of plotly.js goes into a
notebook, and no live figure is a ``FigureWidget``: a widget's saved state carries ~5 MB of
JavaScript, and plain ``papermill``/``nbconvert --execute`` keep the state of every widget,
closed or not. A live figure is a plain ``go.Figure`` redrawn in place instead
(:class:`CellDisplay` in the cell's output, :class:`FigureSlot` inside a panel): plotly's
JSON while it changes, the JSON and the PNG once it is settled.
"""

from __future__ import annotations

import base64
import sys
import threading
import time
from typing import Any, Protocol

#: The plotly renderer :func:`static_figures` adds: a PNG of the figure beside plotly's JSON.
PNG_RENDERER = "rapydli_png"


def in_kernel() -> bool:
    """True when running inside a Jupyter kernel (a notebook, also under papermill)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


def in_notebook_kernel() -> bool:
    """True in a notebook's kernel: a Jupyter kernel that is not an ipyparallel engine.

    Cheap where IPython was never imported (a script, an MPI rank): it is not imported here.
    """
    if "IPython" not in sys.modules or not in_kernel():
        return False
    from IPython import get_ipython

    return not type(get_ipython().kernel).__module__.startswith("ipyparallel")


class _WidgetOutput:
    """Displays a widget with a one-line text fallback (a static notebook shows that, not the widget's state)."""

    def __init__(self, widget: Any, text: str) -> None:
        self.widget, self.text = widget, text

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        view = {"version_major": 2, "version_minor": 0, "model_id": self.widget.model_id}
        return {"application/vnd.jupyter.widget-view+json": view, "text/plain": self.text}


def display_live(widget: Any, text: str = "(live view: shown while the cell runs)") -> Any:
    """Display ``widget`` (an ipywidget) in the notebook and return the display handle (None outside a kernel)."""
    if not in_kernel():
        return None
    from IPython.display import display

    static_figures()
    return display(_WidgetOutput(widget, text), display_id=True)


def static_figures() -> None:
    """Make every plotly figure this kernel shows carry its PNG beside plotly's JSON.

    Adds plotly's renderer :data:`PNG_RENDERER` and makes
    :data:`~rapydli.experiments.figures.STATIC_RENDERERS` the default when the default is
    plotly's own kernel default (``plotly_mimetype``); a renderer the user chose (or
    ``PLOTLY_RENDERER``) is kept. ``import rapydli`` calls it in a notebook's kernel, so the
    user's own ``plotly.express`` charts travel too. Nothing happens outside a kernel.
    """
    if not in_kernel():
        return
    import plotly.io as pio

    from rapydli.experiments.figures import STATIC_RENDERERS

    if PNG_RENDERER not in pio.renderers:
        pio.renderers[PNG_RENDERER] = _png_renderer()
    if pio.renderers.default == "plotly_mimetype":
        pio.renderers.default = STATIC_RENDERERS


def _png_renderer() -> Any:
    """A plotly mimetype renderer giving the figure's PNG (:func:`~rapydli.experiments.figure_image.figure_png`) and a text line."""
    from plotly.io._base_renderers import MimetypeRenderer

    class PngRenderer(MimetypeRenderer):
        def to_mimebundle(self, fig_dict: Any) -> dict[str, Any]:
            return image_bundle(fig_dict)

    return PngRenderer()


def image_bundle(figure: Any) -> dict[str, Any]:
    """The figure's PNG (base64, as a notebook stores it) and a one-line text fallback naming it.

    A figure the PNG cannot be drawn for keeps its interactive figure and says so in the
    text (a warning names the error); showing it never fails the user's cell.
    """
    import warnings

    from rapydli.experiments.figure_image import figure_png, plain

    spec = figure if isinstance(figure, dict) else figure.to_dict()
    title = (spec.get("layout") or {}).get("title") or {}
    text = f"<figure: {plain(title.get('text', '') if isinstance(title, dict) else title) or 'plotly'}>"
    try:
        png = figure_png(spec)
    except Exception as exc:  # noqa: BLE001 - the interactive figure still shows
        warnings.warn(
            f"RaPyDLI could not draw this figure's PNG ({type(exc).__name__}: {exc}); it shows in JupyterLab and VS Code only",
            stacklevel=2,
        )
        return {"text/plain": f"{text} (no static image: it shows in JupyterLab and VS Code)"}
    return {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": text}


def figure_bundle(figure: Any, image: bool = True) -> dict[str, Any]:
    """The MIME bundle a plotly figure (or its dict) leaves in a notebook's output.

    plotly's JSON, and with ``image`` its PNG (:func:`image_bundle`); a live figure
    redrawn many times a second leaves the PNG out until it is settled.
    """
    import plotly.graph_objects as go
    import plotly.io as pio

    fig_dict = (figure if isinstance(figure, go.Figure) else go.Figure(figure)).to_dict()
    bundle: dict[str, Any] = pio.renderers["plotly_mimetype"].to_mimebundle(dict(fig_dict))
    if image:
        bundle.update(image_bundle(fig_dict))
    else:
        bundle["text/plain"] = "(live figure: drawn while the cell runs)"
    return bundle


def replace_with_figure(handle: Any, figure: Any, widget: Any = None) -> None:
    """Replace a live display with a figure that travels (plotly's JSON and its PNG).

    Plotly figures display themselves through ``_ipython_display_``, which ignores display
    ids, so the handle is updated with :func:`figure_bundle` instead. ``widget``, the
    ipywidget the display showed, is closed then, with the widgets inside it.
    """
    handle.update(figure_bundle(figure), raw=True)
    if widget is not None:
        _close_tree(widget)


def _close_tree(widget: Any) -> None:
    for child in getattr(widget, "children", ()):
        _close_tree(child)
    widget.close()


class FigureTarget(Protocol):
    """Where a live figure is shown: redrawn while it changes, settled once it is final."""

    def redraw(self, figure: Any) -> None:
        """Show ``figure`` as it is now (plotly's JSON only)."""

    def settle(self, figure: Any) -> None:
        """Show ``figure`` for good (plotly's JSON and its PNG)."""


class CellDisplay:
    """A figure in the running cell's output, updated in place by its display id."""

    def __init__(self, figure: Any) -> None:
        from IPython.display import display

        static_figures()
        self.handle = display(figure_bundle(figure, image=False), raw=True, display_id=True)

    def redraw(self, figure: Any) -> None:
        """Show ``figure`` as it is now (plotly's JSON only)."""
        self.handle.update(figure_bundle(figure, image=False), raw=True)

    def settle(self, figure: Any) -> None:
        """Show ``figure`` for good (plotly's JSON and its PNG)."""
        self.handle.update(figure_bundle(figure), raw=True)


class FigureSlot:
    """Where a panel shows its figure: an ``Output`` widget inside the panel whose content is swapped.

    A panel outlives its runs and is redrawn from a background thread, so its figure cannot
    live in the cell's output as a live plot's does; the ``Output`` widget's content is
    replaced instead (a widget state update, which any thread may send). While a run draws
    it holds plotly's JSON, once settled the JSON and the PNG: a saved notebook keeps one
    light figure, not a widget's ~5 MB of JavaScript. Create it in the cell that displays
    the panel.
    """

    def __init__(self) -> None:
        import ipywidgets as widgets

        static_figures()
        self.output = widgets.Output()
        self.live = False  # whether a figure is being drawn (shown, not yet settled)

    def redraw(self, figure: Any) -> None:
        """Show ``figure`` as it is now (plotly's JSON only)."""
        self._show(figure_bundle(figure, image=False))
        self.live = True

    def settle(self, figure: Any) -> None:
        """Show ``figure`` for good (plotly's JSON and its PNG)."""
        self._show(figure_bundle(figure))
        self.live = False

    def _show(self, bundle: dict[str, Any]) -> None:
        self.output.outputs = ({"output_type": "display_data", "metadata": {}, "data": bundle},)


class LiveFigure:
    """A plotly figure redrawn from metrics rows at a bounded rate, shown live in a notebook.

    Subclasses build ``self.figure`` (a plain ``go.Figure``) and implement :meth:`flush`,
    which draws what arrived and then calls :meth:`drawn`. ``target`` is where the figure
    shows: nowhere (``None``: outside a kernel, or before :meth:`show`), the cell's output
    (:meth:`show`), or a panel's :class:`FigureSlot` the panel sets.
    """

    caption = "(live plot: shown while the cell runs)"

    def __init__(self, max_redraws_per_s: float, live: bool | None) -> None:
        self.live = in_kernel() if live is None else live
        self.figure: Any = None
        self.min_interval = 1.0 / max_redraws_per_s
        self.redraws = 0
        self.target: FigureTarget | None = None
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def flush(self) -> None:
        """Draw what arrived since the last redraw."""
        raise NotImplementedError

    def drawn(self) -> None:
        """Count a redraw and show it (a subclass's :meth:`flush` calls this after changing the figure)."""
        self.redraws += 1
        self._last_draw = time.monotonic()
        if self.target is not None:
            self.target.redraw(self.figure)

    def tick(self) -> None:
        """Redraw if the last redraw is at least ``1 / max_redraws_per_s`` old."""
        if time.monotonic() - self._last_draw >= self.min_interval:
            self.flush()

    def show(self) -> None:
        """Display the figure in the running cell's output (nothing outside a kernel, or when not ``live``)."""
        if self.live and in_kernel():
            self.target = CellDisplay(self.figure)

    def static(self) -> Any:
        """A plain ``go.Figure`` copy of the current figure."""
        import plotly.graph_objects as go

        return go.Figure(self.figure)

    def close(self) -> None:
        """Draw what is left and settle the figure where it shows (plotly's JSON and its PNG)."""
        self.flush()
        if self.target is not None:
            self.target.settle(self.figure)
            self.target = None
