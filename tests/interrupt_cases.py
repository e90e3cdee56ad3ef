"""Model functions for the Ctrl-C tests that run on the engines (importable, so they pickle by reference)."""

from __future__ import annotations

import functools
import os
import signal
import threading
from pathlib import Path
from typing import Any

from torch import nn

from rapydli.zoo import models


def built_then_tell(flag: str) -> nn.Module:
    """``resnet_digits()``, and on rank 0 a file at ``flag`` saying it is built (autotuning follows)."""
    from rapydli.cluster import engine

    model = models.resnet_digits()
    if engine.context().rank == 0:
        Path(flag).write_text(str(os.getpid()))
    return model


class InterruptWhenShipped:
    """A model function that sends SIGINT to the client's main thread when it is pickled the ``nth`` time.

    ``Cluster.submit`` pickles the task once per rank, so ``nth=2`` interrupts the client
    after rank 0 has its task and before rank 1 has: the shipping phase of a run.
    """

    def __init__(self, nth: int = 2) -> None:
        self.nth, self.count = nth, 0

    def __call__(self) -> nn.Module:
        return models.mlp()

    def __reduce__(self) -> tuple[Any, ...]:
        self.count += 1
        if self.count == self.nth:
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        return functools.partial, (models.mlp,)


class DeafToStop(nn.Module):
    """``models.mlp()`` whose first forward sleeps a minute: a run busy in one long step,
    which a stop request (checked between steps) does not reach."""

    def __init__(self) -> None:
        super().__init__()
        self.net = models.mlp()
        self.slept = False

    def forward(self, x: Any) -> Any:
        if not self.slept:
            import time

            self.slept = True
            time.sleep(60)
        return self.net(x)
