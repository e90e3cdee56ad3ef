"""Starting a program on N MPI ranks with ``mpiexec``, for benchmarks and tests.

Engines for notebooks are started through ipyparallel (:mod:`rapydli.cluster.cluster`);
this module is for plain SPMD programs (``mpiexec -n N python prog.py``). It finds the
``mpiexec`` that belongs to this Python (the ``mpich`` wheel's, or the site MPI on the
PATH), sets one thread count per rank so ranks do not oversubscribe cores, and never
leaves a rank behind: on a timeout the whole process group is killed.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from rapydli.errors import ClusterError, ConfigError


def find_mpiexec() -> str:
    """Path of ``mpiexec``: the one beside this interpreter first, then the PATH."""
    beside = shutil.which("mpiexec", path=str(Path(sys.executable).parent))
    found = beside or shutil.which("mpiexec")
    if not found:
        raise ClusterError(
            "no mpiexec found beside this Python or on PATH: install the 'mpich' extra "
            "(pip install 'rapydli[mpich]') or load your site's MPI module"
        )
    return found


def threads_per_rank(n: int, cores: int | None = None) -> int:
    """Threads each of ``n`` ranks on one machine should use: cores // n, at least 1."""
    if cores is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // max(1, n))


def rank_environment(n: int, threads: int | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for ranks: ``OMP_NUM_THREADS`` (and MKL's) set to ``threads`` (default cores // n).

    With more ranks than cores, MPICH's busy-polling ranks starve each other (a 3-rank
    job on 2 cores ran 10x slower); heavy yield makes waiting ranks give the core away.
    """
    env = dict(os.environ if base is None else base)
    count = str(threads or threads_per_rank(n))
    env.update({"OMP_NUM_THREADS": count, "MKL_NUM_THREADS": count})
    if n > threads_per_rank(1):
        env.setdefault("MPIR_CVAR_ENABLE_HEAVY_YIELD", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def run(
    argv: Sequence[str],
    n: int,
    *,
    timeout: float | None = None,
    threads: int | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = True,
    cwd: str | os.PathLike[str] | None = None,
    mpi_args: Sequence[str] = (),
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` on ``n`` ranks and wait for it.

    Parameters
    ----------
    argv
        The program and its arguments, e.g. ``[sys.executable, "prog.py"]``.
    n
        Number of ranks (>= 1).
    timeout
        Seconds before every rank is killed and :class:`ClusterError` is raised.
    threads
        Threads per rank; default cores // n.
    env
        Extra environment variables for the ranks.
    capture
        Capture stdout/stderr as text (else they go to this process's).
    mpi_args
        Arguments for ``mpiexec`` before the program, e.g. ``["-hosts", "n1,n2"]``.

    Examples
    --------
    >>> result = run([sys.executable, "-c", "print('hi')"], n=2)  # doctest: +SKIP
    >>> result.stdout.count("hi")  # doctest: +SKIP
    2
    """
    if n < 1:
        raise ConfigError(f"n={n} is invalid: the number of ranks must be >= 1")
    full_env = rank_environment(n, threads)
    full_env.update(env or {})
    command = [find_mpiexec(), "-n", str(n), *mpi_args, *argv]
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(
        command, stdout=pipe, stderr=pipe, text=True, env=full_env, cwd=cwd, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(process)
            stdout, stderr = process.communicate()
            raise ClusterError(
                f"mpiexec -n {n} {' '.join(argv)} did not finish within {timeout} s; all ranks were killed\n"
                f"{(stdout or '')[-4000:]}{(stderr or '')[-4000:]}"
            ) from None
        except BaseException:
            _kill_group(process)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def _kill_group(process: subprocess.Popen[str]) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
