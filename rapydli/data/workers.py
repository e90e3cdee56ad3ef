"""Worker processes of the clairvoyant loader: fetch, decode and collate whole batches.

Threads of one process decode under one GIL, and a consumer thread waiting for them
competes for it too; on a CPU-bound workload (a store in the page cache) that makes
prefetch threads slower than PyTorch's ``DataLoader`` worker processes. A
:class:`WorkerPool` runs the loader's fetch in worker processes instead. Each worker
runs a few threads (to keep several reads of a slow store in flight); each thread takes
one batch of the precomputed access stream at a time, fetches its samples through the
loader's shared tiers (:class:`rapydli.data.tiers.SharedTier`) or the dataset, collates
them with PyTorch's default collate, and copies the batch's tensors into a batch slot: one
of a few shared-memory buffers the consumer allocated before the workers started. Only a
small description of the batch (where each tensor lies in its slot) goes through the
result queue, and the consumer copies the slot out once. The ``DataLoader`` instead sends
every batch tensor as a new shared-memory file whose descriptor is passed over a socket,
which costs the consumer far more per batch. A batch larger than a slot is sent that way too.

Workers are started from the platform's default multiprocessing context, as the
``DataLoader`` does; datasets open their files in each worker (an
:class:`~rapydli.data.store.LMDBDataset` never uses a handle it inherited), and every
worker ignores SIGINT so that Ctrl-C reaches the consumer only.
"""

from __future__ import annotations

import math
import os
import pickle
import queue
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.utils.data._utils.collate import default_collate

from rapydli.data.plan import TIERS
from rapydli.errors import RapydliError

#: Seconds between liveness checks of the workers while the consumer waits for a batch.
POLL_S = 1.0


class BatchResult:
    """One batch from a worker: the collated samples and where they came from, or an error.

    ``slot_bytes`` > 0 means the batch's tensors are in the task's slot and ``batch``
    holds :class:`_InSlot` placeholders for them.
    """

    def __init__(self, task: int) -> None:
        self.task = task
        self.batch: Any = None
        self.hits = dict.fromkeys(TIERS, 0)
        self.storage_bytes = 0
        self.slot_bytes = 0
        self.error: BaseException | None = None


