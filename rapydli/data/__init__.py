"""Data for distributed training: the deterministic sampler, sample stores, loaders.

``lmdb`` is imported only when an LMDB store is written or read.
"""

from rapydli.data.clairvoyant import ClairvoyantLoader
from rapydli.data.loaders import LOADER_KINDS, Loader, build_loader
from rapydli.data.sampler import ShardSampler, rank_indices

__all__ = [
    "LOADER_KINDS",
    "ClairvoyantLoader",
    "Loader",
    "ShardSampler",
    "build_loader",
    "rank_indices",
]
