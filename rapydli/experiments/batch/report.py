"""A batch's summary table and its HTML report (the table, and each figure as a PNG and an interactive plotly figure)."""

from __future__ import annotations

import html
import numbers
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.experiments.batch.item import cell_words
from rapydli.experiments.store.record import read_records

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.experiments.batch.batch import BatchPlan

FIXED_COLUMNS = ["status", "duration", "attempts", "resumed", "error", "failing_cell", "output", "run_id"]


def summary_table(plan: BatchPlan) -> pd.DataFrame:
    """One row per item: item, parameters, status, duration, ..., then every recorded scalar."""
    import pandas as pd

    params = sorted({k for item in plan.items for k in item.parameters})
    rows, scalars = [], []
    for item in plan.items:
        outcome = item.outcome
        cell = outcome.get("failing_cell")
        row: dict[str, Any] = {"item": item.key, **{k: item.parameters.get(k) for k in params}}
        row.update(
            status=outcome.get("status", "failed"),
            duration=outcome.get("duration"),
            attempts=outcome.get("attempts", 0),
            resumed=bool(outcome.get("resumed")),
            error=(outcome.get("error") or "").splitlines()[0] if outcome.get("error") else None,
            failing_cell=cell_words(cell) if isinstance(cell, dict) else None,
            output=str(item.output) if item.output.exists() else None,
            run_id=outcome.get("run_id"),
        )
        records: dict[str, Any] = {}
        if item.output.exists():
            try:
                records = read_records(item.output, decoded=False)
            except ConfigError:  # an item killed while papermill wrote its notebook left it partial
                if row["status"] == "finished":
                    raise
        for name, rec in records.items():
            value = rec["value"]
            if rec["type"] == "scalar" and name not in row:
                row[name] = value
                if name not in scalars:
                    scalars.append(name)
        rows.append(row)
    table = pd.DataFrame(rows, columns=["item", *params, *FIXED_COLUMNS, *scalars])
    table["attempts"] = table["attempts"].astype("Int64")
    return table


def _metric_columns(summary: pd.DataFrame, plan: BatchPlan) -> list[str]:
    fixed = {"item", *FIXED_COLUMNS, *{k for item in plan.items for k in item.parameters}}
    out = []
    for column in summary.columns:
        if column in fixed:
            continue
        values = summary[column].dropna()
        if len(values) and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            out.append(column)
    return out


def figures(summary: pd.DataFrame, plan: BatchPlan) -> list[Any]:
    """Each recorded metric (and duration) against each varied parameter; speedup when ``workers`` varies."""
    import plotly.graph_objects as go

    done = summary[summary["status"] == "finished"]
    if done.empty:  # every item failed: the report is the table alone
        return []
    metrics = [*_metric_columns(summary, plan), "duration"]
    figs = []
    for param in plan.varied:
        others = [p for p in plan.varied if p != param]
        for metric in metrics:
            fig = go.Figure()
            for label, group in _groups(done, others):
                group = group.sort_values(param, key=_sort_key)
                fig.add_trace(
                    go.Scatter(
                        x=[str(v) if not _numeric(v) else v for v in group[param]],
                        y=group[metric],
                        mode="lines+markers",
                        name=label or metric,
                    )
                )
            fig.update_layout(title=f"{metric} vs {param}", xaxis_title=param, yaxis_title=metric, height=380)
            fig.update_xaxes(**axis_style(list(done[param])))
            figs.append(fig)
    if "workers" in plan.varied:
        figs.extend(_speedup_figures(done, plan, metrics))
    return figs


def _speedup_figures(done: pd.DataFrame, plan: BatchPlan, metrics: list[str]) -> list[Any]:
    import plotly.graph_objects as go

    others = [p for p in plan.varied if p != "workers"]
    # time-like columns speed up when they shrink; throughput-like ones when they grow
    targets = [("duration", True)] + [(m, False) for m in metrics if "throughput" in m or m.endswith("per_s")]
    figs = []
    for metric, inverse in targets:
        fig = go.Figure()
        for label, group in _groups(done, others):
            group = group[group["workers"].map(_numeric)].sort_values("workers")
            if len(group) < 2:
                continue
            base = group.iloc[0]
            base_value = base[metric]
            if not base_value:
                continue
            ratio = (base_value / group[metric]) if inverse else (group[metric] / base_value)
            fig.add_trace(
                go.Scatter(
                    x=list(group["workers"]), y=list(ratio), mode="lines+markers", name=label or f"speedup ({metric})"
                )
            )
        if not fig.data:
            continue
        ideal = sorted(set(done["workers"][done["workers"].map(_numeric)]))
        low = min(ideal)
        fig.add_trace(
            go.Scatter(
                x=ideal, y=[w / low for w in ideal], mode="lines", name="ideal", line={"dash": "dash", "color": "gray"}
            )
        )
        fig.update_layout(
            title=f"speedup from {metric} vs workers", xaxis_title="workers", yaxis_title="speedup", height=380
        )
        fig.update_xaxes(**axis_style(ideal))
        figs.append(fig)
    return figs


