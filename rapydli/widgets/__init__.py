"""Notebook widgets: live training plots and pipeline timelines, the hyperparameter panel and the sweep panel.

``rd.widgets.HyperparameterPanel`` and ``rd.widgets.SweepPanel`` are imported lazily
(ipywidgets and plotly load on first use).
"""

from __future__ import annotations

from typing import Any

from rapydli.lazy import LazyExports

_LAZY = {
    "HyperparameterPanel": "rapydli.widgets.panel",
    "SweepPanel": "rapydli.widgets.sweeppanel",
    "LivePlot": "rapydli.widgets.live",
    "LiveTimeline": "rapydli.widgets.timeline",
    "SweepView": "rapydli.widgets.sweepview",
}
__all__ = sorted(_LAZY)


_exports = LazyExports(__name__, _LAZY, globals(), also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()
