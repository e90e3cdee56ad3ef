"""What every data loader shares: the :class:`Loader` and :class:`SizedDataset` protocols and the epoch bookkeeping.

Each pass over a loader is the next epoch (starting at 0); ``set_epoch(e,
skip_batches=k)`` makes the next pass epoch ``e``, starting after its first ``k``
batches. :class:`EpochCursor` holds exactly that, so every loader kind agrees on it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from rapydli.errors import ConfigError


class SizedDataset(Protocol):
    """A map-style dataset: ``len(dataset)`` samples, ``dataset[i]`` for ``0 <= i < len(dataset)``.

    What the loaders and stores read from. :class:`torch.utils.data.Dataset` declares
    ``__getitem__`` but not ``__len__``; the map-style datasets (``TensorDataset``, the
    stores of :mod:`rapydli.data.store`) have both.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Any: ...


@runtime_checkable
class Loader(Protocol):
    """What the trainer needs from a data loader."""

    def __iter__(self) -> Iterator[Any]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None: ...

    def batches_in(self, epoch: int) -> int: ...

    def stats(self) -> dict[str, Any]: ...


def batches_per_epoch(shard: int, batch_size: int, drop_last: bool) -> int:
    """Batches in one epoch of ``shard`` samples."""
    return shard // batch_size if drop_last else -(-shard // batch_size)


class EpochCursor:
    """Which epoch the next pass yields and how many of its batches to skip.

    Shared by the loaders so they agree on the epoch semantics described in the module
    docstring.
    """

    def __init__(self, epochs: int, batches: int) -> None:
        self.epochs = epochs
        self.batches = batches
        self.next_epoch = 0
        self.skip = 0

    def set(self, epoch: int, skip_batches: int) -> None:
        if not 0 <= epoch < self.epochs:
            raise ConfigError(f"epoch={epoch} is out of range: the loader was built for epochs={self.epochs}")
        if not 0 <= skip_batches <= self.batches:
            raise ConfigError(f"skip_batches={skip_batches} is invalid: must be in [0, {self.batches}]")
        self.next_epoch = epoch
        self.skip = skip_batches

    def start(self) -> tuple[int, int]:
        """Take the epoch and skip for a new pass, and advance to the next epoch."""
        epoch, skip = self.next_epoch, self.skip
        if epoch >= self.epochs:
            raise ConfigError(
                f"the loader was built for epochs={self.epochs} and all of them have been iterated; "
                "call set_epoch(e) to go back to an earlier epoch"
            )
        self.next_epoch, self.skip = epoch + 1, 0
        return epoch, skip
