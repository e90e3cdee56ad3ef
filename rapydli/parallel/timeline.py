"""The measured pipeline timeline: spans recorded on every rank, and its Gantt figure.

Every rank's :class:`Recorder` keeps ``(step, kind, microbatch, start, end)`` for each
forward, backward, send/receive wait and allreduce wait of a step: two
``perf_counter`` calls and one tuple per action. :func:`figure` draws the spans of one
step, one row per rank, coloured by kind, with the ideal schedule for the measured
per-stage forward/backward times overlaid (:func:`rapydli.parallel.schedules.simulate`)
and the measured bubble fraction beside the theoretical ``(p - 1) / (m + p - 1)``. The
figure has one bar trace per kind, so a live display (:mod:`rapydli.widgets.timeline`)
refills the same traces with each new step (:func:`empty_figure`, :func:`fill`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rapydli.parallel import schedules

COLOURS = {
    "forward": "#4C78A8",
    "backward": "#F58518",
    "recv_activation": "#BAB0AC",
    "recv_gradient": "#9D755D",
    "send_activation": "#E45756",
    "send_gradient": "#E45756",
    "send_wait": "#FF9DA6",
    "allreduce": "#54A24B",
}


@dataclass
class Recorder:
    """Spans of this rank's actions, per step; the last ``keep`` steps are kept.

    Attributes
    ----------
    steps
        ``{step: [(kind, microbatch, start, end), ...]}`` (``perf_counter`` seconds).
    """

    enabled: bool = True
    keep: int = 8
    steps: dict[int, list[tuple[str, int, float, float]]] = field(default_factory=dict)
    step: int = 0
    _current: list[tuple[str, int, float, float]] = field(default_factory=list)

    def begin_step(self, step: int) -> None:
        """Start recording step ``step``; drops steps older than ``keep``."""
        self.step = step
        if self.enabled:
            self._current = self.steps[step] = []
            for old in [s for s in self.steps if s <= step - self.keep]:
                del self.steps[old]

    def span(self, kind: str, microbatch: int, start: float, end: float) -> None:
        """Record one action of the current step."""
        if self.enabled:
            self._current.append((kind, microbatch, start, end))

    def of_step(self, step: int) -> list[tuple[str, int, float, float]]:
        """``(kind, microbatch, start, end)`` of step ``step`` (empty when not kept)."""
        return list(self.steps.get(step, ()))


class EmitTimeline:
    """A Trainer callback that sends this rank's spans of each step to the notebook.

    Parameters
    ----------
    recorder
        The rank's :class:`Recorder`.
    emit
        ``emit(kind, payload)``: the engine's event channel (``rapydli.cluster.events.emit``).
    layout
        ``rank``, ``stage``, ``replica``, ``stages``, ``microbatches``, ``schedule`` and
        ``bounds`` of this rank; each event adds ``step`` and ``spans``.
    """

    def __init__(self, recorder: Recorder, emit: Callable[[str, Any], None], layout: dict[str, Any]) -> None:
        self.recorder, self.emit, self.layout = recorder, emit, layout

    def on_step_end(self, row: dict[str, Any]) -> None:
        """Send the last micro-step's spans (with the step's allreduce) as a ``timeline`` event."""
        spans = self.recorder.of_step(self.recorder.step)
        self.emit("timeline", {**self.layout, "step": row["step"], "spans": spans})


def figure_from_events(events: dict[int, dict[str, Any]], replica: int = 0) -> Any:
    """:func:`figure` of the latest ``timeline`` events of one replica's ranks (keyed by world rank)."""
    ranks = sorted((e for e in events.values() if e["replica"] == replica), key=lambda e: e["stage"])
    if not ranks:
        raise ValueError(f"no timeline of replica {replica}: the run was not pipelined or sent no step")
    first = ranks[0]
    labels = [f"rank {e['rank']}" for e in ranks]
    return figure(
        [e["spans"] for e in ranks],
        first["schedule"],
        first["microbatches"],
        f"step {first['step']}, replica {replica}",
        labels,
    )


def bubble(spans_by_rank: Sequence[Sequence[tuple[str, int, float, float]]]) -> tuple[float, list[float]]:
    """Measured idle fraction of one step: overall, and per rank.

    The step is its pipeline part, as ``(p - 1) / (m + p - 1)`` counts it: from the
    earliest start to the latest end of the micro-batches' spans over all ranks (the
    gradient allreduce between replicas after it, a span of micro-batch -1, is left out);
    a rank is busy while it runs forward or backward. The timeline's title and notebook
    08 give this number.
    """
    pipeline = [[span for span in spans if span[1] >= 0] for spans in spans_by_rank]
    starts = [s for spans in pipeline for _, _, s, _ in spans]
    ends = [e for spans in pipeline for _, _, _, e in spans]
    if not starts:
        return 0.0, []
    length = max(ends) - min(starts)
    per_rank = []
    for spans in pipeline:
        busy = sum(e - s for k, _, s, e in spans if k in schedules.COMPUTE)
        per_rank.append(1.0 - busy / length if length > 0 else 0.0)
    return sum(per_rank) / len(per_rank), per_rank


