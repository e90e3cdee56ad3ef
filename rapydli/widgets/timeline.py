"""The pipeline timeline drawn live: the Gantt chart of a pipelined run's latest step, while it runs.

:class:`LiveTimeline` is a client-side metrics callback, like
:class:`~rapydli.widgets.live.LivePlot`: a pipelined run sends every rank's spans of each
step as a ``kind="timeline"`` row (:class:`~rapydli.parallel.timeline.EmitTimeline` on
the ranks, :class:`~rapydli.experiments.job.TrainingJob` on the client). The rows of
one replica's stages arrive at different times, so the chart shows the latest step that
every stage of the replica has reported. Redraws are throttled (at most
``max_redraws_per_s``; rows in between only replace the step to draw) and refill the
same traces (:func:`rapydli.parallel.timeline.fill`), so a redraw sends a few arrays, not
a new figure. :meth:`LiveTimeline.close` draws the last step and leaves a static figure
in the cell's output.

Examples
--------
>>> spans = [[("forward", 0, 0.0, 0.01), ("backward", 0, 0.02, 0.04)], [("recv_activation", 0, 0.0, 0.01),
...          ("forward", 0, 0.01, 0.02), ("backward", 0, 0.02, 0.03)]]
>>> timeline = LiveTimeline(live=False)
>>> for stage, own in enumerate(spans):
...     timeline({"kind": "timeline", "rank": stage, "stage": stage, "replica": 0, "pipeline_stages": 2, "step": 1,
...               "microbatches": 1, "schedule": "gpipe", "spans": own})
>>> timeline.close()
>>> timeline.step, "bubble measured" in timeline.figure.layout.title.text
(1, True)
"""

from __future__ import annotations

from typing import Any

from rapydli.parallel.timeline import empty_figure, fill
from rapydli.widgets.display import LiveFigure

#: Steps of each rank kept while waiting for the replica's other stages to report the same step.
KEEP_STEPS = 16


class LiveTimeline(LiveFigure):
    """A metrics callback that draws the latest complete step of one replica as a Gantt chart.

    Parameters
    ----------
    replica
        The data-parallel replica whose stages are drawn.
    max_redraws_per_s
        Upper bound on redraws.
    live
        Show the figure in the cell's output when :meth:`show` is called (default: inside a Jupyter kernel).

    Attributes
    ----------
    figure
        The plotly figure (a plain ``go.Figure``).
    step
        The step drawn last (``None`` before the first).
    redraws
        How many times the figure was redrawn.
    received
        ``timeline`` rows received of this replica.
    """

    caption = "(live pipeline timeline: shown while the run goes)"

    def __init__(self, replica: int = 0, max_redraws_per_s: float = 1.0, live: bool | None = None) -> None:
        super().__init__(max_redraws_per_s, live)
        self.figure = empty_figure()
        self.figure.update_layout(
            title="pipeline timeline: waiting for the first step", template="plotly_white", height=260
        )
        self.replica = replica
        self.step: int | None = None
        self.received = 0
        self._recent: dict[int, dict[int, dict[str, Any]]] = {}  # stage -> step -> the stage's row of that step
        self._stages = 0

    def __call__(self, row: dict[str, Any]) -> None:
        if row.get("kind") != "timeline" or row.get("replica") != self.replica:
            return
        with self._lock:
            self.received += 1
            steps = self._recent.setdefault(row["stage"], {})
            steps[row["step"]] = row
            for old in sorted(steps)[:-KEEP_STEPS]:
                del steps[old]
            self._stages = row["pipeline_stages"] if "pipeline_stages" in row else row["stages"]  # a run stored before
        self.tick()

    def flush(self) -> None:
        """Draw the latest step every stage of the replica has reported, if it is new."""
        with self._lock:
            if len(self._recent) < self._stages or not self._stages:
                return
            common = set.intersection(*(set(steps) for steps in self._recent.values()))
            if not common or max(common) == self.step:
                return
            step = max(common)
            rows = [self._recent[stage][step] for stage in range(self._stages)]
            title = f"step {step}, replica {self.replica}"
            labels = [f"rank {row['rank']}" for row in rows]
            fill(
                self.figure, [row["spans"] for row in rows], rows[0]["schedule"], rows[0]["microbatches"], title, labels
            )
            self.step = step
            self.drawn()
