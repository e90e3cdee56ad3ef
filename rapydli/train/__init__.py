"""Training on every rank: the config, the data-parallel Trainer, reference models and data.

``TrainConfig`` and ``Trainer`` are imported lazily so that ``import rapydli.train`` is
cheap and ``rapydli.train.models:resnet_mini`` style references resolve quickly.

This package is also ``rd.train``: calling it, ``rd.train(model_fn, data_fn, config,
cluster=None)``, runs :func:`rapydli.experiments.training.train` from the notebook. One
name must serve both, because Python resolves ``import rapydli.train.models as m``
through the attribute ``rapydli.train``.
"""

from __future__ import annotations

import sys
import types
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



class _CallablePackage(types.ModuleType):
    """The ``rapydli.train`` module; calling it is ``rd.train(...)``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from rapydli.experiments.training import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
