"""Training on every rank: the config, the data-parallel Trainer, reference models and data.

``TrainConfig`` and ``Trainer`` are imported lazily so that ``import rapydli.train`` is
cheap and ``rapydli.train.models:resnet_mini`` style references resolve quickly.

This package shares its name with the public function ``rd.train``
(:func:`rapydli.experiments.training.train`). Importing any ``rapydli.train.*`` module
makes Python bind the *package* as ``rapydli.train``, hiding the function; so the
package is callable and forwards to the function, and ``rd.train(...)`` works whichever
of the two the name holds.
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
    """``rapydli.train(...)`` is ``rd.train(...)`` (see the module docstring)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from rapydli.experiments.training import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
