"""Live training plots: rank 0's metric rows (and other ranks' timings) drawn while the run goes on.

:class:`LivePlot` is a client-side metrics callback (``rd.train(callbacks=[...])``
calls it with every row). Rows are buffered and drawn in batches, at most
``max_redraws_per_s`` times a second, on the figure
:func:`rapydli.experiments.figures.training_figure` builds, redrawn in place in the
cell's output when a Jupyter kernel shows it (:class:`~rapydli.widgets.display.LiveFigure`).
:meth:`LivePlot.close` draws what is left and settles the figure: plotly's JSON and its
PNG stay in the output, so a notebook saved or run headless (papermill) shows the final
plot everywhere.

Examples
--------
>>> plot = LivePlot(title="mlp", live=False)
>>> plot({"kind": "train", "step": 1, "loss": 2.3, "samples_per_s": 900.0, "step_time_s": 0.01,
...       "comm_time_s": 0.002, "comm_wait_s": 0.001})
>>> plot.close()
>>> list(plot.figure.data[0].y)
[2.3]
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from rapydli.experiments.figures import THROUGHPUT_WINDOW, TRAINING_TRACES, training_figure
from rapydli.widgets.display import LiveFigure


class LivePlot(LiveFigure):
    """A metrics callback that draws loss, val loss, throughput and step/comm time live.

    Around the throughput line, a band spans the lower to the upper quartile of the last
    :data:`~rapydli.experiments.figures.THROUGHPUT_WINDOW` steps (from the fourth step on).

    Rows of ``kind="rank"`` (other ranks' step timings, from a
    :class:`~rapydli.experiments.job.TrainingJob`) add one "comm wait" line per rank.
    A ``kind="straggler"`` row marks the slow rank: its comm-wait line drawn bold and red
    (renamed "... straggler"), and its one-line report over the step-time panel. A
    ``kind="hang"`` row draws a red line at the last step and the diagnosis's first line
    above the figure (the whole diagnosis on hover).

    Parameters
    ----------
    title
        Figure title.
    max_redraws_per_s
        Upper bound on redraws; rows arriving faster are drawn together.
    live
        Show the figure in the cell's output when :meth:`show` is called (default: inside a Jupyter kernel).

    Attributes
    ----------
    figure
        The plotly figure (a plain ``go.Figure``).
    redraws
        How many times the figure was redrawn.
    rows
        Every row received.
    """

    def __init__(self, title: str = "", max_redraws_per_s: float = 4.0, live: bool | None = None) -> None:
        super().__init__(max_redraws_per_s, live)
        self.figure = training_figure(title)
        self.rows: list[dict[str, Any]] = []
        self.restarts: list[int] = []  # steps where the run resumed after ranks died (drawn as markers)
        self._drawn = 0
        self._rank_traces: dict[int, Any] = {}
        self._throughput: deque[float] = deque(maxlen=THROUGHPUT_WINDOW)  # the last steps' samples/s, for the band
        self.notices: list[dict[str, Any]] = []  # the straggler and hang rows drawn, in order

    def __call__(self, row: dict[str, Any]) -> None:
        with self._lock:
            self.rows.append(row)
        self.tick()

    def flush(self) -> None:
        """Draw every pending row now (one batched redraw)."""
        with self._lock:
            if self._drawn == len(self.rows):
                return
            rows, self._drawn = self.rows[self._drawn :], len(self.rows)
            for rank in sorted({r["rank"] for r in rows if r.get("kind") == "rank"} - set(self._rank_traces)):
                self._add_rank_trace(rank)
            # the points worked out on copies first: within batch_update a trace reads as it was before the batch
            traces = [*self.figure.data]
            drawn = [list(zip(trace.x or (), trace.y or ())) for trace in traces]
            points = [list(trace_points) for trace_points in drawn]
            restarts = []
            segment: list[dict[str, Any]] = []
            for row in rows:  # in order: a restart drops the steps after the one it resumed from (they are done again)
                if row.get("kind") != "restart":
                    segment.append(self._with_band(row))
                    continue
                self._append(segment, points)
                segment = []
                self._throughput.clear()  # the steps redone are a new window
                restarts.append(row)
                points = [[(x, y) for x, y in trace_points if x <= row["step"]] for trace_points in points]
            self._append(segment, points)
            with self.figure.batch_update():
                for trace, before, after in zip(traces, drawn, points):
                    if after != before:
                        trace.x, trace.y = tuple(x for x, _ in after), tuple(y for _, y in after)
                for step in (restart["step"] for restart in restarts):
                    self.restarts.append(step)
                    self.figure.add_shape(
                        type="line",
                        x0=step,
                        x1=step,
                        xref="x",
                        y0=0,
                        y1=1,
                        yref="y domain",
                        line={"dash": "dash", "color": "#d62728"},
                    )
            for restart in restarts:  # not batched either: what died, the ranks that went on, how long it took
                self._label_restart(restart)
            for notice in (r for r in rows if r.get("kind") in NOTICES):  # not batched: plotly's batch_update
                self._notice(notice)  # keeps only the last of several annotations added within one
            self.drawn()

    def _with_band(self, row: dict[str, Any]) -> dict[str, Any]:
        """``row``, a training step's with the quartiles of the last steps' throughput added (a copy; from 4 steps on)."""
        if row.get("kind") != "train" or row.get("samples_per_s") is None:
            return row
        self._throughput.append(float(row["samples_per_s"]))
        if len(self._throughput) < 4:
            return row
        q1, _, q3 = statistics.quantiles(self._throughput, n=4, method="inclusive")
        return {**row, "samples_per_s_q1": q1, "samples_per_s_q3": q3}

    def _append(self, rows: list[dict[str, Any]], points: list[list[tuple[Any, Any]]]) -> None:
        """Add ``rows``' points to ``points`` (one list per trace of the figure), in step order
        (a restart's recovered rows are earlier steps than those drawn)."""
        keys: list[tuple[str, str, str, int | None]] = [
            (kind, xkey, ykey, None) for _, kind, xkey, ykey, _ in TRAINING_TRACES
        ]
        keys += [("rank", "step", "comm_wait_s", rank) for rank in self._rank_traces]
        for trace_points, (kind, xkey, ykey, rank) in zip(points, keys):
            fresh = [
                (r[xkey], r[ykey])
                for r in rows
                if r.get("kind") == kind and r.get(ykey) is not None and (rank is None or r["rank"] == rank)
            ]
            if fresh and trace_points and fresh[0][0] < trace_points[-1][0]:
                trace_points.extend(fresh)
                trace_points.sort(key=lambda point: point[0])
            else:
                trace_points.extend(fresh)

    def _label_restart(self, row: dict[str, Any]) -> None:
        """Label a restart's line: the ranks it went on with and the seconds it took; the whole story on hover."""
        from rapydli.experiments.figures import restart_text

        parts = [f"{row['workers']} ranks" if row.get("workers") is not None else "",
                 f"{row['recovery_s']:g} s" if row.get("recovery_s") is not None else ""]  # fmt: skip
        said = ", ".join(part for part in parts if part)
        self.figure.add_annotation(
            text="restart" + (f": {said}" if said else ""),
            hovertext=restart_text({**row, "resumed_from_step": row["step"]}),
            x=row["step"],
            xref="x",
            y=1,
            yref="y domain",
            xanchor="left",
            showarrow=False,
            font={"color": RED, "size": 11},
        )

    def _notice(self, row: dict[str, Any]) -> None:
        """Draw a straggler or a hang (see the class docstring)."""
        self.notices.append(row)
        if row["kind"] == "straggler":
            trace = self._rank_traces.get(row["rank"])
            if trace is not None:
                trace.line = {"color": RED, "width": 3}
                trace.name = f"comm wait rank {row['rank']} (s), straggler"
            stragglers = sum(1 for n in self.notices if n["kind"] == "straggler")
            self.figure.add_annotation(
                text=_short(row["text"], 90),
                hovertext=row["text"],
                xref="x3 domain",
                yref="y3 domain",
                x=0,
                y=1 - 0.1 * stragglers,
                xanchor="left",
                showarrow=False,
                font={"color": RED, "size": 11},
            )
            return
        first = str(row.get("diagnosis", "")).strip().splitlines()[0] if row.get("diagnosis") else "no rank progresses"
        self.figure.add_shape(
            type="line",
            x0=row["step"],
            x1=row["step"],
            xref="x",
            y0=0,
            y1=1,
            yref="y domain",
            line={"dash": "dot", "color": RED, "width": 3},
        )
        self.figure.add_annotation(
            text=f"hang: {_short(first, 140)}",
            hovertext=str(row.get("diagnosis", "")),
            xref="paper",
            yref="paper",
            x=0,
            y=1.2,
            xanchor="left",
            showarrow=False,
            font={"color": RED, "size": 12},
        )
        self.figure.update_layout(margin={"t": 100})  # room for it below the title

    def _add_rank_trace(self, rank: int) -> None:
        """Rank ``rank``'s communication wait, next to rank 0's (it differs per rank)."""
        self.figure.add_scatter(
            x=[], y=[], mode="lines", name=f"comm wait rank {rank} (s)", line={"dash": "dot"}, row=1, col=3
        )
        self._rank_traces[rank] = self.figure.data[-1]


#: Rows drawn as marks on the figure rather than as points (see :class:`LivePlot`).
NOTICES = ("straggler", "hang")
RED = "#d62728"


def _short(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"
