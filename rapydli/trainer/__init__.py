"""The engine side of a training run: the config, the data-parallel Trainer, and the task.

* :mod:`rapydli.trainer.config`: :class:`TrainConfig`, validated when built.
* :mod:`rapydli.trainer.loop`: :class:`Trainer`, the loop every rank runs.
* :mod:`rapydli.trainer.task`: :func:`~rapydli.trainer.task.engine_task`, what a cluster
  engine runs for one run (builds model and data, hands the Trainer its ``should_stop`` and
  ``emit`` callables, returns per-rank summaries).
* :mod:`rapydli.trainer.callbacks`, :mod:`~rapydli.trainer.checkpoint` (with
  :mod:`~rapydli.trainer.manifest`, the layout-free form of its tensors),
  :mod:`~rapydli.trainer.optim`, :mod:`~rapydli.trainer.schedule`: what the loop calls.

Nothing here starts a process or imports front-end code. Names are imported lazily so
``import rapydli.trainer`` is cheap.
"""

from __future__ import annotations

from typing import Any

from rapydli.lazy import LazyExports

_LAZY = {
    "TrainConfig": "rapydli.trainer.config",
    "FieldSpec": "rapydli.trainer.config",
    "fields_spec": "rapydli.trainer.config",
    "Trainer": "rapydli.trainer.loop",
    "build_optimizer": "rapydli.trainer.optim",
}
__all__ = sorted(_LAZY)


_exports = LazyExports(__name__, _LAZY, globals(), also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()
