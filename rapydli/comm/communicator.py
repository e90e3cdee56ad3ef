"""The :class:`Communicator`: in-place collectives on torch tensors over MPI.

Blocking calls run in the caller's thread on the MPI communicator given. Asynchronous
calls (``iallreduce_``, ``ireduce_scatter_``) run on a background communication thread, over a duplicate of
that communicator, in submission order; the thread makes MPI progress while the caller
computes (MPI itself progresses non-blocking collectives only inside MPI calls). This
needs ``MPI.THREAD_MULTIPLE`` (mpi4py's default). With ``THREAD_SERIALIZED`` every MPI
call of the communicator goes through the thread; below that there is no thread and
``iallreduce_`` completes before it returns (``comm.progress`` says which).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rapydli.cluster import trace
from rapydli.comm.base import Algorithm, check_algorithm, create_algorithm, node_rank
from rapydli.comm.handle import (
    CommThread,
    CompletedHandle,
    Handle,
    ThreadHandle,
    WorkHandle,
)
from rapydli.comm.tensors import OPS, check_op, finish_avg, flat_view
from rapydli.errors import ConfigError
from rapydli.settings import settings

if TYPE_CHECKING:
    from mpi4py import MPI

    from rapydli.comm.auto import AutoTable
    from rapydli.comm.shm import SharedBuffers


class Communicator:
    """Collectives on torch tensors over an mpi4py communicator.

    Parameters
    ----------
    mpi_comm
        The mpi4py communicator (default ``MPI.COMM_WORLD``). Construction is collective.
    algorithm
        Default allreduce algorithm: ``"auto"``, ``"mpi"``, ``"ring"``, ``"gloo"``,
        ``"nccl"``, ``"shm"`` (see :func:`rapydli.comm.base.algorithm_names`).

    Examples
    --------
    >>> comm = Communicator(algorithm="ring")  # doctest: +SKIP
    >>> t = torch.full((5,), float(comm.rank))  # doctest: +SKIP
    >>> comm.allreduce_(t, op="avg")  # doctest: +SKIP
    >>> handle = comm.iallreduce_(t); handle.wait()  # doctest: +SKIP
    """

    def __init__(self, mpi_comm: MPI.Comm | None = None, algorithm: str = "auto") -> None:
        check_algorithm(algorithm)
        from mpi4py import MPI

        from rapydli.comm.waiting import (
            Pace,  # imports MPI: only after the name was checked
        )

        self.mpi_comm: MPI.Comm = mpi_comm if mpi_comm is not None else MPI.COMM_WORLD
        self.rank: int = self.mpi_comm.Get_rank()
        self.world_size: int = self.mpi_comm.Get_size()
        self.algorithm: str = algorithm
        self.thread_level: int = MPI.Query_thread()
        if self.thread_level >= MPI.THREAD_MULTIPLE:
            self.progress = "thread"
        elif self.thread_level >= MPI.THREAD_SERIALIZED:
            self.progress = "serialized"
        else:
            self.progress = "none"
        self._async_comm: MPI.Comm = self.mpi_comm.Dup() if self.progress == "thread" else self.mpi_comm
        #: the communication thread waits politely (tests + sleeps) while the caller computes
        self.polite: bool = settings().comm_wait == "polite"
        self._pace = Pace(polite=self.polite)
        self._thread: CommThread | None = CommThread(self._pace) if self.progress != "none" else None
        self._algorithms: dict[str, tuple[Algorithm, Algorithm]] = {}
        #: (id(tensor), op, algorithm) -> (weak reference, data_ptr, numel, prepared call, divide
        #: for avg afterwards): the fast path of a repeated ``allreduce_`` on the same buffer
        self._plans: dict[tuple[int, str, str], tuple[weakref.ref, int, int, Callable[[], object], bool]] = {}
        #: ranks of this communicator on this node: ``auto`` sends CUDA tensors to ``nccl`` only when each has a GPU of its own
        self.node_size: int = node_rank(self.mpi_comm)[1]
        self._get(algorithm)
        #: the group's name in the collective trace (:mod:`rapydli.cluster.trace`)
        self._group: str = trace.group_label(self.mpi_comm)

    # -- properties -----------------------------------------------------------------

    @property
    def auto_table(self) -> AutoTable | None:
        """The measurement ``auto`` decides by (None unless ``auto`` has been used)."""
        pair = self._algorithms.get("auto")
        return getattr(pair[0], "table", None) if pair else None

    @property
    def _shared(self) -> SharedBuffers | None:
        """The node-shared buffers of :meth:`host_buffer` (None before the ``shm`` algorithm exists)."""
        pair = self._algorithms.get("shm")
        return pair[0].buffers if pair else None  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, world_size={self.world_size}, algorithm={self.algorithm!r})"

    # -- collectives ----------------------------------------------------------------

    def allreduce_(self, tensor: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> torch.Tensor:
        """Reduce ``tensor`` across ranks in place and return it.

        Parameters
        ----------
        tensor
            A contiguous tensor of a supported dtype (non-contiguous: :class:`ConfigError`).
        op
            ``"sum"``, ``"avg"``, ``"max"`` or ``"min"``. ``avg`` on integer tensors uses
            floor division.
        algorithm
            Override the communicator's default algorithm for this call.
        """
        plan = self._plans.get((id(tensor), op, self.algorithm if algorithm is None else algorithm))
        if (
            plan is not None
            and plan[0]() is tensor
            and tensor.data_ptr() == plan[1]
            and tensor.numel() == plan[2]
            and tensor.is_contiguous()
        ):
            self._traced("allreduce", tensor, plan[3])  # the same memory as last time: nothing re-checked or converted
            if plan[4]:
                finish_avg(tensor, self.world_size)
            return tensor
        if self.progress == "serialized":
            return self.iallreduce_(tensor, op, algorithm).wait()
        flat, name, op = self._prepare(tensor, op, algorithm)
        algo = self._get(name)[0]
        self._traced("allreduce", flat, lambda: self._run(algo, flat, op))
        if not flat.is_cuda:
            self._remember(tensor, flat, op, self.algorithm if algorithm is None else algorithm, algo)
        return tensor

    def iallreduce_(self, tensor: torch.Tensor, op: str = "sum", algorithm: str | None = None) -> Handle:
        """Start an in-place allreduce of ``tensor``; returns a :class:`Handle` (``wait()``, ``test()``).

        Do not read or write ``tensor`` before ``wait()`` returns. Every rank must start
        its asynchronous collectives in the same order.
        """
        flat, name, op = self._prepare(tensor, op, algorithm)
        main, asynchronous = self._get(name)
        chosen = asynchronous.choose(flat)
        if asynchronous.native_async and flat.device.type in asynchronous.device_types:
            then = (lambda: finish_avg(flat, self.world_size)) if op == "avg" else None
            handle: Handle = asynchronous.iallreduce_(flat, op)
            assert isinstance(handle, WorkHandle)
            handle.tensor, handle.then = tensor, then
            return handle
        if self._thread is None:
            start = time.perf_counter()
            self._traced("allreduce", flat, lambda: self._run(main, flat, op))
            return CompletedHandle(tensor, chosen, start, time.perf_counter())
        return self._thread.submit(
            ThreadHandle(
                tensor, chosen, lambda: self._traced("allreduce", flat, lambda: self._run(asynchronous, flat, op))
            )
        )

    def ireduce_scatter_(self, tensor: torch.Tensor, out: torch.Tensor, op: str = "sum") -> Handle:
        """Start ``MPI.Reduce_scatter_block``: ``out`` gets this rank's block of the ranks' reduced ``tensor``.

        ``tensor`` (contiguous, ``world_size * out.numel()`` elements) is cut into
        ``world_size`` equal blocks; rank ``r``'s ``out`` receives block ``r`` reduced over
        every rank (``"sum"`` or ``"avg"``). Runs on the communication thread like
        :meth:`iallreduce_`; do not touch either tensor before ``wait()`` returns.
        """
        if op not in ("sum", "avg"):
            raise ConfigError(f"op={op!r} is invalid for a reduce-scatter: one of 'sum', 'avg'")
        if tensor.numel() != out.numel() * self.world_size or not tensor.is_contiguous() or not out.is_contiguous():
            raise ConfigError(
                f"reduce-scatter of {tensor.numel()} elements into {out.numel()} per rank on {self.world_size} ranks: "
                "both must be contiguous and the input world_size times the output"
            )
        from mpi4py import MPI

        comm = self._async_comm if self._thread is not None else self.mpi_comm

        def work() -> None:
            token = trace.begin("reduce_scatter", self._group, tensor.numel() * tensor.element_size(), _dtype(tensor))
            try:
                scatter()
            finally:
                trace.end(token)

        def scatter() -> None:
            source = tensor.detach().cpu()
            target = out if out.device.type == "cpu" else torch.empty_like(out, device="cpu")
            comm.Reduce_scatter_block(source.numpy(), target.numpy(), op=MPI.SUM)
            if op == "avg":
                target /= self.world_size
            if target is not out:
                out.copy_(target)

        if self._thread is None:
            started = time.perf_counter()
            work()
            return CompletedHandle(out, "reduce_scatter", started, time.perf_counter())
        return self._thread.submit(ThreadHandle(out, "reduce_scatter", work))

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Copy ``root``'s ``tensor`` into ``tensor`` on every rank, in place; returns it."""
        if not 0 <= root < self.world_size:
            raise ConfigError(f"root={root} is invalid: it must be a rank in [0, {self.world_size - 1}]")
        flat = flat_view(tensor)
        algo = self._get(self.algorithm)[0]
        if flat.device.type not in algo.device_types:
            algo = self._get("mpi")[0] if flat.device.type == "cpu" else algo
        if flat.device.type in algo.device_types:
            self._traced("broadcast", flat, lambda: self._call(lambda: algo.broadcast_(flat, root)))
        else:  # device tensor, host algorithm: stage through host memory
            host = flat.cpu()
            self._traced("broadcast", flat, lambda: self._call(lambda: algo.broadcast_(host, root)))
            flat.copy_(host)
        return tensor

    def host_buffer(self, numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A zeroed 1-D CPU tensor meant to be reduced again and again (collective).

        Every rank must call it in the same order with the same ``numel`` and ``dtype``.
        When all ranks run on this node the tensor lives in memory they share, and ``auto``
        reduces it without messages (:mod:`rapydli.comm.shm`: 2.4x faster than MPI's
        ``Allreduce`` on a 7.4 MB gradient bucket on 2 ranks); otherwise it is ordinary
        numpy-allocated memory. Other algorithms reduce it as any tensor.
        """
        return self._get("shm")[0].buffers.zeros(numel, dtype)  # type: ignore[attr-defined]

    def barrier(self) -> None:
        """Block until every rank has called ``barrier()``."""
        token = trace.begin("barrier", self._group)
        try:
            self._call(self.mpi_comm.Barrier)
        finally:
            trace.end(token)

    def tune(self, max_bytes: int | None = None, force: bool = True) -> AutoTable:
        """Measure ``mpi``, ``ring`` and ``shm`` for ``auto`` and cache it (collective); returns the table."""
        from rapydli.comm import auto

        table = auto.tune(self.mpi_comm, max_bytes or auto.QUICK_MAX_BYTES, force=force)
        self._plans.clear()  # auto's choices may have changed
        if "auto" in self._algorithms:
            for algo in self._algorithms["auto"]:
                algo.table = table  # type: ignore[attr-defined]
        else:
            self._add("auto", auto.AutoAlgorithm(self.mpi_comm, table))
        return table

    def close(self) -> None:
        """Finish queued work, stop the communication thread and free the duplicate communicator."""
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        if self._async_comm is not self.mpi_comm:
            self._async_comm.Free()
            self._async_comm = self.mpi_comm

    # -- internals ------------------------------------------------------------------

    def _prepare(self, tensor: torch.Tensor, op: str, algorithm: str | None) -> tuple[torch.Tensor, str, str]:
        if op not in _OPS:
            check_op(op)
        name = self.algorithm if algorithm is None else algorithm
        if name not in self._algorithms:
            check_algorithm(name)
        flat = flat_view(tensor)
        if flat.is_cuda:
            if name == "auto" and self._nccl_usable():
                name = "nccl"
        elif name == "auto" and (shared := self._shared) is not None and shared.views(flat) is not None:
            name = "shm"  # a host_buffer(): reduced through the memory the ranks share
        elif name == "nccl":
            raise ConfigError("algorithm='nccl' reduces CUDA tensors only; use 'auto', 'mpi' or 'ring' for CPU tensors")
        return flat, name, op

    def _remember(self, tensor: torch.Tensor, flat: torch.Tensor, op: str, name: str, algo: Algorithm) -> None:
        """Keep ``algo``'s shortcut for the next ``allreduce_`` of this tensor (dropped when it dies)."""
        call = algo.prepare(flat, op)
        if call is None:
            return
        key, plans = (id(tensor), op, name), self._plans
        reference = weakref.ref(tensor, lambda _: plans.pop(key, None))
        plans[key] = (reference, flat.data_ptr(), flat.numel(), call, op == "avg" and not algo.averages_for(flat))

    def _nccl_usable(self) -> bool:
        import torch.distributed as dist

        return (
            torch.cuda.is_available()
            and dist.is_available()
            and dist.is_nccl_available()
            and self.node_size <= torch.cuda.device_count()
        )

    def _get(self, name: str) -> tuple[Algorithm, Algorithm]:
        """(algorithm over the main communicator, the same over the asynchronous one); built once."""
        if name not in self._algorithms:
            self._add(name, create_algorithm(name, self.mpi_comm))
        return self._algorithms[name]

    def _add(self, name: str, algo: Algorithm) -> None:
        """Keep ``algo`` and its twin over the asynchronous communicator; ``auto``'s ``shm`` serves as ours."""
        self._algorithms[name] = pair = (algo, algo.bind(self._async_comm, self._pace))
        if name == "auto" and "shm" not in self._algorithms:
            self._algorithms["shm"] = (pair[0].shm, pair[1].shm)  # type: ignore[attr-defined]

    def _run(self, algo: Algorithm, flat: torch.Tensor, op: str) -> None:
        """Allreduce ``flat`` with ``algo`` (staging device memory through the host if needed), then ``avg``."""
        if not flat.is_cuda or "cuda" in algo.device_types:
            algo.allreduce_(flat, op)
        else:
            host = flat.cpu()
            algo.allreduce_(host, op)
            flat.copy_(host)
        if op == "avg" and not algo.averages_for(flat):
            finish_avg(flat, self.world_size)

    def _traced(self, kind: str, tensor: torch.Tensor, call: Callable[[], object]) -> None:
        """``call()``, recorded in the collective trace as a ``kind`` of ``tensor``."""
        if not trace.recording():
            call()
            return
        token = trace.begin(kind, self._group, tensor.numel() * tensor.element_size(), _dtype(tensor))
        try:
            call()
        finally:
            trace.end(token)

    def _call(self, function) -> None:
        """Run an MPI call here, or on the communication thread under ``THREAD_SERIALIZED``."""
        if self.progress == "serialized" and self._thread is not None:
            self._thread.submit(ThreadHandle(torch.empty(0), "call", function)).wait()
        else:
            function()


_OPS = frozenset(OPS)


_DTYPES: dict[torch.dtype, str] = {}


def _dtype(tensor: torch.Tensor) -> str:
    name = _DTYPES.get(tensor.dtype)
    if name is None:
        name = _DTYPES[tensor.dtype] = str(tensor.dtype).removeprefix("torch.")
    return name
