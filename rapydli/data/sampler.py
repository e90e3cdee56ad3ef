"""The seeded, deterministic per-rank sample order used by the trainer.

The order is the one :class:`torch.utils.data.DistributedSampler` produces for the same
``seed``, ``epoch``, ``rank`` and ``world_size``: a ``torch.randperm`` seeded with
``seed + epoch``, padded (or truncated with ``drop_last``) to a multiple of the world
size, then strided by rank. Because it is a pure function of those numbers, the whole
access stream of a run is known in advance (the clairvoyant loader relies on this) and a
run is repeatable.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

from rapydli.errors import ConfigError


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """Global sample order of one epoch (before sharding), as an int64 tensor."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(num_samples, generator=generator)


def shard_size(num_samples: int, world_size: int, drop_last: bool = False) -> int:
    """Number of samples each rank sees per epoch."""
    if drop_last and num_samples % world_size:
        return num_samples // world_size
    return math.ceil(num_samples / world_size)


def rank_indices(
    num_samples: int,
    rank: int,
    world_size: int,
    seed: int,
    epoch: int,
    shuffle: bool = True,
    drop_last: bool = False,
    start: int = 0,
) -> torch.Tensor:
    """Sample indices that ``rank`` visits in ``epoch``, in visiting order.

    ``start`` skips the first ``start`` positions of the epoch's global order and shards
    what is left over ``world_size`` ranks (padded by wrapping around to the order's
    beginning, as with ``start=0``). A run resumed mid-epoch on another number of ranks
    uses it: the positions consumed so far are ``steps x global batch`` whatever the world
    size was, so no sample of the epoch is seen twice and none is skipped. With the same
    world size and ``start`` a multiple of it, the result equals dropping this rank's first
    ``start // world_size`` indices.

    Examples
    --------
    >>> rank_indices(5, rank=1, world_size=2, seed=0, epoch=0, shuffle=False).tolist()
    [1, 3, 0]
    """
    _check_partition(num_samples, rank, world_size)
    if not 0 <= start <= num_samples:
        raise ConfigError(f"start={start} is invalid: must be in [0, {num_samples}]")
    order = epoch_order(num_samples, seed, epoch, shuffle)
    left = num_samples - start
    per_rank = shard_size(left, world_size, drop_last) if left else 0
    total = per_rank * world_size
    if total > left:  # pad by wrapping around to the order's beginning, as DistributedSampler does
        repeats = math.ceil((total - left) / num_samples)
        order = torch.cat([order, *([order] * repeats)])
    return order[start : start + total][rank:total:world_size]


def _check_partition(num_samples: int, rank: int, world_size: int) -> None:
    if num_samples < 1:
        raise ConfigError(f"dataset is empty: num_samples={num_samples}, need at least 1")
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} is invalid: must be >= 1")
    if not 0 <= rank < world_size:
        raise ConfigError(f"rank={rank} is invalid: must be in [0, {world_size - 1}]")


class ShardSampler(Sampler[int]):
    """A map-style sampler giving this rank's share of each epoch's seeded order.

    Parameters
    ----------
    num_samples
        Length of the dataset.
    rank, world_size
        This rank and the number of ranks sharing the data.
    seed
        Base seed; epoch ``e`` uses ``seed + e``.
    shuffle, drop_last
        As in :class:`torch.utils.data.DistributedSampler`.
    resume_from
        ``(epoch, start)``: that epoch begins at position ``start`` of its global order,
        re-sharded over this world size (see :func:`rank_indices`); other epochs are whole.
    """

    def __init__(
        self,
        num_samples: int,
        rank: int = 0,
        world_size: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = False,
        resume_from: tuple[int, int] | None = None,
    ) -> None:
        _check_partition(num_samples, rank, world_size)
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.resume_from = resume_from
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration yields."""
        self.epoch = epoch

    def indices(self, epoch: int | None = None) -> torch.Tensor:
        """This rank's indices for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        start = self.resume_from[1] if self.resume_from is not None and self.resume_from[0] == epoch else 0
        return rank_indices(
            self.num_samples, self.rank, self.world_size, self.seed, epoch, self.shuffle, self.drop_last, start
        )

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        return self.length(self.epoch)

    def length(self, epoch: int | None = None) -> int:
        """Samples this rank visits in ``epoch`` (fewer in a resumed epoch; ``None``: a whole epoch)."""
        start = self.resume_from[1] if self.resume_from is not None and self.resume_from[0] == epoch else 0
        left = self.num_samples - start
        return shard_size(left, self.world_size, self.drop_last) if left else 0
