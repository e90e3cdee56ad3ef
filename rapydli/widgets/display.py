"""Showing things in a Jupyter kernel: live widgets, and figures that a saved notebook keeps.

The mechanics under the front door's live-display policy (:mod:`rapydli.notebook`) and
the widgets: whether this is a kernel, displaying a widget with a text fallback and
replacing it by a static figure when it is done, and making every plotly figure also
carry self-contained HTML, so a saved notebook reads outside JupyterLab (nbconvert,
other viewers).
"""

from __future__ import annotations

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
    is kept. Then plotly.js goes into the running cell's output, once per kernel, now:
    before any live display, whose final figure (drawn later in an earlier output) needs
    it loaded first. Nothing happens outside a kernel.
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

    After :func:`static_figures`: plotly's JSON and self-contained HTML (the first figure
    of the kernel also puts plotly.js into the running cell's output).
    """
    import plotly.graph_objects as go
    import plotly.io as pio

    static_figures()
    fig_dict = (figure if isinstance(figure, go.Figure) else go.Figure(figure)).to_dict()
    # what plotly.io.show builds (``Figure._repr_mimebundle_`` would activate the renderers
    # again, inlining plotly.js once more on every call)
    bundle: dict[str, Any] = pio.renderers._build_mime_bundle(fig_dict)
    return bundle or pio.renderers["plotly_mimetype"].to_mimebundle(fig_dict)


def replace_with_figure(handle: Any, figure: Any) -> None:
    """Replace a live display with a static plotly figure (kept in a saved notebook, e.g. by papermill).

    Plotly figures display themselves through ``_ipython_display_``, which ignores display
    ids, so the handle is updated with :func:`figure_bundle` instead.
    """
    handle.update(figure_bundle(figure), raw=True)
