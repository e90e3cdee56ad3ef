"""Notebook 03 (live training, the hyperparameter panel, a pruned 2-rank sweep, the sweep panel) runs headless."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
@pytest.mark.engines
def test_hyperparameters_and_sweeps_notebook(tmp_path: Path) -> None:
    executed = execute("03-hyperparameters-and-sweeps.ipynb", tmp_path)
    text = executed.text
    assert "run 1 finished after" in text
    assert "TrainConfig.momentum=1.0 is invalid" in text  # shown by the panel, not raised
    assert "stopped after" in text and "every rank stopped early: True" in text
    assert "'PRUNED'" in text and "best parameters: {'lr': 0.01" in text
    logdir = Path(re.search(r"tensorboard --logdir (\S+)", text)[1])  # the sweep in TensorBoard: a folder per trial
    assert len([trial for trial in logdir.iterdir() if list(trial.glob("events.out.tfevents.*"))]) == 4
    figures = executed.figures
    assert len(figures) >= 4  # live training plot (as a static figure), panel plot, sweep, sweep panel
