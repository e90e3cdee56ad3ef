"""rapydli.parallel.timeline and memory: spans, bubble, the Gantt figure; activation bytes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rapydli.parallel import schedules
from rapydli.parallel.memory import ActivationMeter
from rapydli.parallel.timeline import Recorder, bubble, figure, figure_from_events


def simulated_spans(name: str, p: int, m: int, t_f: float, t_b: float) -> list[list[tuple[str, int, float, float]]]:
    sim = schedules.simulate(schedules.build(name, p, m), t_f, t_b)
    return [[(a.kind, a.microbatch, s, e) for a, s, e in spans] for spans in sim.spans]


@pytest.mark.parametrize("name", list(schedules.SCHEDULES))
def test_the_bubble_of_an_ideal_run_is_the_theory(name: str) -> None:
    for p, m in ((2, 1), (2, 4), (4, 8)):
        overall, per_rank = bubble(simulated_spans(name, p, m, 1.0, 2.0))
        assert overall == pytest.approx(schedules.bubble_fraction(p, m))
        assert per_rank == pytest.approx([schedules.bubble_fraction(p, m)] * p)


def test_the_gradient_allreduce_after_the_pipeline_is_not_part_of_its_bubble() -> None:
    """The title of the timeline and notebook 08's text give one number: the pipeline part's idle fraction."""
    spans = simulated_spans("1f1b", 2, 4, 1.0, 2.0)
    end = max(e for rank in spans for *_, e in rank)
    with_allreduce = [[*rank, ("allreduce", -1, end, end + 5.0)] for rank in spans]
    assert bubble(with_allreduce) == bubble(spans)
    assert f"bubble measured {bubble(spans)[0]:.1%}" in figure(with_allreduce, "1f1b", 4).layout.title.text


def test_figure_has_a_row_per_rank_the_ideal_overlay_and_both_bubbles() -> None:
    spans = simulated_spans("1f1b", 3, 4, 0.010, 0.020)
    fig = figure(spans, "1f1b", 4)
    assert {y for bar in fig.data for y in bar.y} == {"rank 0", "rank 1", "rank 2"}
    (ideal,) = [bar for bar in fig.data if bar.name == "ideal"]
    assert len(ideal.x) == 3 * 4 * 2  # every forward and backward of every stage
    forward = next(bar for bar in fig.data if bar.name == "forward")
    assert len(forward.x) == 3 * 4 and list(forward.hovertext[:2]) == ["forward(0)", "forward(1)"]
    assert not any(len(bar.x) for bar in fig.data if bar.name == "allreduce")  # no replicas: no allreduce spans
    assert "bubble measured 33.3%, theory 33.3%" in fig.layout.title.text
    # replica 1's stages are world ranks 3-5: the rows say so
    events = {
        3 + r: {"rank": 3 + r, "replica": 1, "stage": r, "step": 5, "spans": s, "schedule": "1f1b", "microbatches": 4}
        for r, s in enumerate(spans)
    }
    drawn = figure_from_events(events, replica=1)
    assert "step 5" in drawn.layout.title.text and list(drawn.layout.yaxis.categoryarray) == [
        "rank 3",
        "rank 4",
        "rank 5",
    ]
    with pytest.raises(ValueError, match="no timeline of replica 0"):
        figure_from_events(events, replica=0)


def test_recorder_keeps_the_last_steps() -> None:
    recorder = Recorder(keep=2)
    for step in range(4):
        recorder.begin_step(step)
        recorder.span("forward", 0, step, step + 0.5)
    assert sorted(recorder.steps) == [2, 3]
    assert recorder.of_step(3) == [("forward", 0, 3, 3.5)]
    assert recorder.of_step(0) == []
    quiet = Recorder(enabled=False)
    quiet.begin_step(0)
    quiet.span("forward", 0, 0.0, 1.0)
    assert quiet.steps == {}


def test_activation_meter_counts_what_backward_frees_and_not_the_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    with ActivationMeter(model.parameters()) as meter:
        loss = model(torch.randn(16, 32)).sum()
        held = meter.live
        loss.backward()
    assert held > 0 and meter.live == 0 and meter.peak == held
    # input (16x32) + tanh output (16x64) + the second linear's input is tanh's output: shared storage
    assert held == 16 * 32 * 4 + 16 * 64 * 4


def test_step_memory_refuses_a_tensor_parallel_config() -> None:
    from rapydli.errors import ConfigError
    from rapydli.parallel.memory import step_memory
    from rapydli.trainer.config import TrainConfig

    config = TrainConfig(tensor_parallel=2, workers=2)
    with pytest.raises(ConfigError, match="tensor_parallel=2 is not measured"):
        step_memory(nn.Linear(4, 2), config, [(torch.zeros(4), 0)] * 4, world=object())
