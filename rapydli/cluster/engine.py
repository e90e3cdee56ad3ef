"""What runs on an engine (one MPI rank): its set-up, the rank context, and cell execution.

Functions here are shipped to engines by reference (the engine imports ``rapydli``), so
they must stay importable without front-end packages.
"""

from __future__ import annotations

import ast
import importlib
import linecache
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from rapydli.cluster import events, trace, where
from rapydli.cluster.usercode import pickle_classes_by_value, register_cells

__all__ = ["pickle_classes_by_value"]  # shipped to engines from here by Cluster._configure_engines
from rapydli.errors import RapydliError


@dataclass(frozen=True)
class RankContext:
    """The rank's view of the job it is running in.

    Attributes
    ----------
    rank, world_size
        This rank and the size of the group running the task (the selected targets).
    comm
        mpi4py communicator spanning exactly the selected targets.
    device
        ``torch.device``: the local GPU by local rank when present, else the CPU.
    world_rank
        This engine's rank in the cluster's ``COMM_WORLD`` (``rank`` counts within the targets).
    """

    rank: int
    world_size: int
    comm: Any
    device: Any
    world_rank: int


_communicators: dict[tuple[int, ...], Any] = {}
_current: list[RankContext] = []
_local_rank: list[int] = [0]  # set once by setup(); Split_type is collective over all ranks


class _SignalFlag:
    """A flag that signal handlers set: no lock, unlike ``threading.Event``.

    A handler runs in the main thread between two bytecodes of whatever that thread was
    doing; if that was ``Event.wait`` or ``Event.clear`` on the same event, the handler's
    ``Event.set`` waits for the lock its own thread holds, for ever (a trial of a sweep
    stood so, waiting on its verdict, until its cell timed out). A plain attribute is set
    atomically, and :meth:`wait` polls it.
    """

    __slots__ = ("_set",)

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep until the flag is set or ``timeout`` seconds passed (in steps of at most 1 ms); whether it is set."""
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(left, 0.001))
        return self._set


_stop = _SignalFlag()
STOP_SIGNAL = signal.SIGUSR1
_go_on = _SignalFlag()
#: The client's answer "go on" to a report the task waits on (:func:`await_verdict`); a stop
#: request (``STOP_SIGNAL``) is the other answer. SIGWINCH: ignored by default, so one that
#: arrives before the handler is installed does no harm, and SIGUSR2 is the stack dump's
#: (:data:`rapydli.cluster.where.WHERE_SIGNAL`).
GO_ON_SIGNAL = signal.SIGWINCH
VERDICT_POLL_S = 0.005
#: How long rank 0 waits on a verdict before it reminds the client (the answer's signal was lost).
VERDICT_REMIND_S = 2.0


def stop_requested() -> bool:
    """True once the client asked this rank's task to stop (``Job.request_stop``)."""
    return _stop.is_set()


def should_stop(comm: Any = None) -> bool:
    """Whether any rank of the task was asked to stop; the same answer on every rank.

    Call it at a step boundary (the Trainer does, once per step): it is one tiny
    allreduce, and because every rank agrees, they all stop after the same step and no
    rank is left waiting in a collective.
    """
    from mpi4py import MPI

    comm = comm if comm is not None else (context().comm if _current else None)
    flag = int(_stop.is_set())
    if comm is None or comm.Get_size() == 1:
        return bool(flag)
    return bool(comm.allreduce(flag, op=MPI.MAX))


def _on_stop_signal(signum: int, frame: Any) -> None:
    _stop.set()


def _on_go_on_signal(signum: int, frame: Any) -> None:
    _go_on.set()


def expect_verdict() -> None:
    """Forget an earlier "go on": call it before sending the report :func:`await_verdict` waits on."""
    _go_on.clear()


