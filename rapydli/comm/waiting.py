"""Completing MPI requests on the communication thread without starving the compute thread.

MPICH completes a blocking call by spinning in its progress engine. On the caller's
thread that is the fastest way to wait. On the background communication thread it is
not always: while gradients of later buckets are still being computed, a spinning
communication thread takes a core from backward (ranks usually own one core each).
A polite :class:`Pace` spins briefly (a message that is about to arrive costs no
latency), then tests with sleeps that back off from 20 us to 200 us, so a waiting thread
releases the core but still drives progress. Once the caller itself blocks on the result
(:meth:`Pace.waiting`), there is nothing left to compute and the thread spins: a sleeping
progress engine would only stretch the transfer (MPICH moves large messages in pieces,
one per progress call).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from mpi4py import MPI

#: Tests before the first sleep.
SPINS = 64
#: First and longest sleep between tests (seconds).
FIRST_SLEEP, LONGEST_SLEEP = 20e-6, 200e-6


class Pace:
    """How a thread waits for MPI requests: spinning, or politely while its caller computes.

    Parameters
    ----------
    polite
        Test with sleeps instead of spinning, except while someone is blocked in
        :meth:`waiting`.
    """

    def __init__(self, polite: bool = False) -> None:
        self.polite = polite
        self._waiters = 0
        self._lock = threading.Lock()

    @property
    def urgent(self) -> bool:
        """True when waiting should spin: not polite, or a caller is blocked on the result."""
        return not self.polite or self._waiters > 0

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """Mark a caller as blocked on the communication (the thread spins meanwhile)."""
        with self._lock:
            self._waiters += 1
        try:
            yield
        finally:
            with self._lock:
                self._waiters -= 1

    def complete(self, requests: Sequence[Any]) -> None:
        """Wait for every MPI request: spin when urgent, else spin briefly, then test with sleeps."""
        if self.urgent:
            MPI.Request.Waitall(list(requests))
            return
        spins, pause = 0, FIRST_SLEEP
        while not MPI.Request.Testall(list(requests)):
            if self.urgent:
                MPI.Request.Waitall(list(requests))
                return
            spins += 1
            if spins >= SPINS:
                time.sleep(pause)
                pause = min(2 * pause, LONGEST_SLEEP)


#: The pace of the caller's own thread: always spin.
SPIN = Pace(polite=False)
