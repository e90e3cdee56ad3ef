"""One entry point for the trainer's data loaders, chosen by name.

:func:`build_loader` returns a :class:`Loader`: an iterable of collated batches of this
rank's share of each epoch, in exactly the order :func:`rapydli.data.sampler.rank_indices`
gives. Every kind yields the same batches for the same seed, so switching kinds never
changes training results, only how fast the batches arrive.

Kinds (the registry :data:`rapydli.data.kinds.LOADERS`):

``"default"``
    :class:`torch.utils.data.DataLoader` over a :class:`~rapydli.data.sampler.ShardSampler`.
``"clairvoyant"``
    :class:`rapydli.data.clairvoyant.ClairvoyantLoader` (NoPFS-style prefetching and tiered
    caching by predicted access frequency).

Epochs: each pass over a loader is the next epoch (starting at 0); ``set_epoch(e,
skip_batches=k)`` makes the next pass epoch ``e``, starting after its first ``k`` batches
(to resume mid-epoch without loading the skipped samples).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from rapydli.data.epochs import EpochCursor, Loader, SizedDataset, batches_per_epoch
from rapydli.data.kinds import LOADERS
from rapydli.data.sampler import ShardSampler
from rapydli.errors import ConfigError


class _SkippingSampler(Sampler[int]):
    """A :class:`ShardSampler` whose next pass starts after ``skip`` samples."""

    def __init__(self, sampler: ShardSampler) -> None:
        self.sampler = sampler
        self.skip = 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.sampler.indices()[self.skip :].tolist())

    def __len__(self) -> int:
        return len(self.sampler) - self.skip


class DefaultLoader:
    """:class:`torch.utils.data.DataLoader` over this rank's :class:`ShardSampler` share.

    Parameters are those of :func:`build_loader`. With ``num_workers > 0`` the workers
    persist across epochs.
    """

    kind = "default"

    def __init__(
        self,
        dataset: SizedDataset,
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        epochs: int,
        num_workers: int = 0,
        drop_last: bool = False,
        resume_from: tuple[int, int] | None = None,
    ) -> None:
        self.sampler = ShardSampler(len(dataset), rank=rank, world_size=world_size, seed=seed, resume_from=resume_from)
        self.batch_size = batch_size
        self.drop_last = drop_last
        self._skipping = _SkippingSampler(self.sampler)
        # DataLoader reads any map-style object (__getitem__ and __len__); torch's annotation names its Dataset class
        self._loader: DataLoader[Any] = DataLoader(
            dataset,  # type: ignore[arg-type]
            batch_size=batch_size,
            sampler=self._skipping,
            num_workers=num_workers,
            drop_last=drop_last,
            persistent_workers=num_workers > 0,
        )
        self._cursor = EpochCursor(epochs, len(self))
        self._epochs: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return batches_per_epoch(self.sampler.length(), self.batch_size, self.drop_last)

    def batches_in(self, epoch: int) -> int:
        """Batches of ``epoch`` (fewer in the epoch a run resumed on another world size)."""
        return batches_per_epoch(self.sampler.length(epoch), self.batch_size, self.drop_last)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Make the next pass yield ``epoch``, starting after ``skip_batches`` batches."""
        self._cursor.set(epoch, skip_batches)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._cursor.start()
        self.sampler.set_epoch(epoch)
        self._skipping.skip = min(skip * self.batch_size, len(self.sampler))
        record = {"epoch": epoch, "batches": 0, "samples": 0, "stall_s": 0.0, "wall_s": 0.0}
        self._epochs.append(record)
        return self._batches(record)

    def _batches(self, record: dict[str, Any]) -> Iterator[Any]:
        started = time.perf_counter()
        iterator = iter(self._loader)
        while True:
            before = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                break
            record["stall_s"] += time.perf_counter() - before
            record["batches"] += 1
            record["samples"] += _batch_length(batch)
            record["wall_s"] = time.perf_counter() - started
            yield batch
        record["wall_s"] = time.perf_counter() - started

    def stats(self) -> dict[str, Any]:
        """``{"kind": "default", "epochs": [per-epoch dicts]}``; see :func:`build_loader`."""
        return {"kind": self.kind, "epochs": [dict(e) for e in self._epochs]}