def axis_style(values: list[Any]) -> dict[str, Any]:
    """Plotly x-axis settings for a parameter's values.

    Log scale for a log-spaced grid: positive values spanning at least a factor of 10,
    two of them (``lr=0.1,0.01``) or with uneven linear steps (``1e-3,1e-2,1e-1``,
    ``workers=1,2,4,8,16``). Ticks at exactly the values when they are all integers (worker
    counts: no ``1.5`` tick). Categorical (non-numeric) values keep plotly's defaults.
    """
    if not values or not all(_numeric(v) for v in values):
        return {}
    numbers_ = sorted({float(v) for v in values})
    style: dict[str, Any] = {}
    steps = [b - a for a, b in zip(numbers_, numbers_[1:])]
    if numbers_[0] > 0 and numbers_[-1] / numbers_[0] >= 10 and (len(steps) == 1 or max(steps) > 2 * min(steps)):
        style["type"] = "log"
    if all(v.is_integer() for v in numbers_):
        style.update(tickmode="array", tickvals=[int(v) for v in numbers_], ticktext=[str(int(v)) for v in numbers_])
    return style


def _groups(frame: pd.DataFrame, keys: list[str]) -> list[tuple[str, pd.DataFrame]]:
    if not keys or frame.empty:
        return [("", frame)]
    out = []
    for values, group in frame.groupby([frame[k].astype(str) for k in keys], sort=True):
        values = values if isinstance(values, tuple) else (values,)
        out.append((", ".join(f"{k}={v}" for k, v in zip(keys, values)), group))
    return out


def _numeric(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _sort_key(series: pd.Series) -> pd.Series:
    return series.map(lambda v: (0, v, "") if _numeric(v) else (1, 0, str(v)))


#: plotly.js beside the report, shared by its interactive figures (4.9 MB, once per batch folder, not in the page).
PLOTLY_JS = "plotly.min.js"


def write_report(plan: BatchPlan, summary: pd.DataFrame, path: Path) -> Path:
    """Write an HTML page with the table and the figures, readable offline: some tens of KB a figure.

    Each figure is its PNG (:func:`~rapydli.experiments.figure_image.figure_png`), shown
    wherever the page goes, and an interactive plotly figure drawn with :data:`PLOTLY_JS`
    from the page's folder, which replaces the PNG when that file is there (the page sent
    alone still shows every figure).
    """
    import base64
    import shutil

    import plotly

    from rapydli.experiments.figure_image import figure_png

    figs = figures(summary, plan)
    parts = []
    for fig in figs:
        png = base64.b64encode(figure_png(fig)).decode("ascii")
        title = html.escape(str(fig.layout.title.text or "figure"))
        parts.append(f'<img class="static-figure" alt="{title}" src="data:image/png;base64,{png}">')
        parts.append(fig.to_html(full_html=False, include_plotlyjs=False, default_width="100%"))
    if figs:
        shutil.copyfile(Path(plotly.__file__).parent / "package_data" / "plotly.min.js", path.parent / PLOTLY_JS)
    swap = (
        f'<script src="{PLOTLY_JS}"></script><script>if (window.Plotly) '
        "document.querySelectorAll('img.static-figure').forEach(i => i.remove());"
        "else document.querySelectorAll('.plotly-graph-div').forEach(d => d.remove());</script>"
    )
    failed = int((summary["status"] != "finished").sum())
    table = summary.drop(columns=["output"]).to_html(index=False, na_rep="", border=0, classes="summary")
    page = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>Batch report: {html.escape(plan.notebook.name)}</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table.summary {{ border-collapse: collapse; font-size: 0.9em; }}
table.summary td, table.summary th {{ border: 1px solid #ccc; padding: 3px 8px; text-align: right; }}
</style></head><body>
<h1>Batch report: {html.escape(plan.notebook.name)}</h1>
<p>{len(summary)} items, {failed} failed. Notebook hash {plan.notebook_hash}.
Varied: {html.escape(", ".join(plan.varied) or "nothing")}.</p>
{table}
<h2>Figures</h2>
{"".join(parts) if parts else "<p>No parameter varies, so there is nothing to plot.</p>"}
{swap if parts else ""}
</body></html>
"""
    path.write_text(page)
    return path
