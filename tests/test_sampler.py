"""The deterministic sampler equals torch's DistributedSampler, rank by rank."""

import pytest
import torch
from torch.utils.data import DistributedSampler

from rapydli.data.sampler import ShardSampler, rank_indices
from rapydli.errors import ConfigError


@pytest.mark.parametrize("num_samples", [1, 7, 10, 33])
@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_matches_distributed_sampler(num_samples, world_size, drop_last):
    for rank in range(world_size):
        for epoch in range(3):
            ref = DistributedSampler(
                range(num_samples), num_replicas=world_size, rank=rank, seed=5, drop_last=drop_last
            )
            ref.set_epoch(epoch)
            ours = ShardSampler(num_samples, rank, world_size, seed=5, drop_last=drop_last)
            ours.set_epoch(epoch)
            assert list(ours) == list(ref)
            assert len(ours) == len(ref)


def test_epochs_differ_and_ranks_partition_the_data():
    shards = [rank_indices(12, r, 3, seed=1, epoch=0) for r in range(3)]
    assert sorted(torch.cat(shards).tolist()) == list(range(12))
    assert rank_indices(12, 0, 3, seed=1, epoch=0).tolist() != rank_indices(12, 0, 3, seed=1, epoch=1).tolist()


@pytest.mark.parametrize(
    "kwargs, field",
    [({"num_samples": 0}, "num_samples"), ({"rank": 2}, "rank"), ({"world_size": 0}, "world_size")],
)
def test_bad_partition_is_refused(kwargs, field):
    args = {"num_samples": 4, "rank": 0, "world_size": 2, **kwargs}
    with pytest.raises(ConfigError, match=field):
        ShardSampler(args["num_samples"], args["rank"], args["world_size"])
