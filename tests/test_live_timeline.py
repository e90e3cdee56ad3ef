"""The pipeline timeline drawn live (rapydli.widgets.timeline): the latest complete step, throttled redraws."""

from __future__ import annotations

import time

import pytest

from rapydli.parallel import schedules
from rapydli.widgets.timeline import LiveTimeline


def rows_of_step(step: int, replica: int = 0, stages: int = 2, microbatches: int = 4) -> list[dict]:
    """Each stage's ``timeline`` row of one step, as a pipelined run sends them (a simulated 1F1B step)."""
    sim = schedules.simulate(schedules.build("1f1b", stages, microbatches), 0.001 * step, 0.002)
    return [
        {
            "kind": "timeline",
            "rank": replica * stages + stage,
            "stage": stage,
            "replica": replica,
            "pipeline_stages": stages,
            "microbatches": microbatches,
            "schedule": "1f1b",
            "step": step,
            "spans": [(a.kind, a.microbatch, s, e) for a, s, e in spans],
        }
        for stage, spans in enumerate(sim.spans)
    ]


@pytest.mark.parametrize("widget", [False, True])
def test_the_latest_step_every_stage_reported_is_drawn(widget: bool) -> None:
    timeline = LiveTimeline(live=widget, max_redraws_per_s=1e9)  # no throttling here
    first, second, third = rows_of_step(1), rows_of_step(2), rows_of_step(3)
    timeline({"kind": "train", "step": 1, "loss": 1.0})  # other rows are not its business
    timeline(first[0])
    assert timeline.step is None and timeline.redraws == 0  # stage 1 has not reported step 1 yet
    for row in (first[1], second[0], third[0], second[1]):  # stage 0 runs ahead of stage 1
        timeline(row)
    assert timeline.step == 2  # step 3 lacks stage 1
    forward = next(trace for trace in timeline.figure.data if trace.name == "forward")
    assert set(forward.y) == {"rank 0", "rank 1"} and len(forward.x) == 2 * 4
    assert (
        "step 2, replica 0" in timeline.figure.layout.title.text and "theory 20.0%" in timeline.figure.layout.title.text
    )
    for row in rows_of_step(1, replica=1):  # another replica's rows are not drawn
        timeline(row)
    assert timeline.received == 5 and timeline.step == 2
    timeline(third[1])
    timeline.close()
    assert timeline.step == 3 and timeline.redraws == 3  # steps 1, 2 and 3
    assert type(timeline.static()).__name__ == "Figure"


def test_redraws_are_throttled_and_the_last_step_is_drawn_at_close() -> None:
    timeline = LiveTimeline(live=True, max_redraws_per_s=5)
    started = time.monotonic()
    for step in range(1, 201):
        for row in rows_of_step(step):
            timeline(row)
    elapsed = time.monotonic() - started
    assert timeline.redraws <= 5 * elapsed + 2  # at most 5 a second, plus the first
    timeline.close()
    assert timeline.step == 200 and timeline.received == 400
