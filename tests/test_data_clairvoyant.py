"""The clairvoyant loader (rapydli/data/clairvoyant.py)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from rapydli.data import ClairvoyantLoader, LMDBDataset, ShardSampler, write_lmdb
from rapydli.errors import ConfigError, DataError

N, DIM = 70, 16  # a sample is 16 float32 + one int64 label = 72 bytes
SAMPLE = 4 * DIM + 8


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(N, DIM, generator=generator), torch.arange(N))


class Counting(Dataset):
    """Wraps a dataset, counting reads per index (thread-safe)."""

    def __init__(self, inner: Dataset) -> None:
        self.inner = inner
        self.reads: dict[int, int] = {}
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        with self.lock:
            self.reads[i] = self.reads.get(i, 0) + 1
        return self.inner[i]


def reference_batches(data: Dataset, rank: int, world_size: int, epoch: int, batch_size: int, drop_last: bool):
    sampler = ShardSampler(len(data), rank=rank, world_size=world_size, seed=3, drop_last=drop_last)
    sampler.set_epoch(epoch)
    return list(DataLoader(data, batch_size=batch_size, sampler=sampler, drop_last=drop_last))


@pytest.mark.parametrize(("world_size", "drop_last"), [(1, False), (2, False), (3, True)])
def test_batches_equal_dataloader_with_shard_sampler(world_size: int, drop_last: bool) -> None:
    data = dataset()
    for rank in range(world_size):
        loader = ClairvoyantLoader(
            data,
            batch_size=8,
            seed=3,
            rank=rank,
            world_size=world_size,
            epochs=3,
            ram_bytes=20 * SAMPLE,
            prefetch_threads=3,
            drop_last=drop_last,
        )
        for epoch in range(3):
            got = list(loader)
            want = reference_batches(data, rank, world_size, epoch, 8, drop_last)
            assert len(got) == len(want) == len(loader)
            for (x, y), (wx, wy) in zip(got, want):
                assert torch.equal(x, wx) and torch.equal(y, wy)


def test_hits_follow_the_plan_and_budgets_hold(tmp_path: Path) -> None:
    data = Counting(dataset())
    loader = ClairvoyantLoader(
        data,
        batch_size=5,
        seed=1,
        rank=0,
        world_size=2,
        epochs=3,
        ram_bytes=10 * SAMPLE,
        disk_bytes=10 * (SAMPLE + 28),
        disk_dir=str(tmp_path),
        prefetch_threads=4,
    )
    for _ in range(3):
        list(loader)
    stats = loader.stats()
    epochs = stats["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1, 2]
    ram = {i for i, t in loader.plan.tier.items() if t == "ram"}
    # the plan sizes samples by payload (72 bytes); on disk each also has a 28-byte record header,
    # so only 10 of the planned ones fit and the rest stay in storage
    disk = {i for i, t in loader.plan.tier.items() if t == "disk" and loader.disk.get(i) is not None}
    assert len(ram) == 10 and stats["plan"]["ram"] == 10
    assert len(disk) == 10 and stats["plan"]["disk"] == 1000 // SAMPLE
    # epoch 0 reads everything from storage; later epochs hit each cached sample they access
    assert epochs[0]["hits"] == {"ram": 0, "disk": 0, "storage": 35}
    for epoch in (1, 2):
        order = loader.stream[epoch]
        assert epochs[epoch]["hits"]["ram"] == sum(i in ram for i in order)
        assert epochs[epoch]["hits"]["disk"] == sum(i in disk for i in order)
        assert epochs[epoch]["storage_bytes"] == epochs[epoch]["hits"]["storage"] * SAMPLE
        assert epochs[epoch]["samples"] == 35 and epochs[epoch]["stall_s"] >= 0
    # each cached sample came from storage once; the rest once per access (plus the size probe)
    probe = loader.stream[0][0]
    for i, reads in data.reads.items():
        accesses = sum(order.count(i) for order in loader.stream)
        assert reads - (i == probe) == (1 if i in ram | disk else accesses)
    assert loader.ram.used <= 10 * SAMPLE and stats["ram_bytes_used"] == 10 * SAMPLE
    assert 0 < os.path.getsize(loader.disk.path) == stats["disk_bytes_used"] <= 10 * (SAMPLE + 28)
    loader.close()
    assert not list(tmp_path.iterdir())


def test_frequent_samples_go_to_ram_first() -> None:
    # 3 ranks over 10 samples pad each epoch, so some samples are read more often than others
    loader = ClairvoyantLoader(dataset(), batch_size=2, seed=0, rank=1, world_size=3, epochs=4, ram_bytes=3 * SAMPLE)
    counts = {}
    for order in loader.stream:
        for i in order:
            counts[i] = counts.get(i, 0) + 1
    ram = [i for i, t in loader.plan.tier.items() if t == "ram"]
    assert len(ram) == 3
    assert min(counts[i] for i in ram) >= max(counts[i] for i in counts if i not in ram)


def test_skip_batches_resumes_without_reading_skipped_samples() -> None:
    data = Counting(dataset())
    loader = ClairvoyantLoader(data, batch_size=4, seed=3, epochs=2, ram_bytes=4 * SAMPLE, prefetch_threads=2)
    loader.set_epoch(1, skip_batches=3)
    got = list(loader)
    want = reference_batches(dataset(), 0, 1, 1, 4, False)[3:]
    assert len(got) == len(want) == len(loader) - 3
    assert all(torch.equal(a[0], b[0]) for a, b in zip(got, want))
    assert set(data.reads) == set(loader.stream[1][12:])


def test_prefetch_window_is_bounded() -> None:
    data = Counting(dataset())
    loader = ClairvoyantLoader(data, batch_size=4, seed=0, epochs=1, ram_bytes=4 * SAMPLE, prefetch_threads=4, window=6)
    iterator = iter(loader)
    next(iterator)
    time.sleep(0.3)  # let the threads run as far ahead as they may
    assert 4 < sum(data.reads.values()) - 1 <= 4 + 6  # minus the one read that probes the sample size
    assert len(list(iterator)) == len(loader) - 1


def test_epochs_advance_and_jump() -> None:
    loader = ClairvoyantLoader(dataset(), batch_size=10, seed=0, epochs=2, ram_bytes=10 * SAMPLE)
    first = list(loader)
    list(loader)
    with pytest.raises(ConfigError, match="epochs=2"):
        list(loader)
    loader.set_epoch(0)
    assert all(torch.equal(a[1], b[1]) for a, b in zip(first, loader))
    with pytest.raises(ConfigError, match="epoch=2 is out of range"):
        loader.set_epoch(2)


def test_budget_that_cannot_hold_a_batch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"ram_bytes=100 cannot hold one batch: batch_size=8"):
        ClairvoyantLoader(dataset(), batch_size=8, seed=0, ram_bytes=100)
    with pytest.raises(ConfigError, match="prefetch_threads"):
        ClairvoyantLoader(dataset(), batch_size=8, seed=0, prefetch_threads=0)


def test_store_errors_reach_the_consumer(tmp_path: Path) -> None:
    root = write_lmdb(dataset(), tmp_path / "s", shard_size=100)
    shard = root / "shard-00000.lmdb"
    raw = bytearray(shard.read_bytes())
    record = LMDBDataset(root)[0][0].numpy().tobytes()
    at = raw.index(record)
    raw[at] ^= 0xFF
    shard.write_bytes(bytes(raw))
    loader = ClairvoyantLoader(LMDBDataset(root), batch_size=8, seed=0, ram_bytes=10**6, prefetch_threads=3)
    before = set(threading.enumerate())
    with pytest.raises(DataError, match=r"key 0000000000 in .*shard-00000.lmdb is corrupt"):
        list(loader)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("rapydli-prefetch")]


def test_lmdb_backed_loader_matches_and_counts_store_bytes(tmp_path: Path) -> None:
    store = LMDBDataset(write_lmdb(dataset(), tmp_path / "s", shard_size=32))
    loader = ClairvoyantLoader(store, batch_size=8, seed=3, rank=0, world_size=2, epochs=2, ram_bytes=10**6)
    for epoch in range(2):
        for (x, y), (wx, wy) in zip(loader, reference_batches(dataset(), 0, 2, epoch, 8, False)):
            assert torch.equal(x, wx) and torch.equal(y, wy)
    first, second = loader.stats()["epochs"]
    assert first["storage_bytes"] == sum(store.sample_nbytes(i) for i in loader.stream[0])
    again = [i for i in loader.stream[1] if i in loader.stream[0]]
    new = [i for i in loader.stream[1] if i not in loader.stream[0]]
    assert 0 < len(again) < 35
    assert second["hits"] == {"ram": len(again), "disk": 0, "storage": len(new)}
    assert second["storage_bytes"] == sum(store.sample_nbytes(i) for i in new)


@pytest.mark.mpi
def test_ranks_together_cover_the_dataset(run_mpi) -> None:
    """3 ranks read one LMDB store (rank 0 writes it) through their clairvoyant loaders."""
    result = run_mpi(
        """
        import torch
        from mpi4py import MPI
        from torch.utils.data import TensorDataset
        from rapydli.data import ClairvoyantLoader, LMDBDataset, rank_indices, write_lmdb

        comm = MPI.COMM_WORLD
        if comm.rank == 0:
            write_lmdb(TensorDataset(torch.arange(50)), "store", shard_size=16)
        comm.Barrier()
        loader = ClairvoyantLoader(LMDBDataset("store"), batch_size=4, seed=9, rank=comm.rank,
                                   world_size=comm.size, epochs=2, ram_bytes=4096)
        for epoch in range(2):
            seen = [int(v) for (batch,) in loader for v in batch]
            assert seen == rank_indices(50, comm.rank, comm.size, 9, epoch).tolist()
            everyone = comm.gather(seen, root=0)
            if comm.rank == 0:
                flat = [v for part in everyone for v in part]
                assert set(flat) == set(range(50)) and len(flat) == 51, (epoch, len(flat))
        hits = comm.gather(loader.stats()["epochs"][1]["hits"], root=0)
        if comm.rank == 0:
            print("covered", comm.size, sum(h["ram"] + h["storage"] for h in hits))
        """,
        n=3,
    )
    assert "covered 3 51" in result.stdout
