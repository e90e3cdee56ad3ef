"""Live metrics: rows reach the notebook while training runs; redraws are batched and rate-limited."""

from __future__ import annotations

import time

import pytest

import rapydli as rd
from rapydli.cluster import events
from rapydli.experiments.job import TrainingJob
from rapydli.experiments.spec import RunSpec
from rapydli.widgets.live import LivePlot
from rapydli.zoo import datasets, models


def _row(step: int) -> dict:
    return {
        "kind": "train",
        "step": step,
        "loss": 1.0 / step,
        "samples_per_s": 100.0,
        "step_time_s": 0.01,
        "comm_time_s": 0.001,
        "comm_wait_s": 0.0,
    }


def test_redraws_are_batched_and_rate_limited() -> None:
    plot = LivePlot(live=True, max_redraws_per_s=10)
    started = time.monotonic()
    for step in range(1, 501):
        plot(_row(step))
    plot({"kind": "eval", "step": 500, "val_loss": 0.5})
    plot.close()
    elapsed = time.monotonic() - started
    assert plot.redraws <= 10 * elapsed + 2  # at most 10 per second, plus the first and the final flush
    assert list(plot.figure.data[0].x) == list(range(1, 501))  # every row drawn, none lost
    assert list(plot.figure.data[1].y) == [0.5]
    assert type(plot.static()).__name__ == "Figure"


@pytest.mark.engines
def test_metrics_arrive_before_training_ends() -> None:
    arrivals: list[tuple[float, int]] = []

    def paced_mlp():  # nested, so cloudpickle ships it by value
        model = models.mlp()
        # 3 ms per forward: 200 steps span over 0.6 s on the engines however fast the machine
        # (plain MLP steps on digits took 1.2 ms on one, too short for the check below to mean much)
        model.register_forward_hook(lambda *_: time.sleep(0.003))
        return model

    with rd.Cluster(n=2) as cluster:
        config = rd.TrainConfig(max_steps=200, epochs=50, batch_size=16, allreduce="mpi")
        rows: list[dict] = []

        def follow(row: dict) -> None:
            rows.append(row)
            if row["kind"] == "train":
                arrivals.append((time.monotonic(), row["step"]))

        job = TrainingJob(cluster, RunSpec.of(paced_mlp, datasets.digits), config, [0, 1], callbacks=[follow]).start()
        job.wait()
        ended = time.monotonic()
    assert job.state == "finished"
    # the other rank's own step timings arrive too (they differ per rank), and reach the plot
    rank1 = [r for r in rows if r["kind"] == "rank"]
    assert {r["rank"] for r in rank1} == {1} and [r["step"] for r in rank1] == list(range(1, 201))
    plot = LivePlot(live=False)
    for row in rows:
        plot(row)
    plot.close()
    # (named "..., straggler" when the machine's load made rank 1 the slow one: the plot marks it so)
    assert any(t.name.startswith("comm wait rank 1 (s)") and len(t.y) == 200 for t in plot.figure.data)
    steps = [step for _, step in arrivals]
    assert steps[:3] == [1, 2, 3] and steps[-1] == 200
    # rows streamed as they were produced: their arrival times spread like the ranks' own step
    # times (a batch delivered at the end would arrive all at once); events may be coalesced
    # for up to COALESCE_S on the engine, hence the allowance
    produced = [row["time_s"] for row in rows if row["kind"] == "train"]
    received = [t for t, _ in arrivals]
    assert received[-1] - received[0] > 0.5 * (produced[-1] - produced[0]) - events.COALESCE_S
    assert produced[-1] - produced[0] > 0.3  # the run was long enough for that to mean something
    assert received[-1] <= ended


def test_a_restart_row_draws_a_marker_where_the_run_resumed() -> None:
    from rapydli.widgets.live import LivePlot

    plot = LivePlot(title="restarts", live=False)
    plot(
        {
            "kind": "train",
            "step": 1,
            "loss": 2.0,
            "samples_per_s": 1.0,
            "step_time_s": 0.1,
            "comm_time_s": 0.01,
            "comm_wait_s": 0.0,
        }
    )
    plot({"kind": "restart", "step": 4, "cause": "rank 1 died", "ranks": [1], "workers": 2, "recovery_s": 6.5})
    plot.close()
    assert plot.restarts == [4] and [shape.x0 for shape in plot.figure.layout.shapes] == [4]
    (label,) = [
        a for a in plot.figure.layout.annotations if (a.text or "").startswith("restart")
    ]  # what died, the ranks that went on and how long it took
    assert (
        label.text == "restart: 2 ranks, 6.5 s"
        and label.hovertext == "rank 1 died; resumed from step 4 on 2 ranks 6.5 s later"
    )


