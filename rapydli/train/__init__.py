"""Training on every rank: the config, the data-parallel Trainer, reference models and data.

``TrainConfig`` and ``Trainer`` are imported lazily so that ``import rapydli.train`` is
cheap and ``rapydli.train.models:resnet_mini`` style references resolve quickly.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {
    "TrainConfig": "rapydli.train.config",
    "FieldSpec": "rapydli.train.config",
    "fields_spec": "rapydli.train.config",
    "Trainer": "rapydli.train.trainer",
    "build_optimizer": "rapydli.train.trainer",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rapydli.train' has no attribute {name!r}")