class _InSlot:
    """Where a batch tensor lies in its slot."""

    def __init__(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.offset, self.dtype, self.shape = offset, dtype, shape


class _SlotFull(Exception):
    pass


_ALIGN = 64


def _pack(value: Any, slot: torch.Tensor, end: list[int]) -> Any:
    """``value`` with each tensor copied into ``slot`` after ``end[0]`` and replaced by an _InSlot."""
    if isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8)
        offset = -(-end[0] // _ALIGN) * _ALIGN
        if offset + data.numel() > slot.numel():
            raise _SlotFull
        slot[offset : offset + data.numel()].copy_(data)
        end[0] = offset + data.numel()
        return _InSlot(offset, value.dtype, tuple(value.shape))
    if isinstance(value, dict):
        return {key: _pack(item, slot, end) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_pack(item, slot, end) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_pack(item, slot, end) for item in value)
    return value


def _unpack(value: Any, buffer: torch.Tensor) -> Any:
    """The batch ``_pack`` described, its tensors views of ``buffer`` (a copy of the slot)."""
    if isinstance(value, _InSlot):
        size = math.prod(value.shape) * torch.empty(0, dtype=value.dtype).element_size()
        return buffer[value.offset : value.offset + size].view(value.dtype).reshape(value.shape)
    if isinstance(value, dict):
        return {key: _unpack(item, buffer) for key, item in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_unpack(item, buffer) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_unpack(item, buffer) for item in value)
    return value


def fetch_batch(
    task: int, indices: list[int], fetch: Callable[[int], tuple[Any, str, int]], slot: torch.Tensor
) -> BatchResult:
    """Fetch and collate the samples ``indices`` into ``slot`` if they fit; an error is returned, not raised."""
    result = BatchResult(task)
    try:
        samples = []
        for index in indices:
            sample, tier, nbytes = fetch(index)
            result.hits[tier] += 1
            result.storage_bytes += nbytes
            samples.append(sample)
        result.batch = default_collate(samples)
        end = [0]
        try:
            result.batch, result.slot_bytes = _pack(result.batch, slot, end), max(end[0], 1)
        except _SlotFull:  # sent through the queue instead
            pass
    except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
        if hasattr(error, "add_note"):  # Python >= 3.11
            error.add_note(f"(in clairvoyant loader worker process {os.getpid()})")
        result.error = _portable(error)
    return result


def _portable(error: Exception) -> Exception:
    """``error`` if it pickles, else a RapydliError carrying its text."""
    try:
        pickle.dumps(error)
    except Exception:  # noqa: BLE001 - any pickling failure
        return RapydliError(f"{type(error).__name__}: {error}")
    return error


def _work(
    fetch: Callable[[int], tuple[Any, str, int]], slots: list[torch.Tensor], tasks: Any, results: Any, threads: int
) -> None:
    """A worker process: ``threads`` threads turn tasks ``(task, indices, slot)`` into BatchResults."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)

    def serve() -> None:
        while (task := tasks.get()) is not None:
            number, indices, slot = task
            results.put(fetch_batch(number, indices, fetch, slots[slot]))
        tasks.put(None)  # the sibling threads stop too

    helpers = [threading.Thread(target=serve, daemon=True) for _ in range(threads - 1)]
    for thread in helpers:
        thread.start()
    serve()
    for thread in helpers:
        thread.join()


class WorkerPool:
    """``workers`` processes with ``threads`` threads each, serving batch tasks through ``slots`` batch slots.

    At most ``slots`` tasks are submitted and not yet taken (or, if discarded, not yet
    finished); :meth:`submit` waits for a free slot.

    Parameters
    ----------
    fetch
        ``index -> (sample, tier, bytes read from storage)``; called in the workers.
    workers, threads
        Processes, and threads per process.
    slots, slot_bytes
        Number and size of the shared-memory batch slots.
    """

    def __init__(
        self, fetch: Callable[[int], tuple[Any, str, int]], workers: int, threads: int, slots: int, slot_bytes: int
    ) -> None:
        context = mp.get_context()
        self._slots = [torch.empty(slot_bytes, dtype=torch.uint8).share_memory_() for _ in range(slots)]
        self._free = list(range(slots))
        self._slot_of: dict[int, int] = {}  # submitted task -> its slot, until taken or dropped
        self._ready: dict[int, BatchResult] = {}
        self._dropped: set[int] = set()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(workers)]
        self._processes = [
            context.Process(
                target=_work,
                args=(fetch, self._slots, tasks, self._results, threads),
                name=f"rapydli-fetch-{number}",
                daemon=True,
            )
            for number, tasks in enumerate(self._tasks)
        ]
        for process in self._processes:
            process.start()
        self._closed = False

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers."""
        return [p.pid for p in self._processes if p.pid is not None]

    def submit(self, task: int, indices: list[int]) -> None:
        """Queue batch ``task`` (the samples ``indices``); tasks go round-robin to the workers."""
        while not self._free:
            self._receive()
        self._slot_of[task] = slot = self._free.pop()
        self._tasks[task % len(self._tasks)].put((task, indices, slot))

    def result(self, task: int) -> BatchResult:
        """Batch ``task``, once finished (its tensors copied out of its slot); RapydliError if a worker died."""
        while task not in self._ready:
            self._receive()
        result = self._ready.pop(task)
        slot = self._slot_of.pop(task)
        if result.slot_bytes:  # numpy copies in this thread (a torch copy this large wakes its thread pool)
            result.batch = _unpack(
                result.batch, torch.from_numpy(self._slots[slot][: result.slot_bytes].numpy().copy())
            )
        self._free.append(slot)
        return result

    def discard(self) -> None:
        """Drop every submitted task not taken yet; their slots are free once they finish."""
        for task in self._ready:
            self._free.append(self._slot_of.pop(task))
        self._ready.clear()
        self._dropped.update(self._slot_of)

    def _receive(self) -> None:
        result = self._next_result()
        if result.task in self._dropped:
            self._dropped.discard(result.task)
            self._free.append(self._slot_of.pop(result.task))
        else:
            self._ready[result.task] = result

    def _next_result(self) -> BatchResult:
        while True:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
            except (OSError, EOFError) as error:  # a batch in shared memory whose sender died
                self._check_alive(grace_s=5.0)
                self.close()
                raise RapydliError(
                    f"a batch from the clairvoyant loader's workers could not be received: {error}"
                ) from error

    def _check_alive(self, grace_s: float = 0.0) -> None:
        """Stop all and raise RapydliError if a worker has exited (waiting up to ``grace_s`` for one to)."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [p for p in self._processes if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if dead:
            self.close()
            raise RapydliError(
                f"clairvoyant loader worker {dead[0].name} (pid {dead[0].pid}) exited unexpectedly "
                f"with code {dead[0].exitcode}"
            )

    def close(self) -> None:
        """Stop the workers and wait for them (terminating those that do not stop in 5 s)."""
        if self._closed:
            return
        self._closed = True
        for tasks, process in zip(self._tasks, self._processes):
            if process.is_alive():
                tasks.put(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join()
        for channel in (*self._tasks, self._results):
            channel.cancel_join_thread()
            channel.close()