def stage_times(spans_by_rank: Sequence[Sequence[tuple[str, int, float, float]]]) -> tuple[list[float], list[float]]:
    """Median forward and backward time of each rank's micro-batches."""
    forward, backward = [], []
    for spans in spans_by_rank:
        f = [e - s for k, _, s, e in spans if k == "forward"]
        b = [e - s for k, _, s, e in spans if k == "backward"]
        forward.append(statistics.median(f) if f else 0.0)
        backward.append(statistics.median(b) if b else 0.0)
    return forward, backward


def empty_figure() -> Any:
    """A Gantt figure with no spans yet: one bar trace per kind of :data:`COLOURS` and one for the ideal schedule.

    :func:`fill` puts a step into it (a live display refills it in place, the traces stay the same).
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    for kind, colour in COLOURS.items():
        fig.add_trace(
            go.Bar(x=[], base=[], y=[], orientation="h", marker_color=colour, name=kind, width=0.5, hoverinfo="text+x")
        )
    ideal = {"color": "rgba(0,0,0,0)", "line": {"color": "black", "width": 1}}
    fig.add_trace(
        go.Bar(
            x=[], base=[], y=[], orientation="h", marker=ideal, name="ideal", width=0.8, offset=-0.4, hoverinfo="text+x"
        )
    )
    fig.update_layout(
        barmode="overlay",
        xaxis_title="ms since the step began",
        yaxis={"autorange": "reversed", "categoryorder": "array"},
    )
    return fig


def fill(
    fig: Any,
    spans_by_rank: Sequence[Sequence[tuple[str, int, float, float]]],
    schedule: str,
    microbatches: int,
    title: str = "pipeline timeline",
    labels: Sequence[str] | None = None,
) -> None:
    """Put one step into a figure made by :func:`empty_figure` (its traces are refilled in place).

    ``labels`` name the rows (default ``"rank <stage>"``).
    """
    stages = len(spans_by_rank)
    rows = list(labels) if labels is not None else [f"rank {rank}" for rank in range(stages)]
    origin = min((s for spans in spans_by_rank for _, _, s, _ in spans), default=0.0)
    bars: dict[str, tuple[list[float], list[float], list[str], list[str]]] = {
        kind: ([], [], [], []) for kind in (*COLOURS, "ideal")
    }
    for row, spans in zip(rows, spans_by_rank):
        for kind, mb, start, end in spans:
            width, base, ys, text = bars.setdefault(kind, ([], [], [], []))
            width.append((end - start) * 1e3)
            base.append((start - origin) * 1e3)
            ys.append(row)
            text.append(f"{kind}({mb})" if mb >= 0 else kind)
    forward, backward = stage_times(spans_by_rank)
    ideal = schedules.simulate(schedules.build(schedule, stages, microbatches), forward, backward)
    width, base, ys, text = bars["ideal"]
    for row, ideal_spans in zip(rows, ideal.spans):
        for action, start, end in ideal_spans:
            if action.kind in schedules.COMPUTE:
                width.append((end - start) * 1e3)
                base.append(start * 1e3)
                ys.append(row)
                text.append(f"ideal {action}")
    measured, _ = bubble(spans_by_rank)
    theory = schedules.bubble_fraction(stages, microbatches)
    expected = sum(ideal.idle_fraction(s) for s in range(stages)) / stages
    with fig.batch_update():
        for trace in fig.data:
            width, base, ys, text = bars.get(trace.name, ([], [], [], []))
            trace.x, trace.base, trace.y, trace.hovertext, trace.showlegend = width, base, ys, text, bool(width)
        fig.layout.yaxis.categoryarray = rows
        fig.layout.title.text = (
            f"{title}: {schedule}, p={stages}, m={microbatches}; bubble measured {measured:.1%}, theory {theory:.1%}, "
            f"ideal for measured stage times {expected:.1%}"
        )


def figure(
    spans_by_rank: Sequence[Sequence[tuple[str, int, float, float]]],
    schedule: str,
    microbatches: int,
    title: str = "pipeline timeline",
    labels: Sequence[str] | None = None,
) -> Any:
    """A plotly Gantt chart of one step: one row per rank (= stage), ideal schedule overlaid.

    ``spans_by_rank[r]`` are rank ``r``'s ``(kind, microbatch, start, end)`` spans of the
    step (clocks may differ between ranks by their offsets; each rank's spans are taken
    relative to the step's earliest start). One bar trace per kind of span (named as the
    kind) and one named ``"ideal"``; the title gives the measured bubble beside
    ``(p - 1) / (m + p - 1)``; ``labels`` name the rows (default ``"rank <stage>"``).
    Returns a ``plotly.graph_objects.Figure``.
    """
    fig = empty_figure()
    fill(fig, spans_by_rank, schedule, microbatches, title, labels)
    return fig