def await_verdict(remind: Callable[[], None] | None = None) -> bool:
    """Block until the client answered the last report: True to stop (``Job.request_stop``), False to go on.

    Used where the client decides on a report before the run may go on (a sweep's pruner
    on a trial's validation row): the ranks then stop within one step of the decision. The
    wait ends with the stop request or with the client's "go on" (``Job.go_on``); Ctrl-C
    (``Job.interrupt``) ends it with ``KeyboardInterrupt`` like any step. ``remind`` is
    called every ``VERDICT_REMIND_S`` the wait lasts: it re-sends the question, so an answer
    whose signal was lost on the way is sent again rather than the run waiting forever.
    """
    reminded = time.monotonic()
    while not (_go_on.is_set() or _stop.is_set()):
        _go_on.wait(VERDICT_POLL_S)
        if (
            remind is not None
            and time.monotonic() - reminded >= VERDICT_REMIND_S
            and not (_go_on.is_set() or _stop.is_set())
        ):
            remind()
            reminded = time.monotonic()
    _go_on.clear()
    return _stop.is_set()


def context() -> RankContext:
    """The context of the task running on this engine (inside :meth:`Cluster.run`)."""
    if not _current:
        raise RapydliError("no RaPyDLI task is running on this process: context() is only set inside Cluster.run")
    return _current[-1]


def setup(threads: int, paths: Sequence[str] = ()) -> dict[str, Any]:
    """Configure the engine and describe it to the client.

    ``threads`` bounds torch/OpenMP threads; ``paths`` are the client's ``sys.path``
    entries, added where they exist on this host, so functions from the notebook's own
    modules (``from mymodel import Net``) unpickle on the engine too. The engine is ready
    when this returns; the client then queues :func:`warm_up` behind it, so the first
    ``rd.train`` on a running cluster does not wait for torch and the trainer to import.
    """
    from mpi4py import MPI

    for path in reversed(paths):
        if path not in sys.path and os.path.isdir(path):
            sys.path.insert(0, path)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch = sys.modules.get("torch")
    if torch is not None and not getattr(
        torch.__spec__, "_initializing", False
    ):  # else torch takes OMP_NUM_THREADS as its import ends
        torch.set_num_threads(threads)
    # a stop request may arrive before a task is fully under way (its first one imports torch):
    # the handler is in place from the start and the request is kept until the task ends
    signal.signal(STOP_SIGNAL, _on_stop_signal)
    signal.signal(GO_ON_SIGNAL, _on_go_on_signal)
    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = local.Get_rank()
    local.Free()
    _local_rank[0] = local_rank
    from rapydli.paths import subdir

    flight = where.install(subdir("flight"), world.Get_rank())  # stacks on a signal, the collective trace
    return {
        "rank": world.Get_rank(),
        "size": world.Get_size(),
        "host": socket.gethostname(),
        "node": os.environ.get("SLURMD_NODENAME", ""),  # the Slurm node, when run by Slurm
        "pid": os.getpid(),
        "helper_pids": _helper_pids(),
        "local_rank": local_rank,
        "threads": threads,
        **flight,
    }


#: What :func:`warm_up` imports: torch, TorchDynamo (every optimizer's constructor imports it:
#: 1.6 s of a Trainer's 1.65 s set-up here) and the trainer.
WARM_MODULES = ("torch", "torch._dynamo", "rapydli.trainer.loop", "rapydli.trainer.task")


def warm_up(modules: Sequence[str] = WARM_MODULES) -> list[str]:
    """Import ``modules`` on this engine now; returns those that imported.

    The client queues it as the engine's first task after :func:`setup` and does not wait
    for it: the engine is ready at once, and a task sent meanwhile runs after it, on the
    same thread. (Importing torch in a second thread beside the engine's own start stalled
    engines on a loaded machine: one never registered, others never answered ``where``.)
    A Ctrl-C while torch imports is held until the import ends
    (:func:`_import_torch`). An import that fails is left to the task that needs it, which
    raises the error where the user sees it.
    """
    imported = []
    for name in modules:
        try:
            _import_torch() if name == "torch" else importlib.import_module(name)
        except Exception:  # noqa: BLE001, S112 - the task importing it raises it in context
            continue
        imported.append(name)
    return imported


def _helper_pids() -> list[int]:
    """Pids of this engine's child processes (ipyparallel's nanny), to be reaped with it on another host."""
    import psutil

    return [child.pid for child in psutil.Process().children()]


