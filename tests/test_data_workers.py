"""The clairvoyant loader's worker processes (rapydli/data/workers.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from rapydli.data import ClairvoyantLoader, LMDBDataset, ShardSampler, store, write_lmdb
from rapydli.errors import DataError, RapydliError

N, DIM = 70, 16
SAMPLE = 4 * DIM + 8  # 16 float32 + one int64 label


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, DIM, generator=generator), torch.arange(N))


class WhoReads(Dataset):
    """Adds to each sample the pid that read it, and whether every LMDB handle of that process is its own."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        sample = self.inner[i]
        own = all(key[0] == os.getpid() for key in store._OPEN)
        return (*sample, os.getpid(), own)


def reference(data: Dataset, rank: int, world_size: int, epoch: int, batch_size: int, drop_last: bool = False):
    sampler = ShardSampler(len(data), rank=rank, world_size=world_size, seed=3, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=drop_last))


def children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def assert_gone(pids: list[int]) -> None:
    """The workers were stopped and reaped: none is a child (not even a zombie) any more."""
    assert pids and not children() & set(pids)


@pytest.mark.parametrize(("world_size", "drop_last"), [(1, False), (2, False), (3, True)])
def test_worker_processes_yield_the_samplers_batches(world_size: int, drop_last: bool) -> None:
    data = dataset()
    for rank in range(world_size):
        with ClairvoyantLoader(
            WhoReads(data),
            batch_size=8,
            seed=3,
            rank=rank,
            world_size=world_size,
            epochs=3,
            ram_bytes=20 * SAMPLE,
            prefetch_threads=4,
            drop_last=drop_last,
            workers=2,
        ) as loader:
            for epoch in range(3):
                got = list(loader)
                want = reference(data, rank, world_size, epoch, 8, drop_last)
                assert len(got) == len(want) == len(loader)
                for (x, y, pid, _), (wx, wy) in zip(got, want):
                    assert torch.equal(x, wx) and torch.equal(y, wy)
                    assert set(pid.tolist()) <= set(loader._pool.pids) and os.getpid() not in pid.tolist()
            pids = loader._pool.pids
            assert len(pids) == 2 and set(pids) <= children()
        assert_gone(pids)


def test_workers_share_the_tiers_and_hit_what_any_of_them_cached(tmp_path: Path) -> None:
    # one worker with one thread fetches in order, so the hits per epoch are exact; with more, the
    # next epoch's first batches are fetched while this one's last are, and may read the same sample
    for workers, threads in ((1, 1), (2, 4)):
        with ClairvoyantLoader(
            dataset(),
            batch_size=5,
            seed=3,
            rank=0,
            world_size=2,
            epochs=3,
            ram_bytes=10 * SAMPLE,
            disk_bytes=10 * (SAMPLE + 28),
            disk_dir=str(tmp_path),
            prefetch_threads=threads,
            workers=workers,
        ) as loader:
            check_shared_tiers(loader, workers)
        assert not list(tmp_path.iterdir())


def check_shared_tiers(loader: ClairvoyantLoader, workers: int) -> None:
    """Every pass equals the sampler's; the tiers hold what the plan put there; hits add up."""
    epochs = [list(loader) for _ in range(3)]
    stats = loader.stats()
    ram = {i for i, t in loader.plan.tier.items() if t == "ram"}
    disk = {i for i, t in loader.plan.tier.items() if t == "disk" and loader.disk.get(i) is not None}
    assert len(ram) == len(loader.ram) == 10 and stats["ram_bytes_used"] == 10 * SAMPLE
    assert len(disk) == len(loader.disk) == 10 and stats["disk_bytes_used"] == 10 * (SAMPLE + 28)
    assert sum(stats["epochs"][0]["hits"].values()) == 35
    if workers == 1:
        assert stats["epochs"][0]["hits"] == {"ram": 0, "disk": 0, "storage": 35}
    for epoch in (1, 2):
        hits, order = stats["epochs"][epoch]["hits"], loader.stream[epoch]
        assert sum(hits.values()) == stats["epochs"][epoch]["samples"] == 35
        if workers == 1:
            assert hits["ram"] == sum(i in ram for i in order) and hits["disk"] == sum(i in disk for i in order)
        for (x, y), (wx, wy) in zip(epochs[epoch], reference(dataset(), 0, 2, epoch, 5)):
            assert torch.equal(x, wx) and torch.equal(y, wy)


def test_set_epoch_jump_and_an_early_break_drop_the_prefetched_batches() -> None:
    data = dataset()
    with ClairvoyantLoader(data, batch_size=4, seed=3, epochs=3, ram_bytes=4 * SAMPLE, workers=2) as loader:
        list(loader)  # epoch 0; epoch 1's first batches are prefetched meanwhile
        loader.set_epoch(2, skip_batches=3)
        assert [b[1].tolist() for b in loader] == [b[1].tolist() for b in reference(data, 0, 1, 2, 4)[3:]]
        loader.set_epoch(1)
        for _batch in loader:
            break  # the rest of epoch 1 stays in flight
        assert [b[1].tolist() for b in loader] == [b[1].tolist() for b in reference(data, 0, 1, 2, 4)]


def test_lmdb_workers_open_their_own_environments(tmp_path: Path) -> None:
    lmdb_store = LMDBDataset(write_lmdb(dataset(), tmp_path / "s", shard_size=32))
    lmdb_store[0]  # this process opens the environment before the workers fork
    with ClairvoyantLoader(WhoReads(lmdb_store), batch_size=8, seed=3, epochs=2, ram_bytes=10**4, workers=2) as loader:
        for epoch in range(2):
            for (x, y, pid, own), (wx, wy) in zip(loader, reference(dataset(), 0, 1, epoch, 8), strict=True):
                assert torch.equal(x, wx) and torch.equal(y, wy) and bool(own.all())
                assert os.getpid() not in pid.tolist()


def test_a_corrupt_record_is_raised_in_the_consumer_and_stops_the_workers(tmp_path: Path) -> None:
    root = write_lmdb(dataset(), tmp_path / "s", shard_size=100)
    shard = root / "shard-00000.lmdb"
    raw = bytearray(shard.read_bytes())
    raw[raw.index(LMDBDataset(root)[5][0].numpy().tobytes())] ^= 0xFF
    shard.write_bytes(bytes(raw))
    before = children()
    with ClairvoyantLoader(LMDBDataset(root), batch_size=8, seed=0, ram_bytes=10**6, workers=2) as loader:
        with pytest.raises(DataError, match=r"key 0000000005 in .*shard-00000.lmdb is corrupt"):
            list(loader)
        assert loader._pool is None and not children() - before


def test_a_worker_that_dies_is_a_clear_error_and_leaves_no_process() -> None:
    with ClairvoyantLoader(dataset(), batch_size=2, seed=0, epochs=1, ram_bytes=10**4, workers=2) as loader:
        iterator = iter(loader)
        next(iterator)
        pids = loader._pool.pids
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RapydliError, match=r"worker rapydli-fetch-1 \(pid \d+\) exited unexpectedly with code -9"):
            list(iterator)
        assert_gone(pids)
