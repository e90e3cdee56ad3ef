"""The README's "On a cluster" examples, executed as written against the local Slurm."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from IPython.utils.capture import capture_output

from rapydli.cluster import Cluster
from rapydli.cluster.registry import stop_cluster

README = Path(__file__).resolve().parents[1] / "README.md"


def cluster_examples() -> list[tuple[str, str]]:
    """``(language, code)`` of each fenced block in the "Slurm" part of the README's "On a cluster"."""
    text = README.read_text()
    section = text.split("\n## On a cluster\n", 1)[1].split("\n## ", 1)[0]
    section = section.split("\n### Slurm\n", 1)[1].split("\n### ", 1)[0]
    return re.findall(r"```(python|bash)\n(.*?)```", section, flags=re.S)


def test_the_section_has_magic_python_and_cli_examples():
    languages = [language for language, _ in cluster_examples()]
    assert languages.count("python") >= 3 and "bash" in languages


@pytest.mark.slurm
def test_readme_cluster_examples_run_as_written(local_slurm, ipython_shell):
    before = set(local_slurm.queue())
    shell = ipython_shell
    try:
        _run_examples(shell)
    finally:  # a failed example leaves no cluster behind for later tests
        for record in Cluster.detached():
            stop_cluster(record["id"])
        if shell.run_line_magic("rapydli", "status").get("state") != "stopped":
            shell.run_line_magic("rapydli", "stop")
    assert set(local_slurm.queue()) <= before


def _run_examples(shell) -> None:
    for language, code in cluster_examples():
        if language == "python":
            with capture_output() as captured:
                result = shell.run_cell(code)
            assert result.success, f"{code}\n{result.error_in_exec or result.error_before_exec}\n{captured.stderr}"
            continue
        for line in code.strip().splitlines():
            argv = line.split("#")[0].split()
            assert argv[0] == "rapydli"
            done = subprocess.run([sys.executable, "-m", "rapydli", *argv[1:]], capture_output=True, text=True,
                                  env=dict(os.environ), timeout=300)  # fmt: skip
            assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
            if argv[1:3] == ["cluster", "status"]:
                assert "slurm" in done.stdout and "RUNNING" in done.stdout
