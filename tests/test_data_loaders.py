"""build_loader and its kinds (rapydli/data/loaders.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from rapydli.data import (
    LOADERS,
    LMDBDataset,
    build_loader,
    rank_indices,
    write_lmdb,
)
from rapydli.errors import ConfigError


def dataset() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(45, 6, generator=generator), torch.arange(45))


def options(**overrides):
    return {"batch_size": 4, "rank": 1, "world_size": 2, "seed": 11, "epochs": 3, **overrides}


def test_unknown_kind_lists_the_allowed_kinds() -> None:
    assert LOADERS.names() == ["clairvoyant", "default"]
    with pytest.raises(ConfigError, match="'fast' is not a loader kind: allowed are 'clairvoyant', 'default'"):
        build_loader(dataset(), kind="fast", **options())


@pytest.mark.parametrize(
    ("field", "value"), [("batch_size", 0), ("epochs", 0), ("num_workers", -1), ("cache_ram_mb", -1.0)]
)
def test_bad_options_are_config_errors(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        build_loader(dataset(), **{**options(), field: value})


@pytest.mark.parametrize("num_workers", [0, 2])
def test_both_kinds_yield_identical_batches_in_the_sampler_order(num_workers: int) -> None:
    data = dataset()
    default = build_loader(data, kind="default", num_workers=num_workers, **options())
    clairvoyant = build_loader(data, kind="clairvoyant", num_workers=num_workers, cache_ram_mb=0.001, **options())
    assert len(default) == len(clairvoyant) == 6  # 23 samples on this rank, batches of 4
    for epoch in range(3):
        a, b = list(default), list(clairvoyant)
        assert len(a) == len(b) == 6
        for (x, y), (bx, by) in zip(a, b):
            assert torch.equal(x, bx) and torch.equal(y, by)
        assert torch.cat([y for _, y in a]).tolist() == rank_indices(45, 1, 2, 11, epoch).tolist()
    for loader in (default, clairvoyant):
        stats = loader.stats()
        assert stats["kind"] == loader.kind
        assert [e["epoch"] for e in stats["epochs"]] == [0, 1, 2]
        assert all(e["samples"] == 23 and e["batches"] == 6 and e["stall_s"] >= 0 for e in stats["epochs"])


@pytest.mark.parametrize(("kind", "num_workers"), [("default", 0), ("default", 2), ("clairvoyant", 0)])
def test_set_epoch_with_skip_batches_resumes_mid_epoch(kind: str, num_workers: int) -> None:
    loader = build_loader(dataset(), kind=kind, drop_last=True, num_workers=num_workers, **options())
    first = list(loader)  # a whole epoch 0 first, so persistent workers are reused below
    assert len(loader) == 5  # 22 samples per rank with drop_last, 5 full batches
    loader.set_epoch(2, skip_batches=3)
    tail = list(loader)
    assert torch.cat([y for _, y in tail]).tolist() == rank_indices(45, 1, 2, 11, 2, drop_last=True)[12:20].tolist()
    with pytest.raises(ConfigError, match="epochs=3"):
        list(loader)  # epoch 3 does not exist
    loader.set_epoch(0, skip_batches=4)
    assert torch.equal(next(iter(loader))[1], first[4][1])
    with pytest.raises(ConfigError, match="skip_batches=6"):
        loader.set_epoch(0, skip_batches=6)


def test_loaders_over_an_lmdb_store_with_workers_match(tmp_path: Path) -> None:
    store = LMDBDataset(write_lmdb(dataset(), tmp_path / "s", shard_size=16))
    default = build_loader(store, kind="default", num_workers=2, **options(epochs=1))
    clairvoyant = build_loader(store, kind="clairvoyant", **options(epochs=1))
    for (x, y), (bx, by) in zip(default, clairvoyant, strict=True):
        assert torch.equal(x, bx) and torch.equal(y, by)
