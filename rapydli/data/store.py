"""Sample stores: an LMDB store (fast), and a directory of files (the slow baseline).

Both hold the records of :mod:`rapydli.data.records` and a ``header.json`` with the
format, the number of samples, the sample schema and the index (each record's size, and
for LMDB the shard files with their sample ranges and sizes). The header is written last,
so an interrupted write leaves no store that looks complete.

Reading never returns a silently wrong or short epoch: a missing file, a truncated or
corrupt record or shard, or a record that does not match the schema raises
:class:`~rapydli.errors.DataError` naming the file and the key.

Emulated parallel file system: both datasets accept ``read_latency_s`` and
``bandwidth_mb_s``. Each read then sleeps ``read_latency_s + nbytes / (bandwidth_mb_s *
1e6)`` seconds before returning, as a read from a remote parallel file system would take
(this is an emulation for benchmarks: the data itself comes from the local disk or page
cache). Concurrent reads do not slow each other down, as on a file system whose aggregate
bandwidth is far above one client's.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from rapydli.data.epochs import SizedDataset
from rapydli.data.records import decode, encode, infer_schema
from rapydli.errors import ConfigError, DataError

FORMAT_VERSION = 1
HEADER = "header.json"


class Throttle:
    """Per-read delay emulating remote storage: ``read_latency_s + nbytes / bandwidth``.

    Parameters
    ----------
    read_latency_s
        Seconds every read waits before its data arrives.
    bandwidth_mb_s
        Bandwidth of one read in MB/s (10**6 bytes); ``None`` for unlimited.
    """

    def __init__(self, read_latency_s: float = 0.0, bandwidth_mb_s: float | None = None) -> None:
        if read_latency_s < 0:
            raise ConfigError(f"read_latency_s={read_latency_s} is invalid: must be >= 0")
        if bandwidth_mb_s is not None and bandwidth_mb_s <= 0:
            raise ConfigError(f"bandwidth_mb_s={bandwidth_mb_s} is invalid: must be > 0 or None")
        self.read_latency_s = read_latency_s
        self.bandwidth_mb_s = bandwidth_mb_s

    def delay(self, nbytes: int) -> float:
        """Seconds a read of ``nbytes`` takes."""
        transfer = nbytes / (self.bandwidth_mb_s * 1e6) if self.bandwidth_mb_s else 0.0
        return self.read_latency_s + transfer

    def wait(self, nbytes: int) -> None:
        """Sleep as long as a read of ``nbytes`` takes."""
        seconds = self.delay(nbytes)
        if seconds > 0:
            time.sleep(seconds)


def _write_header(directory: Path, header: dict[str, Any]) -> None:
    partial = directory / (HEADER + ".partial")
    partial.write_text(json.dumps(header))
    os.replace(partial, directory / HEADER)


def _read_header(directory: Path, fmt: str) -> dict[str, Any]:
    path = directory / HEADER
    if not path.is_file():
        raise DataError(f"{path} is missing: {directory} is not a complete {fmt} store")
    try:
        header = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise DataError(f"{path} cannot be read: {error}") from error
    if not isinstance(header, dict) or header.get("format") != fmt or header.get("version") != FORMAT_VERSION:
        raise DataError(
            f"{path} is not a {fmt} store of version {FORMAT_VERSION}: "
            f"format={header.get('format') if isinstance(header, dict) else None!r}"
        )
    return header


def _check_index(index: int, length: int) -> int:
    if index < 0:
        index += length
    if not 0 <= index < length:
        raise IndexError(f"sample index {index} is out of range for a store of {length} samples")
    return index


def _key(index: int) -> str:
    return f"{index:010d}"


def _samples(dataset: SizedDataset) -> int:
    try:
        count = len(dataset)
    except TypeError as error:
        raise ConfigError("dataset must be map-style (have __len__ and __getitem__)") from error
    if count < 1:
        raise ConfigError(f"dataset is empty: len(dataset)={count}, need at least 1")
    return count


def write_lmdb(dataset: SizedDataset, path: str | os.PathLike, shard_size: int = 4096) -> Path:
    """Write a map-style dataset into an LMDB store at directory ``path``.

    Parameters
    ----------
    dataset
        Map-style dataset whose samples are tensors, arrays, bytes, str or numbers, or a
        tuple/list/dict of them; all must share the first sample's schema (dtype, shape).
    path
        Directory to create (must not hold a store already).
    shard_size
        Samples per LMDB file (``shard-00000.lmdb``, ...); each is written in one transaction.

    Returns
    -------
    Path
        The store's directory, readable with :class:`LMDBDataset`.

    Examples
    --------
    >>> import tempfile, torch
    >>> from torch.utils.data import TensorDataset
    >>> root = write_lmdb(TensorDataset(torch.arange(5.0)), tempfile.mkdtemp() + "/s", shard_size=2)
    >>> LMDBDataset(root)[3]
    (tensor(3.),)
    """
    import lmdb

    if not isinstance(shard_size, int) or shard_size < 1:
        raise ConfigError(f"shard_size={shard_size!r} is invalid: must be an integer >= 1")
    count = _samples(dataset)
    root = Path(path)
    if (root / HEADER).exists():
        raise ConfigError(f"path={str(root)!r} already holds a store; choose a new directory")
    root.mkdir(parents=True, exist_ok=True)
    schema = infer_schema(dataset[0])
    sizes: list[int] = []
    shards = []
    for number, start in enumerate(range(0, count, shard_size)):
        stop = min(start + shard_size, count)
        name = f"shard-{number:05d}.lmdb"
        records = [encode(dataset[i], schema, f"sample {i} of the dataset") for i in range(start, stop)]
        sizes.extend(len(r) for r in records)
        map_size = 2 * sum(len(r) + 64 for r in records) + 2**20
        env = lmdb.open(str(root / name), map_size=map_size, subdir=False, lock=False, sync=False)
        try:
            with env.begin(write=True) as txn:
                for i, record in zip(range(start, stop), records):
                    txn.put(_key(i).encode(), record)
            env.sync(True)
        finally:
            env.close()
        shards.append({"file": name, "start": start, "stop": stop, "file_bytes": (root / name).stat().st_size})
    _write_header(
        root,
        {
            "format": "rapydli-lmdb",
            "version": FORMAT_VERSION,
            "num_samples": count,
            "shard_size": shard_size,
            "schema": schema,
            "shards": shards,
            "record_bytes": sizes,
        },
    )
    return root


# LMDB allows one open environment per file and process, so every LMDBDataset of a
# process over the same file shares one read-only handle: (pid, device, inode) -> Environment.
_OPEN: dict[tuple[int, int, int], Any] = {}
_OPEN_LOCK = threading.Lock()


def _open_readonly(file: Path) -> Any:
    """This process's read-only, lock-free environment of ``file`` (opened once)."""
    import lmdb

    try:
        stat = file.stat()
    except OSError as error:
        raise DataError(f"{file} is missing: {error}") from error
    key = (os.getpid(), stat.st_dev, stat.st_ino)
    with _OPEN_LOCK:
        for inherited in [k for k in _OPEN if k[0] != key[0]]:  # a forked child: close the parent's
            _OPEN.pop(inherited).close()
        env = _OPEN.get(key)
        if env is None:
            try:
                env = lmdb.open(str(file), subdir=False, readonly=True, lock=False, readahead=False, max_readers=512)
            except lmdb.Error as error:
                raise DataError(f"{file} cannot be opened as LMDB: {error}") from error
            _OPEN[key] = env
        return env


