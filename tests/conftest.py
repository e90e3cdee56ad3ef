"""Shared fixtures: an isolated RAPYDLI_HOME, and running code on real MPI ranks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from rapydli.cluster import mpirun

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="session")
def rapydli_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test session gets its own run store; nothing touches ~/.rapydli."""
    home = tmp_path_factory.mktemp("rapydli-home")
    os.environ["RAPYDLI_HOME"] = str(home)
    return home


@pytest.fixture(scope="session")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    """Two real hosts, ``h1`` and ``h2`` (network namespaces with an sshd each; see ``nshosts``).

    Up once per test session, torn down at its end; skipped, with the reason, where they
    cannot exist (not root, no packages, no network namespaces).
    """
    import nshosts

    try:
        started = nshosts.up(tmp_path_factory.mktemp("hosts"))
    except nshosts.Unavailable as exc:
        pytest.skip(str(exc))
    yield started
    nshosts.down(started)


MpiRunner = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def run_mpi(tmp_path: Path) -> MpiRunner:
    """Run a Python snippet on ``n`` real MPI ranks; fail the test with its output if it fails.

    ``run_mpi(code, n=2, timeout=120, check=True, env=None)`` writes ``code`` (dedented)
    to a file and runs it with ``mpiexec -n n python -m mpi4py``: an uncaught exception on
    one rank aborts the whole job rather than leaving the others blocked in a collective.
    Returns the CompletedProcess.
    """

    def run(code: str, n: int = 2, timeout: float = 120, check: bool = True, env: dict | None = None):
        script = tmp_path / f"mpi_snippet_{n}.py"
        script.write_text(textwrap.dedent(code))
        result = mpirun.run([sys.executable, "-m", "mpi4py", str(script)], n=n, timeout=timeout, env=env, threads=1, cwd=tmp_path)
        if check and result.returncode != 0:
            pytest.fail(f"mpiexec -n {n} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    return run
