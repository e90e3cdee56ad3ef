"""Provenance recorded with every run: the git commit of the working directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rapydli.experiments.store.provenance import NOT_A_REPOSITORY, git_commit


def test_git_commit_inside_and_outside_a_checkout(tmp_path: Path) -> None:
    outside = tmp_path / "plain"
    outside.mkdir()
    assert git_commit(outside) == NOT_A_REPOSITORY == "not a git repository"

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org"]
    subprocess.run([*git, "init", "-q"], check=True)
    assert git_commit(repo) is None  # a checkout whose branch has no commit yet
    (repo / "f.txt").write_text("x")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    (repo / "sub").mkdir()
    assert git_commit(repo / "sub") == head