class LMDBDataset(Dataset):
    """A map-style dataset over a store written by :func:`write_lmdb`.

    Safe to use from several processes and ranks: every process opens its own read-only,
    lock-free LMDB environments on first use (a forked worker or an unpickled copy never
    reuses its parent's handles). Threads, and all datasets over the same store, of one
    process share them (LMDB allows one environment per file and process).

    Parameters
    ----------
    path
        The store's directory.
    read_latency_s, bandwidth_mb_s
        Emulated remote storage (see the module docstring); off by default.
    """

    def __init__(
        self, path: str | os.PathLike, read_latency_s: float = 0.0, bandwidth_mb_s: float | None = None
    ) -> None:
        self.path = Path(path)
        self.header = _read_header(self.path, "rapydli-lmdb")
        self.schema = self.header["schema"]
        self.throttle = Throttle(read_latency_s, bandwidth_mb_s)
        self._sizes = self.header["record_bytes"]
        for shard in self.header["shards"]:
            file = self.path / shard["file"]
            if not file.is_file():
                raise DataError(f"{file} is missing: the store's header lists it")
            if file.stat().st_size < shard["file_bytes"]:
                raise DataError(f"{file} is truncated: {file.stat().st_size} bytes, it was {shard['file_bytes']}")
        self._envs: dict[int, Any] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return self.header["num_samples"]

    def sample_nbytes(self, index: int) -> int:
        """Bytes read from the store for sample ``index`` (from the index, no I/O)."""
        return self._sizes[index]

    def _env(self, shard: int) -> Any:
        if self._pid != os.getpid():  # a forked child: never touch the parent's handles
            self._envs, self._pid = {}, os.getpid()
        env = self._envs.get(shard)
        if env is None:
            env = self._envs.setdefault(shard, _open_readonly(self.path / self.header["shards"][shard]["file"]))
        return env

    def __getitem__(self, index: int) -> Any:
        import lmdb

        index = _check_index(index, len(self))
        shard = index // self.header["shard_size"]
        file = self.path / self.header["shards"][shard]["file"]
        where = f"key {_key(index)} in {file}"
        try:
            with self._env(shard).begin(buffers=True) as txn:
                record = txn.get(_key(index).encode())
                if record is None:
                    raise DataError(f"{where} is missing")
                sample = decode(record, self.schema, where)
                nbytes = len(record)
        except lmdb.Error as error:
            raise DataError(f"{where} cannot be read: {error}") from error
        self.throttle.wait(nbytes)
        return sample

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_envs"] = {}
        return state


