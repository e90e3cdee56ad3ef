"""The widget state a saved notebook keeps: only that of the widgets its outputs still show.

Used by the papermill engine (:mod:`rapydli.experiments.batch.jupyter_kernels`) on every
notebook it saves; pure notebook-JSON work, so it sits with the batches and not with the
widgets that produce the state.
"""

from __future__ import annotations

from typing import Any

#: Where a widget's state names another widget (``"IPY_MODEL_<model id>"``).
_MODEL_REF = "IPY_MODEL_"


def shown_widget_state(nb: Any) -> None:
    """Keep in ``nb``'s saved widget state only the widgets its outputs still show.

    A headless run (nbclient, papermill) saves the state of every widget a kernel ever
    opened, also of those closed since (nbclient ignores ``comm_close``): a live plot
    replaced by its static figure would still carry its ~5 MB. What a viewer needs is the
    state of each widget an output displays and of the widgets those name
    (``IPY_MODEL_<id>``, e.g. the parts of a progress bar); the rest is dropped.
    """
    meta = nb.get("metadata", {}).get("widgets", {})
    saved = meta.get("application/vnd.jupyter.widget-state+json", {})
    states = saved.get("state")
    if not states:
        return
    wanted = [
        out["data"]["application/vnd.jupyter.widget-view+json"].get("model_id")
        for cell in nb.get("cells", [])
        for out in cell.get("outputs", [])
        if "application/vnd.jupyter.widget-view+json" in out.get("data", {})
    ]
    keep: set[str] = set()
    while wanted:
        model_id = wanted.pop()
        if model_id in keep or model_id not in states:
            continue
        keep.add(model_id)
        wanted.extend(_refs(states[model_id]))
    saved["state"] = {k: v for k, v in states.items() if k in keep}


def _refs(value: Any) -> list[str]:
    """The model ids ``value`` (a widget's state, nested) names."""
    if isinstance(value, str):
        return [value[len(_MODEL_REF) :]] if value.startswith(_MODEL_REF) else []
    if isinstance(value, dict):
        return [ref for item in value.values() for ref in _refs(item)]
    if isinstance(value, list):
        return [ref for item in value for ref in _refs(item)]
    return []