def _import_torch() -> Any:
    """torch, imported with Ctrl-C held until the import is done.

    An import cut half-way by SIGINT leaves torch unusable in this process for good
    (every later import fails with "Only a single TORCH_LIBRARY can be used ..."), so a
    Ctrl-C that arrives while the first task imports it is raised once the import ends.
    """
    if "torch" in sys.modules or threading.current_thread() is not threading.main_thread():
        import torch

        return torch
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        import torch
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)
    if held:
        raise KeyboardInterrupt
    return torch


def _device(local_rank: int) -> Any:
    torch = _import_torch()
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def communicator(targets: Sequence[int]) -> Any:
    """A communicator over the world ranks ``targets`` (cached; collective over them only)."""
    from mpi4py import MPI

    key = tuple(targets)
    if key not in _communicators:
        world = MPI.COMM_WORLD
        if key == tuple(range(world.Get_size())):
            _communicators[key] = world
        else:  # MPI-3 Comm_create_group: only the members take part, so disjoint groups can form at once
            group = world.Get_group().Incl(list(key))
            _communicators[key] = world.Create_group(group, tag=hash(key) % 32767)
            group.Free()
    return _communicators[key]


def _enter(targets: Sequence[int], stream_events: bool) -> RankContext:
    from mpi4py import MPI

    comm = communicator(targets)
    ctx = RankContext(
        rank=comm.Get_rank(),
        world_size=comm.Get_size(),
        comm=comm,
        device=_device(_local_rank[0]),
        world_rank=MPI.COMM_WORLD.Get_rank(),
    )
    _current.append(ctx)
    trace.new_task()
    events.enable(stream_events)
    signal.signal(STOP_SIGNAL, _on_stop_signal)
    signal.signal(GO_ON_SIGNAL, _on_go_on_signal)
    return ctx


def _leave() -> None:
    events.send_pending()
    events.enable(False)
    _current.pop()
    _stop.clear()
    _go_on.clear()


def run_task(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    targets: Sequence[int],
    stream_events: bool,
    cells: dict[str, list[str]] | None = None,
) -> Any:
    """Run ``fn(*args, **kwargs)`` with the rank context set (the engine half of ``Cluster.run``).

    ``cells``: the notebook's cell sources, so a traceback through notebook code shows its lines.
    """
    register_cells(cells)
    _enter(targets, stream_events)
    try:
        return fn(*args, **kwargs)
    finally:
        _leave()


def run_cell(code: str, targets: Sequence[int], want_value: bool) -> Any:
    """Execute notebook cell ``code`` in the engine's namespace (the engine half of ``%%distributed``).

    ``rank``, ``world_size``, ``comm`` and ``device`` are defined first, for the group of
    ``targets`` (``rank`` counts within it), and ``world_rank``, this engine's rank in the
    whole cluster (``COMM_WORLD``). IPython syntax
    (magics, ``!cmd``) is transformed as in a notebook. Returns the value of the last
    expression when ``want_value`` (or None), so an unpicklable value never breaks a cell
    whose value nobody asked for.
    """
    from IPython import get_ipython

    shell = get_ipython()
    namespace = shell.user_ns if shell is not None else globals()
    ctx = _enter(targets, stream_events=True)
    try:
        namespace.update(
            rank=ctx.rank, world_size=ctx.world_size, world_rank=ctx.world_rank, comm=ctx.comm, device=ctx.device
        )
        source = shell.transform_cell(code) if shell is not None else code
        linecache.cache.pop("<distributed cell>", None)  # each cell replaces the last one's lines
        register_cells({"<distributed cell>": source.splitlines(keepends=True)})
        tree = ast.parse(source, filename="<distributed cell>")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            expression = tree.body.pop()
            assert isinstance(expression, ast.Expr)
            last = ast.Expression(expression.value)
        exec(compile(tree, "<distributed cell>", "exec"), namespace)  # noqa: S102 - the user's own cell
        if last is None:
            return None
        value = eval(compile(last, "<distributed cell>", "eval"), namespace)  # noqa: S307 - the user's own cell
        return value if want_value else None
    finally:
        _leave()