def write_files(dataset: SizedDataset, directory: str | os.PathLike) -> Path:
    """Write a map-style dataset as one file per sample (``0000000000.bin``, ...) plus a header.

    The samples follow the same rules as in :func:`write_lmdb`.
    """
    count = _samples(dataset)
    root = Path(directory)
    if (root / HEADER).exists():
        raise ConfigError(f"directory={str(root)!r} already holds a store; choose a new directory")
    root.mkdir(parents=True, exist_ok=True)
    schema = infer_schema(dataset[0])
    sizes = []
    for i in range(count):
        record = encode(dataset[i], schema, f"sample {i} of the dataset")
        (root / f"{_key(i)}.bin").write_bytes(record)
        sizes.append(len(record))
    _write_header(
        root,
        {
            "format": "rapydli-files",
            "version": FORMAT_VERSION,
            "num_samples": count,
            "schema": schema,
            "record_bytes": sizes,
        },
    )
    return root


class FileDataset(Dataset):
    """A directory of one file per sample (written by :func:`write_files`): the slow baseline.

    Every ``__getitem__`` opens and reads one file, as loading image files from a
    parallel file system does; with ``read_latency_s`` / ``bandwidth_mb_s`` each read also
    waits as a remote read would (an emulation, see the module docstring).

    Parameters
    ----------
    directory
        The store's directory.
    read_latency_s, bandwidth_mb_s
        Emulated remote storage; off by default.
    """

    def __init__(
        self, directory: str | os.PathLike, read_latency_s: float = 0.0, bandwidth_mb_s: float | None = None
    ) -> None:
        self.path = Path(directory)
        self.header = _read_header(self.path, "rapydli-files")
        self.schema = self.header["schema"]
        self.throttle = Throttle(read_latency_s, bandwidth_mb_s)
        self._sizes = self.header["record_bytes"]

    def __len__(self) -> int:
        return self.header["num_samples"]

    def sample_nbytes(self, index: int) -> int:
        """Bytes of sample ``index``'s file (from the index, no I/O)."""
        return self._sizes[index]

    def __getitem__(self, index: int) -> Any:
        index = _check_index(index, len(self))
        file = self.path / f"{_key(index)}.bin"
        where = f"key {_key(index)} in {file}"
        try:
            record = file.read_bytes()
        except FileNotFoundError as error:
            raise DataError(f"{file} is missing (sample {index} of the store)") from error
        except OSError as error:
            raise DataError(f"{where} cannot be read: {error}") from error
        sample = decode(record, self.schema, where)
        self.throttle.wait(len(record))
        return sample


def store_bytes(dataset: LMDBDataset | FileDataset) -> int:
    """Total record bytes of a store (``sum(sample_nbytes)``)."""
    return sum(dataset.sample_nbytes(i) for i in range(len(dataset)))
