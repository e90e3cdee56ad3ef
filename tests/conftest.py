"""Shared fixtures: an isolated RAPYDLI_HOME, running code on real MPI ranks, a real local Slurm."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest
from local_slurm import LocalSlurm, SlurmUnavailable

from rapydli.cluster import mpirun

ROOT = Path(__file__).resolve().parents[1]


#: What a machine has one of: the namespace hosts (their lock is machine-wide), the local
#: Slurm's node names, the browser tests' JupyterLab. Under ``pytest -n N --dist loadfile``
#: (``make test``) the test files using any of them run in one worker, one after another.
_ONE_PER_MACHINE_MARKERS = {"hosts", "slurm", "browser"}
_ONE_PER_MACHINE_FIXTURES = {"hosts", "local_slurm"}
ONE_PER_MACHINE_FILES = frozenset({
    "test_batchhosts.py", "test_batchslurm.py", "test_cluster_hosts.py", "test_cluster_notebook09.py", "test_cluster_slurm.py",
    "test_cluster_where.py", "test_cluster_where_remote.py", "test_lab_browser.py", "test_lab_clusters.py", "test_notebook.py",
    "test_readme_cluster.py", "test_storefs.py", "test_train_restarts.py",
})  # fmt: skip


def _uses_one_per_machine(item: pytest.Item) -> bool:
    marks = {mark.name for mark in item.iter_markers()}
    return bool(_ONE_PER_MACHINE_MARKERS & marks or _ONE_PER_MACHINE_FIXTURES & set(getattr(item, "fixturenames", ())))


#: Test files whose tests time kernels against each other (the autotuner): all marked ``alone``,
#: so ``make test`` runs them after the parallel part, with nothing beside them (beside other
#: workers their searches took other paths and their budgets ran out early).
ALONE_FILE_PREFIX = "test_autotune_"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of :data:`ALONE_FILE_PREFIX` files ``alone``; refuse a test that uses what the machine
    has one of from a file not in :data:`ONE_PER_MACHINE_FILES` (in two workers at once it would wait for
    the other's hosts for ever)."""
    for item in items:
        if item.path.name.startswith(ALONE_FILE_PREFIX):
            item.add_marker(pytest.mark.alone)
    strays = sorted({item.path.name for item in items if _uses_one_per_machine(item)} - ONE_PER_MACHINE_FILES)
    if strays:
        raise pytest.UsageError(
            f"tests/conftest.py: add {', '.join(strays)} to ONE_PER_MACHINE_FILES: they use namespace hosts, the "
            "local Slurm or the browser, which two pytest-xdist workers cannot share"
        )


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile``, with every file of :data:`ONE_PER_MACHINE_FILES` in one scope (one worker, in turn)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class OnePerMachineScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "one-per-machine" if Path(path).name in ONE_PER_MACHINE_FILES else path

    return OnePerMachineScheduling(config, log)


@pytest.fixture(autouse=True, scope="session")
def rapydli_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every test session gets its own run store; nothing touches ~/.rapydli."""
    home = tmp_path_factory.mktemp("rapydli-home")
    os.environ["RAPYDLI_HOME"] = str(home)
    return home


@pytest.fixture(autouse=True, scope="session")
def no_cluster_process_left(rapydli_home: Path):
    """At the end of the session, no process of a cluster this session started is alive.

    Clusters the session still holds are stopped first (as at interpreter exit); then
    every process carrying a cluster marker and this session's ``RAPYDLI_HOME`` must be
    gone, whoever its parent is (a nanny re-parented to init counts). Leftovers are
    ended and reported with the test that started them, failing the session.
    """
    yield
    import time

    from processes import session_cluster_pids

    from rapydli.cluster.processes import CLUSTER_MARKER, reap_marked

    if "rapydli.cluster.cluster" in sys.modules:  # no cluster was made without it
        from rapydli.cluster.cluster import current

        stopped: set[int] = set()
        while (held := current()) is not None and id(held) not in stopped:
            stopped.add(id(held))
            held.stop()
    deadline = time.monotonic() + 15
    while session_cluster_pids() and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [_describe(pid) for pid in sorted(session_cluster_pids())]
    if left:
        for cluster_id in {entry[CLUSTER_MARKER] for entry in left if entry[CLUSTER_MARKER]}:
            reap_marked(cluster_id, grace=1.0)
        lines = "\n".join(
            f"  pid {e['pid']} {e['cmdline']} (cluster {e[CLUSTER_MARKER]}, started in {e['test']})" for e in left
        )
        pytest.fail(f"processes of this session's clusters outlived it:\n{lines}")


def _describe(pid: int) -> dict[str, str]:
    """A leftover process: its command line, cluster id and the test that was running when it started."""
    import psutil

    from rapydli.cluster.processes import CLUSTER_MARKER

    try:
        proc = psutil.Process(pid)
        env, command = proc.environ(), " ".join(proc.cmdline())[:160]
    except psutil.Error:
        env, command = {}, "(gone)"
    return {
        "pid": str(pid),
        "cmdline": command,
        CLUSTER_MARKER: env.get(CLUSTER_MARKER, ""),
        "test": env.get("PYTEST_CURRENT_TEST", "?"),
    }


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


@pytest.fixture(scope="session")
def ipython_shell():
    """The one global IPython shell of the test session, with ``rapydli`` loaded.

    ``start_ipython()`` makes the shell on its first call and answers None after it, so
    every test that needs a shell takes it from here.
    """
    from IPython import get_ipython
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython() or get_ipython()
    shell.run_line_magic("load_ext", "rapydli")
    return shell


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
        result = mpirun.run(
            [sys.executable, "-m", "mpi4py", str(script)], n=n, timeout=timeout, env=env, threads=1, cwd=tmp_path
        )
        if check and result.returncode != 0:
            pytest.fail(f"mpiexec -n {n} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return result

    return run


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory: pytest.TempPathFactory) -> LocalSlurm:
    """A real Slurm 22.05 with nodes ``n1`` and ``n2`` on this machine, for the whole session.

    Installs Debian's packages when missing (root and apt needed; skipped with the reason
    otherwise), sets ``SLURM_CONF`` for this process and everything it starts, and ends
    the daemons by pid afterwards. See ``tests/local_slurm.py``.
    """
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="rapydli-slurm-"))  # not under pytest's 0700 tmp: munged must reach it
    slurm = LocalSlurm(root)
    try:
        slurm.up()
    except SlurmUnavailable as exc:
        pytest.skip(f"no local Slurm: {exc}")
    previous = os.environ.get("SLURM_CONF")
    os.environ.update(slurm.environ())
    yield slurm
    slurm.down()
    if previous is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = previous
