"""The Makefile's two commands: `make demo` installs what the demo runs on, `make test` adds the test tools."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
TEST_TOOLS = ("triton", "playwright", "mypy", "ruff", "pytest")


def _installs(target: str, tmp_path: Path) -> list[str]:
    """The extras of each ``pip install -e '.[...]'`` that ``make -n TARGET`` would run on a fresh venv."""
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    dry = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}", "PYTHON=true"], cwd=ROOT,
                         capture_output=True, text=True, check=True)  # fmt: skip
    return re.findall(r"install -q -e '\.\[([a-z,]*)\]'", dry.stdout)


def _requirements(extras: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"])
    for extra in filter(None, extras.split(",")):
        wanted += project["optional-dependencies"][extra]
    return {re.split(r"[<>=!\[ ;]", req, maxsplit=1)[0].lower() for req in wanted}


def test_demo_installs_the_runtime_and_mpich_only(tmp_path: Path) -> None:
    installs = _installs("demo", tmp_path)
    assert installs == ["mpich"], installs
    assert not _requirements(installs[0]) & set(TEST_TOOLS)


def test_test_adds_the_test_extra(tmp_path: Path) -> None:
    installs = _installs("test", tmp_path)
    assert installs[-1] == "mpich,test", installs
    assert set(TEST_TOOLS) <= _requirements(installs[-1])
