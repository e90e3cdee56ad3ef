"""Handles of asynchronous collectives: ``wait()`` and ``test()``, with timings.

``started`` and ``finished`` are :func:`time.perf_counter` stamps of when the
communication itself ran (not when it was queued), so callers can tell how much of it
happened while they were busy with something else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rapydli.errors import RapydliError

if TYPE_CHECKING:
    from rapydli.comm.waiting import Pace


_NOTHING = torch.empty(0)


class Handle:
    """An allreduce in flight; :meth:`wait` returns the reduced tensor.

    Attributes
    ----------
    tensor
        The caller's tensor, reduced in place once the handle completes.
    algorithm
        Name of the algorithm that ran (``auto`` resolved to the one it chose).
    started, finished
        ``time.perf_counter()`` when the communication began and ended (``None`` before).
    """

    def __init__(self, tensor: torch.Tensor, algorithm: str) -> None:
        self.tensor = tensor
        self.algorithm = algorithm
        self.started: float | None = None
        self.finished: float | None = None

    @property
    def duration(self) -> float:
        """Seconds the communication took (0.0 while not finished)."""
        if self.started is None or self.finished is None:
            return 0.0
        return self.finished - self.started

    def test(self) -> bool:
        """True once the result is in ``tensor``; never blocks."""
        raise NotImplementedError

    def timing(self) -> Handle:
        """What is kept of a completed handle for its statistics: its times, not its tensor."""
        kept = Handle(_NOTHING, self.algorithm)
        kept.started, kept.finished = self.started, self.finished
        return kept

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        """Block until complete and return ``tensor``; re-raise a failure of the collective."""
        raise NotImplementedError


class CompletedHandle(Handle):
    """A handle for work that already ran synchronously."""

    def __init__(self, tensor: torch.Tensor, algorithm: str, started: float, finished: float) -> None:
        super().__init__(tensor, algorithm)
        self.started, self.finished = started, finished

    def test(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        return self.tensor


def _done() -> None:
    """The work of a handle that has run."""


class ThreadHandle(Handle):
    """Work queued on a :class:`CommThread`; completed by that thread."""

    def __init__(self, tensor: torch.Tensor, algorithm: str, work: Callable[[], Any]) -> None:
        super().__init__(tensor, algorithm)
        self.work = work
        #: the thread's pace, told when a caller blocks in :meth:`wait` (set by :meth:`CommThread.submit`)
        self.pace: Pace | None = None
        self._done = threading.Event()
        self._error: BaseException | None = None

    def run(self) -> None:
        """Run the work (called on the communication thread)."""
        self.started = time.perf_counter()
        try:
            self.work()
        except BaseException as error:  # handed to the waiting thread, re-raised there
            self._error = error
        finally:
            self.work = _done  # the closure holds the work's buffers (a whole gradient bucket): a kept handle must not
            self.finished = time.perf_counter()
            self._done.set()

    def test(self) -> bool:
        if self._done.is_set() and self._error is not None:
            raise RapydliError(f"{self.algorithm} allreduce failed: {self._error}") from self._error
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self.pace is not None and not self._done.is_set():
            with self.pace.waiting():  # nothing left to compute here: the thread may spin
                done = self._done.wait(timeout)
        else:
            done = self._done.wait(timeout)
        if not done:
            raise TimeoutError(f"{self.algorithm} allreduce did not complete within {timeout} s")
        if self._error is not None:
            raise RapydliError(f"{self.algorithm} allreduce failed: {self._error}") from self._error
        return self.tensor


class WorkHandle(Handle):
    """A ``torch.distributed`` Work object, with a step to run after it completes (e.g. ``avg``)."""

    def __init__(self, tensor: torch.Tensor, algorithm: str, work: Any, then: Callable[[], None] | None = None) -> None:
        super().__init__(tensor, algorithm)
        self.work = work
        self.then = then
        self.started = time.perf_counter()
        self._completed = False

    def _complete(self) -> None:
        if not self._completed:
            self._completed = True
            self.finished = time.perf_counter()
            if self.then is not None:
                self.then()

    def test(self) -> bool:
        if self.work.is_completed():
            self.work.wait()
            self._complete()
        return self._completed

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        self.work.wait()
        self._complete()
        return self.tensor


class CommThread:
    """One background thread that runs queued collectives in submission order.

    MPI non-blocking collectives progress only inside MPI calls; a thread that runs the
    collective (blocking, on its own duplicated communicator) makes it progress while the
    caller computes, as DDP's communication thread does. Submission order is the order in
    which every rank must issue collectives, so callers submit in a rank-independent order.

    Parameters
    ----------
    pace
        How the thread's algorithms wait; handles tell it when their caller blocks.
    name
        The thread's name.
    """

    def __init__(self, pace: Pace | None = None, name: str = "rapydli-comm") -> None:
        import queue

        self.pace = pace
        self._queue: queue.SimpleQueue[ThreadHandle | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, handle: ThreadHandle) -> ThreadHandle:
        """Queue ``handle``'s work; returns the handle."""
        if not self._thread.is_alive():
            raise RapydliError("the communication thread has stopped (communicator closed)")
        handle.pace = self.pace
        self._queue.put(handle)
        return handle

    def close(self, timeout: float = 10.0) -> None:
        """Finish queued work and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)

    def _loop(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            handle.run()
