"""Figure builders: plain plotly figures from histories and tables, headless, no display.

Every figure RaPyDLI draws is built here: the experiments return them
(``RunResult.figure``, ``ScalingResult.figure``, ``SweepResult.figure``), and the live
views of the front end (:mod:`rapydli.widgets`) refill the same figures while a run goes
on and redraw them in place (the ``fill_*`` functions).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import pandas as pd

    from rapydli.experiments.planning.perfmodel import RingModel

#: plotly's renderers for figures left in a notebook: its MIME type (JupyterLab and VS Code
#: draw it, interactive) plus the figure's PNG (:data:`rapydli.widgets.display.PNG_RENDERER`),
#: which nbconvert's HTML (offline too), GitHub and nbviewer show; no plotly.js in the notebook.
STATIC_RENDERERS = "plotly_mimetype+rapydli_png"


#: The live training figure's traces: (trace name, row kind, x key, y key, subplot column).
#: Steps whose throughput the live plot's band summarises (the lower and upper quartile of the last this many).
THROUGHPUT_WINDOW = 10

TRAINING_TRACES = (
    ("train loss", "train", "step", "loss", 1),
    ("val loss", "eval", "step", "val_loss", 1),
    ("samples/s", "train", "step", "samples_per_s", 2),
    # the middle half of the last THROUGHPUT_WINDOW steps' throughput: a band from the lower to the upper quartile
    ("samples/s lower quartile", "train", "step", "samples_per_s_q1", 2),
    (f"samples/s, middle half of the last {THROUGHPUT_WINDOW} steps", "train", "step", "samples_per_s_q3", 2),
    ("step time (s)", "train", "step", "step_time_s", 3),
    ("comm time (s)", "train", "step", "comm_time_s", 3),
    ("comm wait (s)", "train", "step", "comm_wait_s", 3),
)


def training_figure(title: str = "") -> Any:
    """An empty three-panel figure of a training run (loss, throughput, step/comm time), one trace per :data:`TRAINING_TRACES` entry.

    The throughput panel has a band around the line: the lower and upper quartile of the
    last :data:`THROUGHPUT_WINDOW` steps' throughput, so a step that stands out and the
    spread of the steady state are told apart.
    """
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=1, cols=3, subplot_titles=("loss", "throughput (samples/s)", "time per step (s)"))
    band: dict[str, dict[str, Any]] = {
        "samples_per_s_q1": {"line": {"width": 0}, "showlegend": False, "hoverinfo": "skip"},
        "samples_per_s_q3": {"line": {"width": 0}, "fill": "tonexty", "fillcolor": "rgba(255, 127, 14, 0.2)"},
    }
    for name, kind, _, ykey, col in TRAINING_TRACES:
        mode = "lines+markers" if kind == "eval" else "lines"
        figure.add_scatter(x=[], y=[], mode=mode, name=name, row=1, col=col, **band.get(ykey, {}))
    figure.update_layout(title=title, template="plotly_white", height=320, margin={"t": 60, "b": 40})
    figure.update_xaxes(title_text="step")
    return figure


def restart_text(restart: Mapping[str, Any]) -> str:
    """A restart in words: what died, the step it resumed from, the ranks it went on with and how long that took.

    >>> restart_text({"cause": "rank 1 died", "resumed_from_step": 4, "workers": 1, "recovery_s": 6.2})
    'rank 1 died; resumed from step 4 on 1 rank 6.2 s later'
    """
    if restart.get("error"):
        return f"{restart.get('cause', '')}; could not restart: {restart['error']}"
    workers = restart.get("workers")
    on = f" on {workers} rank{'s' if workers != 1 else ''}" if workers is not None else ""
    took = f" {restart['recovery_s']:g} s later" if restart.get("recovery_s") is not None else ""
    return f"{restart.get('cause', '')}; resumed from step {restart.get('resumed_from_step') or 0}{on}{took}"


def loss_figure(history: pd.DataFrame, title: str = "", restarts: Sequence[Mapping[str, Any]] = ()) -> Any:
    """A plotly figure: training loss per step and validation loss per evaluation.

    ``history`` is the run's across its attempts (a restarted run's steps before the restart
    too). Each of ``restarts`` (the run's ``restarts`` record: ``resumed_from_step``, ``cause``)
    is marked by a dashed vertical line at the step it resumed from, labelled "restart".
    """
    import plotly.graph_objects as go

    figure = go.Figure()
    if "kind" in history:
        steps = history[history["kind"] == "train"]
        evals = history[history["kind"] == "eval"]
        if len(steps):
            figure.add_scatter(x=steps["step"], y=steps["loss"], mode="lines", name="train loss")
        if len(evals):
            figure.add_scatter(x=evals["step"], y=evals["val_loss"], mode="lines+markers", name="val loss")
    for restart in restarts:
        step = restart.get("resumed_from_step") or 0
        figure.add_vline(
            x=step,
            line_dash="dash",
            line_color="#d62728",
            annotation_text="restart",
            annotation_hovertext=restart_text(restart),
        )
    figure.update_layout(title=title, xaxis_title="step", yaxis_title="cross-entropy", template="plotly_white")
    return figure


#: Colours of the measured lines of a scaling study, one per pipeline stage count.
_MEASURED = ("#1f77b4", "#2ca02c", "#9467bd", "#8c564b", "#e377c2")


def scaling_figure(
    points: list[dict[str, Any]],
    prediction: pd.DataFrame | None,
    mode: str = "weak",
    model: RingModel | None = None,
    stages: Sequence[int] = (1,),
    validated: bool | None = None,
) -> Any:
    """Speedup and efficiency against workers: measured, ideal (dotted) and predicted (dashed).

    With several ``stages`` (pipeline stage counts a study varies) there is one measured
    line per count, named ``"measured, p=<stages>"``; with one, it is ``"measured"``. With
    a prediction past the measured counts the title says it is an extrapolation, and
    whether the model held where it was checked (``validated``).
    """
    from plotly.subplots import make_subplots

    base = make_subplots(rows=1, cols=2, subplot_titles=(f"speedup ({mode} scaling)", "efficiency"))
    traces = [
        (
            f"measured, p={s}" if len(stages) > 1 else "measured",
            {"role": "measured", "stages": s},
            "lines+markers",
            {"color": _MEASURED[i % len(_MEASURED)]},
        )
        for i, s in enumerate(stages)
    ]
    traces += [
        ("ideal", {"role": "ideal"}, "lines", {"color": "grey", "dash": "dot"}),
        ("predicted", {"role": "predicted"}, "lines+markers", {"color": "#d62728", "dash": "dash"}),
    ]
    for col in (1, 2):
        for name, meta, mode_, line in traces:
            base.add_scatter(
                x=[],
                y=[],
                mode=mode_,
                name=name,
                legendgroup=name,
                showlegend=col == 1,
                row=1,
                col=col,
                line=line,
                meta={**meta, "column": "speedup" if col == 1 else "efficiency"},
            )
    base.update_xaxes(title_text="workers")
    base.update_yaxes(title_text="speedup", row=1, col=1)
    base.update_yaxes(title_text="efficiency", row=1, col=2)
    base.update_layout(template="plotly_white", height=360, title="scaling study")
    figure = base
    import pandas as pd

    fill_scaling_figure(figure, pd.DataFrame(points), prediction, model)
    measured = {p["workers"] for p in points}
    if prediction is not None and set(prediction["workers"]) - measured:
        held = (
            "the model was not checked"
            if validated is None
            else "the model held within 20% at every measured count"
            if validated
            else "the model was NOT validated on this machine (see the notes)"
        )
        figure.update_layout(
            title=f"scaling study: beyond {max(measured)} workers the dashed line is an extrapolation; {held}"
        )
    return figure


def fill_scaling_figure(
    figure: Any, table: pd.DataFrame, prediction: pd.DataFrame | None, model: RingModel | None = None
) -> None:
    """Put measured points, the ideal line and the prediction into :func:`scaling_figure`'s figure.

    ``table`` rows without a ``pipeline_stages`` column count as one stage.
    """
    if not len(table):
        return
    counts = sorted(set(table["workers"]))
    if prediction is not None:
        counts = sorted(set(counts) | set(prediction["workers"]))
    k0 = table["workers"].iloc[0]
    stages = list(table["pipeline_stages"]) if "pipeline_stages" in table else [1] * len(table)
    with figure.batch_update():
        for trace in figure.data:
            role, column = trace.meta["role"], trace.meta["column"]
            if role == "measured":
                rows = table[[s == trace.meta["stages"] for s in stages]]
                trace.x, trace.y = tuple(rows["workers"]), tuple(rows[column])
            elif role == "ideal":
                trace.x, trace.y = tuple(counts), tuple(k / k0 if column == "speedup" else 1.0 for k in counts)
            elif prediction is not None:
                trace.x, trace.y = tuple(prediction["workers"]), tuple(prediction[column])
                if model is not None and column == "speedup":
                    trace.name = f"predicted ({model.describe()})"
        if counts[-1] / counts[0] > 16:
            figure.update_xaxes(type="log")


STATES = ("COMPLETE", "PRUNED", "FAIL", "RUNNING")
_COLOURS = {"COMPLETE": "#2a9d8f", "PRUNED": "#e9c46a", "FAIL": "#e76f51", "RUNNING": "#8ecae6"}


def sweep_figure(table: pd.DataFrame, metric: str, params: list[str], title: str = "") -> Any:
    """Metric of every trial (coloured by state) and a parallel-coordinates plot of params -> metric."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    base = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.4, 0.6],
        specs=[[{"type": "xy"}, {"type": "domain"}]],
        subplot_titles=(f"{metric} per trial", "parameters -> " + metric),
    )
    for state in STATES:
        base.add_scatter(
            x=[], y=[], mode="markers", name=state.lower(), marker={"color": _COLOURS[state], "size": 10}, row=1, col=1
        )
    base.add_trace(go.Parcoords(dimensions=[]), row=1, col=2)
    base.update_layout(title=title, template="plotly_white", height=360, margin={"t": 70, "b": 40})
    base.update_xaxes(title_text="trial", row=1, col=1)
    base.update_yaxes(title_text=metric, row=1, col=1)
    fill_sweep_figure(base, table, metric, params)
    return base


