"""Data for distributed training: the deterministic sampler, sample stores, loaders.

Names are imported lazily (``rapydli.data.kinds`` is read when a ``TrainConfig`` is built,
which must not import torch); ``lmdb`` is imported only when an LMDB store is written or read.
"""

from __future__ import annotations

from typing import Any

from rapydli.lazy import LazyExports

_LAZY = {
    "LOADERS": "rapydli.data.kinds",
    "ClairvoyantLoader": "rapydli.data.clairvoyant",
    "FileDataset": "rapydli.data.store",
    "LMDBDataset": "rapydli.data.store",
    "Loader": "rapydli.data.epochs",
    "ShardSampler": "rapydli.data.sampler",
    "Throttle": "rapydli.data.store",
    "build_loader": "rapydli.data.loaders",
    "rank_indices": "rapydli.data.sampler",
    "write_files": "rapydli.data.store",
    "write_lmdb": "rapydli.data.store",
}
__all__ = sorted(_LAZY)


_exports = LazyExports(__name__, _LAZY, globals(), also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()