def _batch_length(batch: Any) -> int:
    """Number of samples in a collated batch (its first tensor's leading dimension)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    if isinstance(batch, dict):
        return _batch_length(next(iter(batch.values())))
    if isinstance(batch, (list, tuple)):
        return _batch_length(batch[0])
    return 1


def build_default(dataset: SizedDataset, **options: Any) -> Loader:
    """The ``default`` kind: a :class:`DefaultLoader` (the cache options do not apply)."""
    for unused in ("cache_ram_mb", "cache_disk_mb", "disk_dir"):
        options.pop(unused)
    return DefaultLoader(dataset, **options)


def build_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    epochs: int,
    kind: str = "default",
    num_workers: int = 0,
    drop_last: bool = False,
    cache_ram_mb: float = 256.0,
    cache_disk_mb: float = 0.0,
    disk_dir: str | None = None,
    resume_from: tuple[int, int] | None = None,
    pin_memory: bool = False,
) -> Loader:
    """Build this rank's loader of ``kind`` over a map-style ``dataset``.

    Parameters
    ----------
    dataset
        Map-style dataset (``__len__`` and ``__getitem__``).
    batch_size
        Samples per batch on this rank.
    rank, world_size, seed
        The partition and shuffle of :func:`rapydli.data.sampler.rank_indices`.
    epochs
        Number of epochs the loader serves (``0 .. epochs - 1``).
    kind
        A name in :data:`rapydli.data.kinds.LOADERS`: ``"default"``, ``"clairvoyant"``, or
        one another package registered.
    num_workers
        Worker processes of either kind; the clairvoyant loader runs
        ``max(4, 4 * num_workers)`` prefetch threads among them (in this process when 0).
    drop_last
        Drop each epoch's last incomplete batch.
    cache_ram_mb, cache_disk_mb, disk_dir
        Cache budgets and the local directory of the disk tier (``"clairvoyant"`` only).
    resume_from
        ``(epoch, start)``: that epoch begins at position ``start`` of its global order,
        re-sharded over ``world_size`` ranks (a run resumed on another number of ranks;
        ``"default"`` only).
    pin_memory
        Yield every batch's tensors in page-locked (pinned) host memory, so a
        ``.to("cuda", non_blocking=True)`` copy runs asynchronously (the Trainer asks for
        it when the model is on a GPU). Any kind, registered ones too (:class:`PinnedLoader`).

    Returns
    -------
    Loader
        Iterable of collated batches, with ``set_epoch(epoch, skip_batches=0)``,
        ``len()`` (batches per epoch) and ``stats()`` (``{"kind": ..., "epochs": [...]}``,
        one dict per pass with at least ``epoch``, ``batches``, ``samples``, ``stall_s``,
        ``wall_s``).

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> data = TensorDataset(torch.arange(10.0))
    >>> loader = build_loader(data, batch_size=4, rank=0, world_size=2, seed=0, epochs=1)
    >>> len(loader), [b[0].shape[0] for b in loader]
    (2, [4, 1])
    """
    LOADERS.check(kind)
    _check_positive(batch_size=batch_size, epochs=epochs)
    if num_workers < 0:
        raise ConfigError(f"num_workers={num_workers} is invalid: must be >= 0")
    if cache_ram_mb < 0 or cache_disk_mb < 0:
        raise ConfigError(f"cache_ram_mb={cache_ram_mb}, cache_disk_mb={cache_disk_mb}: budgets must be >= 0")
    loader = LOADERS.load(kind)(
        dataset,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        epochs=epochs,
        num_workers=num_workers,
        drop_last=drop_last,
        cache_ram_mb=cache_ram_mb,
        cache_disk_mb=cache_disk_mb,
        disk_dir=disk_dir,
        resume_from=resume_from,
    )
    return PinnedLoader(loader) if pin_memory else loader


class PinnedLoader:
    """A :class:`Loader` whose batches are copied into page-locked (pinned) host memory.

    Every tensor of a batch (nested in tuples, lists and dicts) is pinned as the batch is
    yielded; everything else about the pass (its length, epochs, statistics) is the
    wrapped loader's. Pinning needs a CUDA driver: on a machine without one, batches pass
    through unchanged.
    """

    def __init__(self, loader: Loader) -> None:
        self.loader = loader
        self.pinning = torch.cuda.is_available()

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            yield pinned(batch) if self.pinning else batch

    def __len__(self) -> int:
        return len(self.loader)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        self.loader.set_epoch(epoch, skip_batches)

    def batches_in(self, epoch: int) -> int:
        return self.loader.batches_in(epoch)

    def stats(self) -> dict[str, Any]:
        return self.loader.stats()

    def __getattr__(self, name: str) -> Any:  # close(), kind and whatever else the wrapped loader offers
        return getattr(self.__dict__["loader"], name)


def pinned(batch: Any) -> Any:
    """``batch`` with every tensor in it (in tuples, lists and dicts) copied to pinned host memory."""
    if isinstance(batch, torch.Tensor):
        return batch if batch.is_pinned() else batch.pin_memory()
    if isinstance(batch, tuple | list):
        return type(batch)(pinned(item) for item in batch)
    if isinstance(batch, dict):
        return {key: pinned(value) for key, value in batch.items()}
    return batch


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{name}={value!r} is invalid: must be an integer >= 1")