def fill_sweep_figure(figure: Any, table: pd.DataFrame, metric: str, params: list[str]) -> None:
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
            dims.append(
                {
                    "label": name,
                    "values": [codes[str(v)] for v in column],
                    "tickvals": list(range(len(labels))),
                    "ticktext": labels,
                }
            )
    return dims


def plan_figure(table: pd.DataFrame, ranks: int, tolerance: float, shown: int = 12) -> Any:
    """The planner's layouts: predicted step time of the fastest that fit (measured beside), and predicted vs measured."""
    from plotly.subplots import make_subplots

    figure = make_subplots(
        rows=1,
        cols=2,
        column_widths=[0.62, 0.38],
        subplot_titles=(f"fastest predicted layouts on {ranks} ranks", "predicted against measured"),
    )
    top = table[table["fits"]].head(shown)
    labels = list(top["layout"])
    figure.add_bar(
        x=labels,
        y=[1e3 * v for v in top["predicted_step_s"]],
        name="predicted",
        marker={"color": "#8ecae6"},
        row=1,
        col=1,
    )
    ran = top[top["measured_step_s"].notna()]
    figure.add_scatter(
        x=list(ran["layout"]),
        y=[1e3 * v for v in ran["measured_step_s"]],
        mode="markers",
        name="measured",
        marker={"color": "#d62728", "size": 11, "symbol": "diamond"},
        row=1,
        col=1,
    )
    every = table[table["measured_step_s"].notna()]
    if len(every):
        high = 1.1e3 * float(max(every["measured_step_s"].max(), every["predicted_step_s"].max()))
        line = [0.0, high]
        figure.add_scatter(
            x=line,
            y=line,
            mode="lines",
            name="predicted = measured",
            line={"color": "grey", "dash": "dot"},
            row=1,
            col=2,
        )
        for factor in (1 - tolerance, 1 + tolerance):
            figure.add_scatter(
                x=line,
                y=[factor * v for v in line],
                mode="lines",
                line={"color": "lightgrey", "dash": "dash"},
                name=f"±{tolerance:.0%}",
                showlegend=factor > 1,
                legendgroup="band",
                row=1,
                col=2,
            )
        figure.add_scatter(
            x=[1e3 * v for v in every["measured_step_s"]],
            y=[1e3 * v for v in every["predicted_step_s"]],
            mode="markers+text",
            text=list(every["layout"]),
            textposition="top center",
            name="layouts run",
            marker={"color": "#d62728", "size": 10},
            showlegend=False,
            row=1,
            col=2,
        )
    figure.update_yaxes(title_text="step time (ms)", row=1, col=1)
    figure.update_xaxes(title_text="measured step time (ms)", row=1, col=2)
    figure.update_yaxes(title_text="predicted step time (ms)", row=1, col=2)
    figure.update_layout(template="plotly_white", height=420, title=f"layout planner: {ranks} ranks", margin={"b": 120})
    return figure


