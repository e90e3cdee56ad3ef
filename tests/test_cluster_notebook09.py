"""Notebook 09 runs headless under papermill against the local Slurm: 4 engines over 2 nodes."""

from __future__ import annotations

from pathlib import Path

import pytest
from notebooks_run import execute


@pytest.mark.notebook
@pytest.mark.slurm
def test_cluster_notebook_runs_on_two_slurm_nodes(local_slurm, tmp_path: Path) -> None:
    before = set(local_slurm.queue())
    text = execute("09-on-a-cluster.ipynb", tmp_path).text
    assert "rank 0 of 4" in text and "rank 3 of 4" in text
    placed = dict(line.split(" -> ") for line in text.splitlines() if line.startswith("rank ") and " -> " in line)
    assert [placed[f"rank {r}"].split(" ")[-1] for r in range(4)] == ["(n1)", "(n1)", "(n2)", "(n2)"]
    assert "(Slurm node n1)" in text and "(Slurm node n2)" in text
    assert "trained 20 steps on 4 ranks over 2 nodes" in text
    assert "in the queue after stop: no" in text
    assert set(local_slurm.queue()) <= before