def test_a_restarted_run_keeps_every_step_once_in_order() -> None:
    from rapydli.widgets.live import LivePlot

    def row(step: int) -> dict:
        return {
            "kind": "train",
            "step": step,
            "loss": 10.0 - step,
            "samples_per_s": 1.0,
            "step_time_s": 0.1,
            "comm_time_s": 0.01,
            "comm_wait_s": 0.0,
        }

    for batched in (False, True):  # rows drawn as they come, or all in one redraw
        plot = LivePlot(title="restarts", live=False, max_redraws_per_s=1e9 if not batched else 1e-9)
        for step in (
            1,
            5,
            6,
        ):  # the first attempt: steps 2-4 died in its engine's buffer, 5-6 are done again after the restart
            plot(row(step))
        for step in (2, 3, 4):  # recovered from the checkpoint of step 4
            plot(row(step))
        plot({"kind": "restart", "step": 4, "cause": "rank 1 died", "ranks": [1]})
        for step in (5, 6, 7):
            plot(row(step))
        plot.close()
        loss = plot.figure.data[0]
        assert list(loss.x) == [1, 2, 3, 4, 5, 6, 7] and list(loss.y) == [9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0], batched
        assert plot.restarts == [4]


def test_the_throughput_band_spans_the_middle_half_of_the_last_steps() -> None:
    from rapydli.experiments.figures import THROUGHPUT_WINDOW

    plot = LivePlot(live=False)
    speeds = [100.0, 110.0, 90.0, 105.0, 400.0, 95.0, 100.0, 102.0, 98.0, 101.0, 99.0, 103.0]  # one step stands out
    for step, speed in enumerate(speeds, start=1):
        plot({**_row(step), "samples_per_s": speed})
    plot.close()
    traces = {trace.name: trace for trace in plot.figure.data}
    low, high = (
        traces["samples/s lower quartile"],
        traces[f"samples/s, middle half of the last {THROUGHPUT_WINDOW} steps"],
    )
    assert list(low.x) == list(high.x) == list(range(4, len(speeds) + 1))  # from the fourth step on
    last = speeds[-THROUGHPUT_WINDOW:]
    import statistics

    q1, _, q3 = statistics.quantiles(last, n=4, method="inclusive")
    assert (low.y[-1], high.y[-1]) == (q1, q3) and 95.0 < q1 < q3 < 110.0  # the outlier does not widen the band
    assert list(traces["samples/s"].y) == speeds
    assert high.fill == "tonexty"


def test_a_straggler_and_a_hang_are_marked_on_the_live_plot() -> None:
    from rapydli.widgets.live import RED, LivePlot

    plot = LivePlot(title="marks", live=False)
    for step in (1, 2, 3):
        plot(
            {
                "kind": "train",
                "step": step,
                "loss": 1.0,
                "samples_per_s": 100.0,
                "step_time_s": 0.05,
                "comm_time_s": 0.01,
                "comm_wait_s": 0.03,
            }
        )
        plot({"kind": "rank", "rank": 1, "step": step, "step_time_s": 0.05, "comm_wait_s": 0.0})
    text = "rank 1 (host n2) is a straggler: busy 50 ms per step against 20 ms on the other ranks (median of the last 3 steps)"
    plot({"kind": "straggler", "rank": 1, "host": "n2", "text": text})
    diagnosis = (
        "rank 1 never arrived at allreduce #9 on world, where rank 0 waits (4 MiB float32)\nrank 1 is at: forward"
    )
    plot({"kind": "hang", "step": 3, "diagnosis": diagnosis, "action": "wait"})
    plot.close()
    rank1 = next(t for t in plot.figure.data if (t.name or "").startswith("comm wait rank 1"))
    assert rank1.name.endswith("straggler") and rank1.line.color == RED and len(rank1.y) == 3
    notes = {a.text: a.hovertext for a in plot.figure.layout.annotations if a.text}
    assert any(t.startswith("rank 1 (host n2) is a straggler") for t in notes)
    hang = next(t for t in notes if t.startswith("hang: "))
    assert (
        hang == "hang: rank 1 never arrived at allreduce #9 on world, where rank 0 waits (4 MiB float32)"
        and notes[hang] == diagnosis
    )
    assert any(s.x0 == 3 and s.line.color == RED for s in plot.figure.layout.shapes)
    assert [n["kind"] for n in plot.notices] == ["straggler", "hang"]
