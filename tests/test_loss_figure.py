"""The loss figure of a restarted run (#27): every step kept, the restart marked."""

from __future__ import annotations

import pandas as pd

from rapydli.experiments.figures import loss_figure


def test_a_restarted_runs_loss_figure_keeps_every_step_and_marks_the_restart() -> None:
    # the history rd.train returns after a restart: the first attempt's steps up to the checkpoint, then the resumed ones
    rows = [{"kind": "train", "step": s, "loss": 1.0 / s} for s in range(1, 7)] + [
        {"kind": "eval", "step": 6, "val_loss": 0.2}
    ]
    restarts = [{"resumed_from_step": 3, "cause": "RankFailure: rank 1 died", "ranks": [1]}]
    figure = loss_figure(pd.DataFrame(rows), title="run", restarts=restarts)
    train = next(trace for trace in figure.data if trace.name == "train loss")
    assert list(train.x) == [1, 2, 3, 4, 5, 6]
    (mark,) = figure.layout.shapes
    assert mark.x0 == mark.x1 == 3 and mark.line.dash == "dash"
    assert [a.text for a in figure.layout.annotations] == ["restart"]
    assert not loss_figure(pd.DataFrame(rows)).layout.shapes  # a run without restarts: no mark
