"""Data for distributed training: the deterministic sampler, sample stores, loaders."""

from rapydli.data.sampler import ShardSampler, rank_indices

__all__ = ["ShardSampler", "rank_indices"]
