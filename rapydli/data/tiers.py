"""The cache tiers of the clairvoyant loader: a RAM dictionary and a local-disk file.

Both hold at most their byte budget (an insert that would pass it is refused), and both
are safe to use from several prefetch threads.
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import threading
from typing import Any

import numpy as np
import torch

from rapydli.data import records
from rapydli.errors import DataError


def sample_nbytes(sample: Any) -> int:
    """Bytes of payload a sample holds (tensors, arrays, bytes, strings, numbers, nesting).

    Examples
    --------
    >>> sample_nbytes((torch.zeros(4), 3))
    24
    """
    if isinstance(sample, torch.Tensor):
        return sample.element_size() * sample.numel()
    if isinstance(sample, np.ndarray):
        return int(sample.nbytes)
    if isinstance(sample, (bytes, bytearray, memoryview)):
        return len(sample)
    if isinstance(sample, str):
        return len(sample.encode())
    if isinstance(sample, (int, float, bool, np.generic)):
        return 8
    if isinstance(sample, dict):
        return sum(sample_nbytes(v) for v in sample.values())
    if isinstance(sample, (list, tuple)):
        return sum(sample_nbytes(v) for v in sample)
    return sys.getsizeof(sample)


class RamTier:
    """Samples kept in memory, at most ``capacity`` bytes of payload."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._items: dict[int, Any] = {}
        self._lock = threading.Lock()

    def get(self, index: int) -> Any | None:
        return self._items.get(index)

    def put(self, index: int, sample: Any, nbytes: int) -> bool:
        """Keep ``sample``; False (and nothing kept) if it would pass the budget."""
        with self._lock:
            if index in self._items or self.used + nbytes > self.capacity:
                return False
            self._items[index] = sample
            self.used += nbytes
            return True

    def __len__(self) -> int:
        return len(self._items)


class DiskTier:
    """Samples appended to one file in ``directory``, at most ``capacity`` bytes of it.

    Samples are stored as :mod:`rapydli.data.records` records (raw payload plus a small
    checksummed header, the same bytes an LMDB store holds); a sample of a kind records
    cannot hold is pickled instead. The file is created on the first insert and removed
    by :meth:`close`.
    """

    def __init__(self, capacity: int, directory: str | None = None) -> None:
        self.capacity = capacity
        self.directory = directory
        self.used = 0
        self.path: str | None = None
        self._fd: int | None = None
        self._index: dict[int, tuple[int, int, dict[str, Any] | None]] = {}
        self._lock = threading.Lock()

    def get(self, index: int) -> Any | None:
        where = self._index.get(index)
        if where is None:
            return None
        offset, length, schema = where
        assert self._fd is not None  # opened by the first put, before any index is published
        data = os.pread(self._fd, length, offset)
        if schema is None:
            return pickle.loads(data)
        return records.decode(data, schema, f"sample {index} in the disk cache {self.path}")

    def put(self, index: int, sample: Any) -> bool:
        """Append ``sample`` to the file; False (and nothing written) if it would pass the budget."""
        schema: dict[str, Any] | None
        try:
            schema = records.infer_schema(sample)
            data = records.encode(sample, schema, f"sample {index}")
        except DataError:  # a kind records cannot hold
            schema, data = None, pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if index in self._index or self.used + len(data) > self.capacity:
                return False
            if self._fd is None:
                if self.directory is not None:
                    os.makedirs(self.directory, exist_ok=True)
                self._fd, self.path = tempfile.mkstemp(prefix="rapydli-cache-", suffix=".bin", dir=self.directory)
            offset = self.used
            self.used += len(data)
        os.pwrite(self._fd, data, offset)
        self._index[index] = (offset, len(data), schema)  # published only once written
        return True

    def __len__(self) -> int:
        return len(self._index)

    def close(self) -> None:
        """Delete the cache file."""
        with self._lock:
            if self._fd is not None:
                assert self.path is not None  # created with the descriptor
                os.close(self._fd)
                os.unlink(self.path)
                self._fd = None
                self._index.clear()


_ABSENT, _RECORD, _PICKLE = 0, 1, 2


