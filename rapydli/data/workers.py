"""Worker processes of the clairvoyant loader: fetch, decode and collate whole batches.

Threads of one process decode under one GIL, and a consumer thread waiting for them
competes for it too; on a CPU-bound workload (a store in the page cache) that makes
prefetch threads slower than PyTorch's ``DataLoader`` worker processes. A
:class:`WorkerPool` runs the loader's fetch in worker processes instead. Each worker
runs a few threads (to keep several reads of a slow store in flight); each thread takes
one batch of the precomputed access stream at a time, fetches its samples through the
loader's shared tiers (:class:`rapydli.data.tiers.SharedTier`) or the dataset, collates
them with PyTorch's default collate, and sends the batch back through a
``torch.multiprocessing`` queue (tensors travel in shared memory, as the ``DataLoader``
sends them).

Workers are started from the platform's default multiprocessing context, as the
``DataLoader`` does; datasets open their files in each worker (an
:class:`~rapydli.data.store.LMDBDataset` never uses a handle it inherited), and every
worker ignores SIGINT so that Ctrl-C reaches the consumer only.
"""

from __future__ import annotations

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
    """One batch from a worker: the collated samples and where they came from, or an error."""

    def __init__(
        self, task: int, batch: Any = None, hits: dict[str, int] | None = None, storage_bytes: int = 0,
        error: BaseException | None = None,
    ) -> None:
        self.task = task
        self.batch = batch
        self.hits = hits or dict.fromkeys(TIERS, 0)
        self.storage_bytes = storage_bytes
        self.error = error


def fetch_batch(task: int, indices: list[int], fetch: Callable[[int], tuple[Any, str, int]]) -> BatchResult:
    """Fetch and collate the samples ``indices``; an error is returned, not raised."""
    result = BatchResult(task)
    try:
        samples = []
        for index in indices:
            sample, tier, nbytes = fetch(index)
            result.hits[tier] += 1
            result.storage_bytes += nbytes
            samples.append(sample)
        result.batch = default_collate(samples)
    except Exception as error:  # noqa: BLE001 - handed to the consumer, raised there
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


def _work(fetch: Callable[[int], tuple[Any, str, int]], tasks: Any, results: Any, threads: int) -> None:
    """A worker process: ``threads`` threads turn tasks ``(task, indices)`` into BatchResults."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)

    def serve() -> None:
        while (task := tasks.get()) is not None:
            results.put(fetch_batch(*task, fetch))
        tasks.put(None)  # the sibling threads stop too

    helpers = [threading.Thread(target=serve, daemon=True) for _ in range(threads - 1)]
    for thread in helpers:
        thread.start()
    serve()
    for thread in helpers:
        thread.join()


class WorkerPool:
    """``workers`` processes with ``threads`` threads each, serving batch tasks.

    Parameters
    ----------
    fetch
        ``index -> (sample, tier, bytes read from storage)``; called in the workers.
    workers, threads
        Processes, and threads per process.
    """

    def __init__(self, fetch: Callable[[int], tuple[Any, str, int]], workers: int, threads: int) -> None:
        context = mp.get_context()
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(workers)]
        self._processes = [
            context.Process(
                target=_work, args=(fetch, tasks, self._results, threads), name=f"rapydli-fetch-{number}", daemon=True
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
        self._tasks[task % len(self._tasks)].put((task, indices))

    def receive(self) -> BatchResult:
        """The next finished batch, in completion order; RapydliError if a worker died."""
        while True:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                self._check_alive()
            except (OSError, EOFError) as error:  # a batch in shared memory whose sender died
                self._check_alive(grace_s=5.0)
                self.close()
                raise RapydliError(f"a batch from the clairvoyant loader's workers could not be received: {error}") from error

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
