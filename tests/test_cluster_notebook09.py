"""Notebook 09 runs headless under papermill against the local Slurm: 4 engines over 2 nodes.

The one 4-engine Slurm cluster of the suite also carries a sweep (2-rank trials side by
side, one per node), a scaling study that records where each point ran, and
``rapydli cluster status`` showing the kernel's cluster with its job.
"""

from __future__ import annotations

import re
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
    assert re.search(r"^trial 0 on ranks 0,1 -> \S+ \(n1\): COMPLETE", text, re.M), text
    assert re.search(r"^trial 1 on ranks 2,3 -> \S+ \(n2\): COMPLETE", text, re.M), text
    assert "trials ran side by side: yes" in text
    assert re.search(r"^workers=1 on \S+ \(n1\): ", text, re.M) and re.search(r"^workers=2 on \S+ \(n1\): ", text, re.M)
    assert re.search(r"^workers=4 on \S+ \(n1\), \S+ \(n2\): ", text, re.M), text
    job = re.search(r"^job: \{'id': '(\d+)'", text, re.M)
    listed = [line for line in text.splitlines() if job and f"{job.group(1)} RUNNING" in line]
    assert listed and " kernel " in listed[0] and " slurm " in listed[0], (
        text
    )  # `rapydli cluster status`: origin, launcher, job
    assert "in the queue after stop: no" in text
    assert set(local_slurm.queue()) <= before
