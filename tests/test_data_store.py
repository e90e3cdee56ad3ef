"""The LMDB store, the directory-of-files store and the throttle (rapydli/data/store.py)."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from rapydli.data import FileDataset, LMDBDataset, Throttle, write_files, write_lmdb
from rapydli.errors import ConfigError, DataError


class Mixed(Dataset):
    """Samples of every supported kind: encoded bytes, arrays, tensors, numbers, strings."""

    def __len__(self) -> int:
        return 30

    def __getitem__(self, i: int) -> dict:
        return {
            "jpeg": bytes([i % 256]) * (i + 1),
            "x": np.full((2, 3), i, np.float32),
            "t": torch.full((4,), i, dtype=torch.int16),
            "y": i,
            "w": i / 2,
            "s": f"s{i}",
        }


def _same(a: dict, b: dict) -> bool:
    return (
        a.keys() == b.keys()
        and a["jpeg"] == b["jpeg"]
        and np.array_equal(a["x"], b["x"])
        and a["x"].dtype == b["x"].dtype
        and torch.equal(a["t"], b["t"])
        and (a["y"], a["w"], a["s"]) == (b["y"], b["w"], b["s"])
    )


@pytest.fixture
def lmdb_store(tmp_path: Path) -> Path:
    return write_lmdb(Mixed(), tmp_path / "lmdb", shard_size=8)


def test_lmdb_round_trip_with_shards_header_and_index(lmdb_store: Path) -> None:
    data = LMDBDataset(lmdb_store)
    assert len(data) == 30
    assert all(_same(data[i], Mixed()[i]) for i in range(30))
    assert _same(data[-1], Mixed()[29])
    header = json.loads((lmdb_store / "header.json").read_text())
    assert [s["file"] for s in header["shards"]] == [f"shard-0000{n}.lmdb" for n in range(4)]
    assert header["schema"]["container"] == "dict" and header["schema"]["keys"] == ["jpeg", "x", "t", "y", "w", "s"]
    assert data.sample_nbytes(5) == header["record_bytes"][5] > 6 + 24 + 8
    with pytest.raises(IndexError):
        data[30]


def test_files_round_trip(tmp_path: Path) -> None:
    data = FileDataset(write_files(Mixed(), tmp_path / "files"))
    assert len(data) == 30 and len(list((tmp_path / "files").glob("*.bin"))) == 30
    assert all(_same(data[i], Mixed()[i]) for i in range(30))


def test_tensor_dataset_tuples_come_back_as_tuples(tmp_path: Path) -> None:
    source = torch.utils.data.TensorDataset(torch.randn(10, 3), torch.arange(10))
    data = LMDBDataset(write_lmdb(source, tmp_path / "s"))
    x, y = data[4]
    assert torch.equal(x, source[4][0]) and torch.equal(y, source[4][1]) and y.dtype == torch.int64


def test_lmdb_is_safe_in_worker_processes_and_pickles_without_handles(lmdb_store: Path) -> None:
    data = LMDBDataset(lmdb_store)
    assert data[0]["y"] == 0  # the parent opens an environment before the workers fork
    assert pickle.loads(pickle.dumps(data))._envs == {}
    loader = DataLoader(data, batch_size=5, num_workers=2, collate_fn=lambda b: [s["y"] for s in b])
    assert sorted(y for batch in loader for y in batch) == list(range(30))


def test_writing_refuses_off_schema_samples_and_existing_stores(tmp_path: Path, lmdb_store: Path) -> None:
    class Ragged(Dataset):
        def __len__(self) -> int:
            return 3

        def __getitem__(self, i: int):
            return torch.zeros(2 + i)

    with pytest.raises(DataError, match="sample 1 of the dataset does not match"):
        write_lmdb(Ragged(), tmp_path / "ragged")
    with pytest.raises(ConfigError, match="already holds a store"):
        write_lmdb(Mixed(), lmdb_store)
    with pytest.raises(ConfigError, match="shard_size"):
        write_lmdb(Mixed(), tmp_path / "x", shard_size=0)


def test_missing_header_or_shard_names_the_file(tmp_path: Path, lmdb_store: Path) -> None:
    with pytest.raises(DataError, match="header.json is missing"):
        LMDBDataset(tmp_path / "nowhere")
    (lmdb_store / "shard-00002.lmdb").unlink()
    with pytest.raises(DataError, match="shard-00002.lmdb is missing"):
        LMDBDataset(lmdb_store)


def test_truncated_shard_is_an_error(lmdb_store: Path) -> None:
    shard = lmdb_store / "shard-00001.lmdb"
    shard.write_bytes(shard.read_bytes()[:4096])
    with pytest.raises(DataError, match="shard-00001.lmdb is truncated"):
        LMDBDataset(lmdb_store)


def test_corrupt_record_names_file_and_key(lmdb_store: Path) -> None:
    shard = lmdb_store / "shard-00001.lmdb"
    raw = bytearray(shard.read_bytes())
    at = raw.index(b"s11")  # the str field of sample 11's payload
    raw[at + 1] = ord("X")
    shard.write_bytes(bytes(raw))
    data = LMDBDataset(lmdb_store)
    assert data[10]["y"] == 10
    with pytest.raises(DataError, match=r"key 0000000011 in .*shard-00001.lmdb is corrupt"):
        data[11]


def test_schema_mismatch_names_file_and_key(lmdb_store: Path) -> None:
    header_path = lmdb_store / "header.json"
    header = json.loads(header_path.read_text())
    header["schema"]["fields"][1]["shape"] = [3, 3]
    header_path.write_text(json.dumps(header))
    with pytest.raises(DataError, match=r"key 0000000000 in .*shard-00000.lmdb does not match the store's schema"):
        LMDBDataset(lmdb_store)[0]


def test_foreign_header_is_refused(tmp_path: Path, lmdb_store: Path) -> None:
    files = write_files(Mixed(), tmp_path / "files")
    with pytest.raises(DataError, match="not a rapydli-lmdb store"):
        LMDBDataset(files)
    with pytest.raises(DataError, match="not a rapydli-files store"):
        FileDataset(lmdb_store)


def test_missing_or_truncated_sample_file(tmp_path: Path) -> None:
    root = write_files(Mixed(), tmp_path / "files")
    (root / "0000000003.bin").unlink()
    record = (root / "0000000004.bin").read_bytes()
    (root / "0000000004.bin").write_bytes(record[:-3])
    data = FileDataset(root)
    with pytest.raises(DataError, match="0000000003.bin is missing"):
        data[3]
    with pytest.raises(DataError, match=r"key 0000000004 in .*0000000004.bin is truncated"):
        data[4]


def test_throttle_delay_models_latency_plus_bandwidth(tmp_path: Path) -> None:
    throttle = Throttle(read_latency_s=0.002, bandwidth_mb_s=10.0)
    assert throttle.delay(50_000) == pytest.approx(0.002 + 0.005)
    assert Throttle().delay(10**9) == 0.0
    with pytest.raises(ConfigError, match="bandwidth_mb_s"):
        Throttle(bandwidth_mb_s=0)
    with pytest.raises(ConfigError, match="read_latency_s"):
        FileDataset(write_files(Mixed(), tmp_path / "f"), read_latency_s=-1)
    slow = LMDBDataset(write_lmdb(Mixed(), tmp_path / "l"), read_latency_s=0.001, bandwidth_mb_s=5.0)
    assert _same(slow[7], Mixed()[7]) and slow.throttle.delay(slow.sample_nbytes(7)) > 0.001


def test_several_datasets_over_one_store_share_the_process_handle(lmdb_store: Path) -> None:
    first, second = LMDBDataset(lmdb_store), LMDBDataset(lmdb_store)
    assert first[3]["y"] == second[3]["y"] == pickle.loads(pickle.dumps(first))[3]["y"] == 3
    assert first._envs[0] is second._envs[0]
