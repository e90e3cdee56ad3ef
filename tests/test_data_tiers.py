"""RAM and disk cache tiers (rapydli/data/tiers.py)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from rapydli.data.tiers import DiskTier, RamTier, sample_nbytes


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