class SharedTier:
    """A cache tier that every worker process of a loader reads and fills: shared memory or a file.

    The index (``sample -> offset, length, kind``), the byte counters and the lock live
    in shared memory, so a sample one worker cached is a hit for all of them. Entries are
    :mod:`rapydli.data.records` records in ``schema`` (the store's, or the first sample's)
    or, for samples that do not match it, pickles. Entries are appended and never
    evicted, as tier membership is planned up front.

    Parameters
    ----------
    capacity
        Budget: payload bytes in memory (as :class:`RamTier`), bytes written on disk (as
        :class:`DiskTier`).
    num_samples
        Size of the dataset (the index has one row per sample).
    schema
        The record schema entries are written in.
    lock
        A lock of the multiprocessing context the workers are started from.
    directory
        ``None`` for a shared-memory region; else the directory of the cache file (the
        local-disk tier), which every process opens for itself by path.
    slack
        Extra memory for record headers and pickles beyond ``capacity`` payload bytes.
    """

    def __init__(
        self,
        capacity: int,
        num_samples: int,
        schema: dict[str, Any],
        lock: Any,
        directory: str | None = None,
        slack: int = 0,
    ) -> None:
        self.capacity = capacity
        self.schema = schema
        self.space = capacity + (slack if directory is None else 0) if capacity > 0 else 0
        self._lock = lock
        # torch allocates the shared memory (and carries it to spawned workers); numpy indexes it
        self._shared = {
            "index": torch.zeros((num_samples, 3), dtype=torch.int64).share_memory_(),  # offset, length, kind
            "counters": torch.zeros(2, dtype=torch.int64).share_memory_(),  # budget bytes used, region bytes
        }
        self.path: str | None = None
        if directory is None:
            self._shared["memory"] = torch.empty(self.space, dtype=torch.uint8).share_memory_()
        elif self.space > 0:
            os.makedirs(directory, exist_ok=True)
            fd, self.path = tempfile.mkstemp(prefix="rapydli-cache-", suffix=".bin", dir=directory)
            os.close(fd)
        self._views()

    def _views(self) -> None:
        self._index, self._counters = self._shared["index"].numpy(), self._shared["counters"].numpy()
        self._memory = self._shared["memory"].numpy() if "memory" in self._shared else None
        self._fd: tuple[int, int] | None = None  # (pid, descriptor): never used across a fork

    def __getstate__(self) -> dict[str, Any]:
        return {
            k: v for k, v in self.__dict__.items() if k in ("capacity", "schema", "space", "_lock", "_shared", "path")
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()

    @property
    def used(self) -> int:
        """Bytes of the budget used."""
        return int(self._counters[0])

    def _file(self) -> int:
        if self._fd is None or self._fd[0] != os.getpid():
            assert self.path is not None  # a tier without shared memory has its file once anything is stored
            self._fd = (os.getpid(), os.open(self.path, os.O_RDWR))
        return self._fd[1]

    def get(self, index: int) -> Any | None:
        """The sample, or None. From memory, its tensors and arrays are views of the tier: do not modify them."""
        with self._lock:
            offset, length, kind = self._index[index].tolist()
        if kind == _ABSENT:
            return None
        data: bytes | memoryview
        if self._memory is not None:
            data = memoryview(self._memory[offset : offset + length])
        else:
            data = os.pread(self._file(), length, offset)
        if kind == _PICKLE:
            return pickle.loads(data)
        if self._memory is not None:  # written by this loader, never changed: no checksum, no copy
            return records.decode(data, self.schema, f"sample {index} in the shared RAM cache", check=False, copy=False)
        return records.decode(data, self.schema, f"sample {index} in the disk cache {self.path}")

    def put(self, index: int, sample: Any, nbytes: int | None = None) -> bool:
        """Keep ``sample``; False (nothing kept) if it would pass the budget.

        The budget counts payload bytes (``nbytes``, default :func:`sample_nbytes`) in
        memory, as :class:`RamTier` does, and bytes written on disk, as :class:`DiskTier` does.
        """
        try:
            kind, data = _RECORD, records.encode(sample, self.schema, f"sample {index}")
        except DataError:  # not in the schema: keep it as a pickle
            kind, data = _PICKLE, pickle.dumps(sample, protocol=pickle.HIGHEST_PROTOCOL)
        in_memory = self._memory is not None
        charge = (sample_nbytes(sample) if nbytes is None else nbytes) if in_memory else len(data)
        with self._lock:
            used, offset = self._counters.tolist()
            if self._index[index, 2] != _ABSENT or used + charge > self.capacity or offset + len(data) > self.space:
                return False
            self._counters[:] = (used + charge, offset + len(data))
        if self._memory is not None:
            self._memory[offset : offset + len(data)] = np.frombuffer(data, dtype=np.uint8)
        else:
            os.pwrite(self._file(), data, offset)
        with self._lock:  # published only once written
            self._index[index] = (offset, len(data), kind)
        return True

    def __len__(self) -> int:
        return int((self._index[:, 2] != _ABSENT).sum())

    def close(self) -> None:
        """Delete the cache file (the owner calls this once the workers are gone)."""
        if self._fd is not None and self._fd[0] == os.getpid():
            os.close(self._fd[1])
        self._fd = None
        if self.path is not None and os.path.exists(self.path):
            os.unlink(self.path)
        self.path = None
