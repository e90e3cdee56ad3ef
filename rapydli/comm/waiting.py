"""Completing MPI requests on the communication thread without starving the compute thread.

MPICH completes a blocking call by spinning in its progress engine. On the caller's
thread that is the fastest way to wait. On the background communication thread it is
not: while gradients of later buckets are still being computed, a spinning
communication thread takes a core from backward (ranks usually own one core each).
``polite`` waiting spins briefly (a message that is about to arrive costs no latency),
then tests with sleeps that back off from 20 us to 200 us, so a waiting thread releases
the core but still drives progress often enough for a pipelined transfer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from mpi4py import MPI

#: Tests before the first sleep.
SPINS = 64
#: First and longest sleep between tests (seconds).
FIRST_SLEEP, LONGEST_SLEEP = 20e-6, 200e-6


def complete(requests: Sequence[Any], polite: bool) -> None:
    """Wait for every MPI request; spin (``polite=False``) or spin, then test with sleeps."""
    if not polite:
        MPI.Request.Waitall(list(requests))
        return
    spins, pause = 0, FIRST_SLEEP
    while not MPI.Request.Testall(list(requests)):
        spins += 1
        if spins >= SPINS:
            time.sleep(pause)
            pause = min(2 * pause, LONGEST_SLEEP)
