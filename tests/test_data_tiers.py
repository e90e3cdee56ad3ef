"""RAM and disk cache tiers, in-process and shared (rapydli/data/tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from rapydli.data.tiers import DiskTier, RamTier, SharedTier, sample_nbytes


def test_sample_nbytes_counts_payload() -> None:
    sample = {"x": torch.zeros(2, 3), "a": np.zeros(5, np.int16), "b": b"abc", "y": 1}
    assert sample_nbytes(sample) == 24 + 10 + 3 + 8


def test_ram_tier_refuses_inserts_past_its_budget() -> None:
    ram = RamTier(capacity=100)
    assert ram.put(1, "a", 60)
    assert not ram.put(2, "b", 60)
    assert not ram.put(1, "again", 10)  # already held
    assert ram.put(3, "c", 40)
    assert ram.used == 100 and len(ram) == 2
    assert ram.get(1) == "a" and ram.get(2) is None


def test_disk_tier_round_trips_within_budget_and_cleans_up(tmp_path: Path) -> None:
    disk = DiskTier(capacity=2000, directory=str(tmp_path / "made-on-first-insert"))
    sample = (torch.arange(100, dtype=torch.int32), 7)
    assert disk.put(4, sample)
    got = disk.get(4)
    assert torch.equal(got[0], sample[0]) and got[1] == 7
    while disk.put(len(disk) + 10, sample):
        pass
    assert disk.used <= 2000 and os.path.getsize(disk.path) == disk.used
    assert disk.get(99) is None
    path = disk.path
    disk.close()
    assert not os.path.exists(path) and not list((tmp_path / "made-on-first-insert").iterdir())


def test_shared_tier_in_memory_is_filled_and_read_across_processes() -> None:
    schema = {"container": "tuple", "fields": [{"kind": "tensor", "dtype": "float32", "shape": [4]}, {"kind": "int"}]}
    context = torch.multiprocessing.get_context()
    ram = SharedTier(capacity=3 * 24 + 8, num_samples=10, schema=schema, lock=context.Lock(), slack=256)
    child = context.Process(target=_fill, args=(ram,))
    child.start()
    child.join()
    assert child.exitcode == 0
    assert len(ram) == 4 and ram.used == 3 * 24 + 8  # budget counts payload: the fourth tensor did not fit
    got = ram.get(2)
    assert torch.equal(got[0], torch.full((4,), 2.0)) and got[1] == 2
    assert ram.get(3) is None and not ram.put(0, (torch.zeros(4), 0), 24)  # held already
    assert ram.get(9) == "off-schema"  # kept as a pickle


def _fill(ram: SharedTier) -> None:
    assert [ram.put(i, (torch.full((4,), float(i)), i), 24) for i in range(4)] == [True, True, True, False]
    assert ram.put(9, "off-schema", 8)


def test_shared_tier_on_disk_counts_written_bytes_and_cleans_up(tmp_path: Path) -> None:
    schema = {"container": "single", "fields": [{"kind": "tensor", "dtype": "int32", "shape": [100]}]}
    disk = SharedTier(
        capacity=800,
        num_samples=5,
        schema=schema,
        lock=torch.multiprocessing.get_context().Lock(),
        directory=str(tmp_path / "cache"),
    )
    assert disk.put(0, torch.arange(100, dtype=torch.int32)) and not disk.put(1, torch.zeros(100, dtype=torch.int32))
    assert disk.used == 400 + 20 and torch.equal(disk.get(0), torch.arange(100, dtype=torch.int32))
    disk.close()
    assert not list((tmp_path / "cache").iterdir())
