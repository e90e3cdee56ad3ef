"""The predicted access stream and the tier plan (rapydli/data/plan.py)."""

from __future__ import annotations

import pytest

from rapydli.data.plan import access_stream, assign_tiers
from rapydli.data.sampler import ShardSampler


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_stream_equals_the_samplers_real_order(world_size: int, drop_last: bool) -> None:
    num_samples, seed, epochs = 23, 7, 4
    for rank in range(world_size):
        sampler = ShardSampler(num_samples, rank=rank, world_size=world_size, seed=seed, drop_last=drop_last)
        real = []
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            real.append(list(sampler))
        assert access_stream(num_samples, rank, world_size, seed, epochs, drop_last) == real


def test_stream_differs_per_epoch_and_rank() -> None:
    streams = [access_stream(40, rank, 2, seed=1, epochs=2) for rank in range(2)]
    assert streams[0][0] != streams[0][1]
    assert not set(streams[0][0]) & set(streams[1][0])
    assert sorted(streams[0][0] + streams[1][0]) == list(range(40))


def test_tiers_follow_frequency_then_first_access() -> None:
    stream = [[5, 1, 2], [2, 7, 1], [2, 9, 4]]  # 2: 3x, 1: 2x, then 5 7 9 4 once in first-access order
    plan = assign_tiers(stream, nbytes=lambda i: 100, ram_bytes=200, disk_bytes=300)
    assert plan.priority == [2, 1, 5, 7, 9, 4]
    assert plan.frequency == {5: 1, 1: 2, 2: 3, 7: 1, 9: 1, 4: 1}
    assert plan.tier == {2: "ram", 1: "ram", 5: "disk", 7: "disk", 9: "disk", 4: "storage"}
    assert plan.planned_bytes == {"ram": 200, "disk": 300, "storage": 100}
    assert (plan.count("ram"), plan.count("disk"), plan.count("storage")) == (2, 3, 1)


def test_tiers_respect_budgets_with_uneven_sizes() -> None:
    stream = access_stream(60, 0, 2, seed=3, epochs=5)
    sizes = {i: 10 + (i % 7) * 13 for i in range(60)}
    plan = assign_tiers(stream, nbytes=sizes.__getitem__, ram_bytes=500, disk_bytes=700)
    ram = [i for i, t in plan.tier.items() if t == "ram"]
    disk = [i for i, t in plan.tier.items() if t == "disk"]
    assert 0 < sum(sizes[i] for i in ram) <= 500
    assert 0 < sum(sizes[i] for i in disk) <= 700
    # priority is by falling frequency; the most frequent sample is in RAM; a sample stays in
    # storage only because neither tier had room for it when its turn came
    frequencies = [plan.frequency[i] for i in plan.priority]
    assert frequencies == sorted(frequencies, reverse=True) and len(set(frequencies)) > 1
    assert plan.tier[plan.priority[0]] == "ram"
    used = {"ram": 0, "disk": 0}
    for i in plan.priority:
        if plan.tier[i] == "storage":
            assert used["ram"] + sizes[i] > 500 and used["disk"] + sizes[i] > 700
        else:
            used[plan.tier[i]] += sizes[i]


def test_zero_budgets_keep_everything_in_storage() -> None:
    plan = assign_tiers([[0, 1, 2]], nbytes=lambda i: 1, ram_bytes=0, disk_bytes=0)
    assert set(plan.tier.values()) == {"storage"}
