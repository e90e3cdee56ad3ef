"""Tables and figures of tuning results (plotly is imported only when a figure is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pandas as pd

from rapydli.autotune.device import DeviceInfo
from rapydli.autotune.runner import Measurement
from rapydli.autotune.search import Problem


def table(problem: Problem, measurements: Sequence[Measurement], device: DeviceInfo) -> pd.DataFrame:
    """One row per measured configuration: candidate, parameters, status, time (median, and the range
    ``low_ms`` to ``high_ms`` of its timed runs), GFLOP/s, % of peak, and
    how often it was timed again because other work disturbed the timing (``retimed``; ``disturbed``
    says how the timing kept still is, "" when it is not)."""
    flops = problem.shape.train_flops() if problem.mode == "train" else problem.shape.flops
    peak = device.peak_gflops
    rows: list[dict[str, Any]] = []
    for m in measurements:
        gflops = flops / m.median / 1e9 if m.ok and m.median else None
        rows.append(
            {
                "problem": problem.shape.key,
                "mode": problem.mode,
                "candidate": m.config.candidate,
                "config": str(m.config),
                **{f"p_{k}": v for k, v in m.config.params},
                "status": m.status,
                "median_ms": m.median * 1e3 if m.median is not None else None,
                "std_ms": (m.variance**0.5) * 1e3 if m.variance is not None else None,
                "low_ms": min(m.times) * 1e3 if m.ok and m.times else None,  # the range of its timed runs
                "high_ms": max(m.times) * 1e3 if m.ok and m.times else None,
                "gflops": gflops,
                "pct_peak": 100 * gflops / peak if gflops and peak else None,
                "rel_error": m.error,
                "cached": m.cached,
                "engine": m.engine,
                "retimed": m.retimed,
                "disturbed": m.disturbed,
            }
        )
    frame = pd.DataFrame(rows)
    return frame.sort_values("median_ms", na_position="last", kind="stable").reset_index(drop=True)


def time_vs_parameters(frame: pd.DataFrame, candidate: str = "c_direct") -> Any:
    """Plotly figure: time of every valid instance of ``candidate`` against each of its parameters."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = frame[(frame["candidate"] == candidate) & (frame["status"] == "ok")]
    params = [c for c in frame.columns if c.startswith("p_") and rows[c].notna().any()]
    fig = make_subplots(
        rows=1, cols=max(1, len(params)), shared_yaxes=True, subplot_titles=[p[2:] for p in params] or [candidate]
    )
    for i, p in enumerate(params, start=1):
        fig.add_trace(go.Box(x=rows[p].astype(str), y=rows["median_ms"], name=p[2:], boxpoints="all"), row=1, col=i)
    fig.update_layout(title=f"{candidate}: time against each parameter", yaxis_title="median ms", showlegend=False)
    return fig


def best_per_problem(frame: pd.DataFrame) -> pd.DataFrame:
    """The fastest valid row of each (problem, candidate)."""
    ok = frame[frame["status"] == "ok"]
    return ok.loc[ok.groupby(["problem", "candidate"])["median_ms"].idxmin()].reset_index(drop=True)


def best_figure(frame: pd.DataFrame, device: DeviceInfo | None = None) -> Any:
    """Plotly bar chart: GFLOP/s of the best instance of each candidate per problem (and % of peak).

    Each bar's error bar spans the GFLOP/s of its slowest and fastest timed run, so two
    candidates whose bars' ranges overlap are not told apart by the chart.
    """
    import plotly.express as px

    best = best_per_problem(frame).copy()
    if {"low_ms", "high_ms"} <= set(best.columns):  # GFLOP/s scale as 1 / time: the fastest run is the top of the range
        best["gflops_up"] = (best["gflops"] * best["median_ms"] / best["low_ms"] - best["gflops"]).fillna(0.0)
        best["gflops_down"] = (best["gflops"] - best["gflops"] * best["median_ms"] / best["high_ms"]).fillna(0.0)
    else:
        best["gflops_up"] = best["gflops_down"] = 0.0
    fig = px.bar(
        best,
        x="problem",
        y="gflops",
        color="candidate",
        barmode="group",
        error_y="gflops_up",
        error_y_minus="gflops_down",
        hover_data=["config", "median_ms", "pct_peak"],
        title="Best instance per problem (bars: range of the timed runs)",
    )
    if device is not None and device.peak_gflops:
        fig.add_hline(
            y=device.peak_gflops, line_dash="dot", annotation_text=f"estimated peak {device.peak_gflops:.0f} GFLOP/s"
        )
    fig.update_layout(yaxis_title="GFLOP/s")
    return fig
