"""Data for distributed training: the deterministic sampler, sample stores, loaders.

``lmdb`` is imported only when an LMDB store is written or read.
"""

from rapydli.data.clairvoyant import ClairvoyantLoader
from rapydli.data.loaders import LOADER_KINDS, Loader, build_loader
from rapydli.data.sampler import ShardSampler, rank_indices
from rapydli.data.store import FileDataset, LMDBDataset, Throttle, write_files, write_lmdb

__all__ = [
    "LOADER_KINDS",
    "ClairvoyantLoader",
    "FileDataset",
    "LMDBDataset",
    "Loader",
    "ShardSampler",
    "Throttle",
    "build_loader",
    "rank_indices",
    "write_files",
    "write_lmdb",
]