def published_figure(
    rows: list[dict[str, Any]], curves: dict[str, tuple[list[int], list[float]]], tolerance: float
) -> Any:
    """Published speedups (markers) against the model's (lines), with the tolerance band around each published point."""
    import plotly.graph_objects as go

    figure = go.Figure()
    colours = ["#1f77b4", "#d62728", "#2a9d8f", "#e9c46a", "#9467bd"]
    for i, (name, (gpus, speedups)) in enumerate(curves.items()):
        colour = colours[i % len(colours)]
        figure.add_scatter(x=gpus, y=speedups, mode="lines", name=f"{name}: predicted", line={"color": colour})
        points = [r for r in rows if r["model"] == name]
        figure.add_scatter(
            x=[r["gpus"] for r in points],
            y=[r["published_speedup"] for r in points],
            mode="markers",
            name=f"{name}: published",
            marker={"color": colour, "size": 11, "symbol": "diamond"},
            error_y={"type": "data", "array": [tolerance * r["published_speedup"] for r in points], "visible": True},
        )
    top = max((max(g) for g, _ in curves.values()), default=1)
    figure.add_scatter(x=[1, top], y=[1, top], mode="lines", name="ideal", line={"color": "grey", "dash": "dot"})
    figure.update_xaxes(title_text="GPUs", type="log")
    figure.update_yaxes(title_text="speedup over one GPU", type="log")
    figure.update_layout(
        template="plotly_white", height=420, title=f"published speedups against the model (bars: ±{tolerance:.0%})"
    )
    return figure
