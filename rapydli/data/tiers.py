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
        data = os.pread(self._fd, length, offset)
        if schema is None:
            return pickle.loads(data)
        return records.decode(data, schema, f"sample {index} in the disk cache {self.path}")

    def put(self, index: int, sample: Any) -> bool:
        """Append ``sample`` to the file; False (and nothing written) if it would pass the budget."""
        try:
            schema: dict[str, Any] | None = records.infer_schema(sample)
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
                os.close(self._fd)
                os.unlink(self.path)
                self._fd = None
                self._index.clear()
