"""Notebook widgets: live training plots and pipeline timelines, the hyperparameter panel and the sweep panel.

``rd.widgets.HyperparameterPanel`` and ``rd.widgets.SweepPanel`` are imported lazily
(ipywidgets and plotly load on first use).
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "HyperparameterPanel": "rapydli.widgets.panel",
    "SweepPanel": "rapydli.widgets.sweeppanel",
    "LivePlot": "rapydli.widgets.live",
    "LiveTimeline": "rapydli.widgets.timeline",
    "SweepView": "rapydli.widgets.sweepview",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rapydli.widgets' has no attribute {name!r}")
