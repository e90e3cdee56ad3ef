"""A NoPFS-style loader: prefetch in the known access order, cache by predicted use.

After Dryden et al., "Clairvoyant Prefetching for Distributed Machine Learning I/O"
(SC'21). The loader computes this rank's whole access stream up front
(:func:`rapydli.data.plan.access_stream`, identical to the trainer's sampler), keeps the
most frequently accessed samples in RAM and then on local disk
(:func:`rapydli.data.plan.assign_tiers`), and runs background threads that fetch ahead of
the consumer, in access order, from the fastest tier holding each sample. Batches are
collated with PyTorch's default collate, so they equal those of a
``DataLoader(dataset, batch_size, sampler=ShardSampler(...))``.

Two fetch backends: with ``workers=0``, prefetch threads in this process; with
``workers > 0``, worker processes (:mod:`rapydli.data.workers`) that fetch, decode and
collate whole batches, with the tiers in shared memory and a shared file
(:class:`~rapydli.data.tiers.SharedTier`) so that every worker hits what any of them
cached. Processes decode in parallel, where threads share one GIL; they also prefetch
across epoch boundaries (the next epoch's first batches are fetched while this one ends).

Peer fetch (a rank serving a sample from its RAM to another rank over MPI) is not
implemented: each rank reads only from its own tiers and the backing dataset.
"""

from __future__ import annotations

import collections
import functools
import math
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data._utils.collate import default_collate

from rapydli.data.epochs import EpochCursor, SizedDataset, batches_per_epoch
from rapydli.data.plan import TIERS, TierPlan, access_stream, assign_tiers
from rapydli.data.records import infer_schema
from rapydli.data.tiers import DiskTier, RamTier, SharedTier, sample_nbytes
from rapydli.data.workers import WorkerPool
from rapydli.errors import ConfigError


class ClairvoyantLoader:
    """Iterable of collated batches of this rank's share, prefetched and tier-cached.

    Parameters
    ----------
    dataset
        Map-style dataset. If it has ``sample_nbytes(index)`` (as
        :class:`~rapydli.data.store.LMDBDataset` and :class:`~rapydli.data.store.FileDataset`
        do) the plan uses those sizes; otherwise every sample is assumed to be as large as
        the first one read.
    batch_size
        Samples per batch.
    seed, rank, world_size
        The partition of :func:`rapydli.data.sampler.rank_indices` (shuffled).
    epochs
        Epochs the loader serves; each pass is the next one, ``set_epoch`` jumps.
    ram_bytes
        RAM budget for cached samples; must hold at least one batch.
    disk_bytes, disk_dir
        Local-disk budget and the directory of its cache file (default: the temp dir).
    prefetch_threads
        Background fetch threads (in all; with ``workers``, split among the workers, at
        least one each).
    drop_last
        Drop each epoch's last incomplete batch (and, as ``DistributedSampler`` does, the
        samples that do not divide evenly among ranks).
    window
        Samples fetched ahead of the consumer at most (default ``max(2 * batch_size,
        4 * prefetch_threads)``); memory stays within ``ram_bytes`` plus this window.
        With ``workers``, whole batches are fetched ahead: at least one per worker thread.
    workers
        Worker processes that fetch, decode and collate batches (see the module
        docstring); 0 fetches with threads in this process. Call :meth:`close` (or use the
        loader as a context manager) to stop them.

    Examples
    --------
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> data = TensorDataset(torch.arange(8.0))
    >>> loader = ClairvoyantLoader(data, batch_size=2, seed=0, epochs=2, ram_bytes=1024)
    >>> [len(list(loader)) for _ in range(2)]
    [4, 4]
    >>> loader.stats()["epochs"][1]["hits"]["ram"]
    8
    """

    kind = "clairvoyant"

    def __init__(
        self,
        dataset: SizedDataset,
        batch_size: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        epochs: int = 1,
        ram_bytes: int = 256 * 2**20,
        disk_bytes: int = 0,
        disk_dir: str | None = None,
        prefetch_threads: int = 8,
        drop_last: bool = False,
        window: int | None = None,
        workers: int = 0,
    ) -> None:
        for name, value in (("batch_size", batch_size), ("epochs", epochs), ("prefetch_threads", prefetch_threads)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}={value!r} is invalid: must be an integer >= 1")
        if not isinstance(workers, int) or workers < 0:
            raise ConfigError(f"workers={workers!r} is invalid: must be an integer >= 0")
        if ram_bytes < 0 or disk_bytes < 0:
            raise ConfigError(f"ram_bytes={ram_bytes}, disk_bytes={disk_bytes}: budgets must be >= 0")
        self.dataset = dataset
        self.batch_size = batch_size
        self.prefetch_threads = prefetch_threads
        self.drop_last = drop_last
        self.window = window if window is not None else max(2 * batch_size, 4 * prefetch_threads)
        if self.window < 1:
            raise ConfigError(f"window={window} is invalid: must be >= 1")
        self.stream = access_stream(len(dataset), rank, world_size, seed, epochs, drop_last)
        self._backing_nbytes = self._size_function()
        self._check_batch_fits(ram_bytes)
        self.plan: TierPlan = assign_tiers(self.stream, self._backing_nbytes, ram_bytes, disk_bytes)
        self.workers = workers
        self.ram: RamTier | SharedTier
        self.disk: DiskTier | SharedTier
        if workers:
            schema = getattr(dataset, "schema", None) or infer_schema(dataset[self.stream[0][0]])
            lock = torch.multiprocessing.get_context().Lock()
            slack = 256 * self.plan.count("ram")  # record headers (and pickles) beyond the payload
            self.ram = SharedTier(ram_bytes, len(dataset), schema, lock, slack=slack)
            self.disk = SharedTier(disk_bytes, len(dataset), schema, lock, directory=disk_dir or tempfile.gettempdir())
        else:
            self.ram, self.disk = RamTier(ram_bytes), DiskTier(disk_bytes, disk_dir)
        self._source = TieredSource(dataset, self.plan.tier, self.ram, self.disk, self._backing_nbytes)
        self._pool: WorkerPool | None = None
        self._in_flight: collections.deque[tuple[int, int, int]] = collections.deque()  # (epoch, batch, task)
        self._tasks = 0
        self._cursor = EpochCursor(epochs, len(self))
        self._epochs: list[dict[str, Any]] = []

    # -- planning ------------------------------------------------------------------------

    def _size_function(self) -> Callable[[int], int]:
        sizes = getattr(self.dataset, "sample_nbytes", None)
        if callable(sizes):
            return sizes
        first = next((epoch[0] for epoch in self.stream if epoch), 0)
        return _Uniform(sample_nbytes(self.dataset[first]))

    def _check_batch_fits(self, ram_bytes: int) -> None:
        first = self.stream[0][: self.batch_size]
        need = sum(self._backing_nbytes(i) for i in first)
        if ram_bytes < need:
            raise ConfigError(
                f"ram_bytes={ram_bytes} cannot hold one batch: batch_size={self.batch_size} samples "
                f"take about {need} bytes; raise ram_bytes (cache_ram_mb) or lower batch_size"
            )

    # -- the Loader interface ------------------------------------------------------------

    def __len__(self) -> int:
        return batches_per_epoch(len(self.stream[0]), self.batch_size, self.drop_last)

    def batches_in(self, epoch: int) -> int:
        """Batches of ``epoch`` (every epoch is whole)."""
        return len(self)

    def set_epoch(self, epoch: int, skip_batches: int = 0) -> None:
        """Make the next pass yield ``epoch``, starting after ``skip_batches`` batches.

        The skipped samples are neither read nor counted.
        """
        self._cursor.set(epoch, skip_batches)

    def __iter__(self) -> Iterator[Any]:
        epoch, skip = self._cursor.start()
        order = self.stream[epoch][: len(self) * self.batch_size][skip * self.batch_size :]
        record: dict[str, Any] = {
            "epoch": epoch,
            "batches": 0,
            "samples": 0,
            "stall_s": 0.0,
            "wall_s": 0.0,
            "hits": dict.fromkeys(TIERS, 0),
            "storage_bytes": 0,
        }
        self._epochs.append(record)
        if self.workers:
            return self._batches_from_workers(epoch, skip, record)
        return self._batches(order, record)

    def _batches(self, order: list[int], record: dict[str, Any]) -> Iterator[Any]:
        window = _Window(order, self.window)
        threads = [
            threading.Thread(target=self._prefetch, args=(window, record), name=f"rapydli-prefetch-{i}", daemon=True)
            for i in range(self.prefetch_threads)
        ]
        for thread in threads:
            thread.start()
        fetch = functools.partial(self._fetch_counted, window=window, record=record)
        started = time.perf_counter()
        try:
            for begin in range(0, len(order), self.batch_size):
                before = time.perf_counter()
                samples = [window.take(p, fetch) for p in range(begin, min(begin + self.batch_size, len(order)))]
                batch = default_collate(samples)
                record["stall_s"] += time.perf_counter() - before
                record["batches"] += 1
                record["samples"] += len(samples)
                record["wall_s"] = time.perf_counter() - started
                yield batch
        finally:
            window.stop()
            for thread in threads:
                thread.join()
            record["wall_s"] = time.perf_counter() - started

    # -- worker processes ----------------------------------------------------------------

    def _batch_indices(self, epoch: int, batch: int) -> list[int]:
        end = min((batch + 1) * self.batch_size, len(self.stream[epoch]))
        return self.stream[epoch][batch * self.batch_size : end]

    def _following(self, epoch: int, batch: int) -> tuple[int, int] | None:
        """The batch a run of passes reads after ``(epoch, batch)``; None after the last epoch."""
        if batch + 1 < len(self):
            return epoch, batch + 1
        return (epoch + 1, 0) if epoch + 1 < self._cursor.epochs else None

    def _batches_from_workers(self, epoch: int, skip: int, record: dict[str, Any]) -> Iterator[Any]:
        threads = max(1, self.prefetch_threads // self.workers)
        depth = max(self.workers * threads, math.ceil(self.window / self.batch_size))
        if self._pool is None:
            # a slot holds a batch of the largest samples, plus alignment of its tensors
            largest = max(self._backing_nbytes(i) for i in self.stream[epoch])
            slot_bytes = self.batch_size * (largest + 2 * 64) + 4096
            self._pool = WorkerPool(self._source.fetch, self.workers, threads, slots=depth, slot_bytes=slot_bytes)
        if self._in_flight and self._in_flight[0][:2] != (epoch, skip):
            # prefetched for another pass (set_epoch jumped, or a pass ended early)
            self._pool.discard()
            self._in_flight.clear()
        upcoming = self._following(*self._in_flight[-1][:2]) if self._in_flight else (epoch, skip)
        started = time.perf_counter()
        for batch in range(skip, len(self)):
            before = time.perf_counter()
            while upcoming is not None and len(self._in_flight) < depth:
                self._pool.submit(self._tasks, self._batch_indices(*upcoming))
                self._in_flight.append((*upcoming, self._tasks))
                self._tasks += 1
                upcoming = self._following(*upcoming)
            result = self._pool.result(self._in_flight.popleft()[2])
            if result.error is not None:
                self._stop_workers()
                raise result.error
            for tier, hits in result.hits.items():
                record["hits"][tier] += hits
            record["storage_bytes"] += result.storage_bytes
            record["stall_s"] += time.perf_counter() - before
            record["batches"] += 1
            record["samples"] += len(self._batch_indices(epoch, batch))
            record["wall_s"] = time.perf_counter() - started
            yield result.batch
        record["wall_s"] = time.perf_counter() - started

    def _stop_workers(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        self._in_flight.clear()

    # -- prefetch threads ------------------------------------------------------------------

    def _prefetch(self, window: _Window, record: dict[str, Any]) -> None:
        while (claim := window.claim()) is not None:
            position, index = claim
            try:
                sample = self._fetch_counted(index, window, record)
            except BaseException as error:  # noqa: BLE001 - handed to the consumer, raised there
                window.fail(position, error)
                return
            window.deliver(position, sample)

    def _fetch_counted(self, index: int, window: _Window, record: dict[str, Any]) -> Any:
        sample, tier, nbytes = self._source.fetch(index)
        with window.lock:
            record["hits"][tier] += 1
            record["storage_bytes"] += nbytes
        return sample

    def stats(self) -> dict[str, Any]:
        """Per-pass statistics and the cache state.

        Returns
        -------
        dict
            ``kind``; ``epochs``: one dict per pass with ``epoch``, ``batches``,
            ``samples``, ``stall_s`` (time the consumer spent waiting inside the loader),
            ``wall_s``, ``hits`` (``{"ram", "disk", "storage"} -> samples served``) and
            ``storage_bytes`` (bytes read from the backing dataset); ``plan``: samples
            assigned per tier; ``ram_bytes_used``, ``disk_bytes_used``.
        """
        return {
            "kind": self.kind,
            "epochs": [{**e, "hits": dict(e["hits"])} for e in self._epochs],
            "plan": {tier: self.plan.count(tier) for tier in TIERS},
            "ram_bytes_used": self.ram.used,
            "disk_bytes_used": self.disk.used,
        }

    def close(self) -> None:
        """Stop the worker processes (if any) and delete the disk tier's file."""
        self._stop_workers()
        self.disk.close()

    def __enter__(self) -> ClairvoyantLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._stop_workers()
        disk = getattr(self, "disk", None)
        if disk is not None:
            disk.close()


class _Uniform:
    """Every sample's size is the probed one (a picklable ``index -> nbytes``)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __call__(self, index: int) -> int:
        return self.nbytes


class TieredSource:
    """Fetches a sample from the fastest tier holding it, else from the dataset.

    A sample read from the dataset enters the tier the plan assigned it to (if that
    tier still has room). Used by the prefetch threads and, copied into each worker
    process, by the workers.
    """

    def __init__(
        self,
        dataset: SizedDataset,
        plan: dict[int, str],
        ram: RamTier | SharedTier,
        disk: DiskTier | SharedTier,
        backing_nbytes: Callable[[int], int],
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self.ram = ram
        self.disk = disk
        self.backing_nbytes = backing_nbytes

    def fetch(self, index: int) -> tuple[Any, str, int]:
        """``(sample, tier it came from, bytes read from backing storage)``."""
        planned = self.plan.get(index)  # a sample only ever enters its planned tier
        tier = self.ram if planned == "ram" else self.disk if planned == "disk" else None
        if tier is not None:
            assert planned is not None  # a tier is chosen only for a planned sample
            sample = tier.get(index)
            if sample is not None:
                return sample, planned, 0
        sample = self.dataset[index]
        if planned == "ram":
            self.ram.put(index, sample, sample_nbytes(sample))
        elif planned == "disk":
            self.disk.put(index, sample)
        return sample, "storage", self.backing_nbytes(index)


_UNCLAIMED = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class _Window:
    """Positions of one epoch: claimed by prefetch threads, taken in order by the consumer.

    A thread may claim position ``p`` only while ``p < consumed + size``, which bounds the
    samples held ahead of the consumer. The consumer fetches a position itself when no
    thread has claimed it by the time it is needed.
    """

    def __init__(self, order: list[int], size: int) -> None:
        self.order = order
        self.size = size
        self.lock = threading.Lock()
        self._space = threading.Condition(self.lock)
        self._filled = threading.Condition(self.lock)
        self._ready: dict[int, Any] = {}
        self._next = 0
        self._consumed = 0
        self._stopped = False

    def claim(self) -> tuple[int, int] | None:
        with self.lock:
            while not self._stopped and self._next < len(self.order) and self._next >= self._consumed + self.size:
                self._space.wait()
            if self._stopped or self._next >= len(self.order):
                return None
            position = self._next
            self._next += 1
            return position, self.order[position]

    def deliver(self, position: int, sample: Any) -> None:
        with self.lock:
            self._ready[position] = sample
            self._filled.notify()

    def fail(self, position: int, error: BaseException) -> None:
        self.deliver(position, _Failure(error))

    def take(self, position: int, fetch: Callable[[int], Any]) -> Any:
        """The sample at ``position``; fetched here with ``fetch`` if no thread has claimed it yet."""
        with self.lock:
            # the consumer has taken every earlier position, so _next >= position; if it is
            # equal, all threads are busy further back and waiting would only add latency
            while position not in self._ready and self._next != position:
                self._filled.wait()
            sample = self._ready.pop(position, _UNCLAIMED)
            if sample is _UNCLAIMED:
                self._next += 1
        if sample is _UNCLAIMED:
            sample = fetch(self.order[position])
        with self.lock:
            self._consumed = position + 1
            self._space.notify()
        if isinstance(sample, _Failure):
            raise sample.error
        return sample

    def stop(self) -> None:
        with self.lock:
            self._stopped = True
            self._space.notify_all()


def build_clairvoyant(dataset: SizedDataset, **options: Any) -> ClairvoyantLoader:
    """The ``clairvoyant`` kind from :func:`rapydli.data.loaders.build_loader`'s options."""
    if options.get("resume_from") is not None:
        raise ConfigError(
            "loader='clairvoyant' plans its accesses for one world size and cannot resume mid-epoch on another: "
            "resume on the checkpoint's number of ranks, or use loader='default'"
        )
    return ClairvoyantLoader(
        dataset,
        batch_size=options["batch_size"],
        seed=options["seed"],
        rank=options["rank"],
        world_size=options["world_size"],
        epochs=options["epochs"],
        ram_bytes=int(options["cache_ram_mb"] * 2**20),
        disk_bytes=int(options["cache_disk_mb"] * 2**20),
        disk_dir=options["disk_dir"],
        prefetch_threads=max(4, 4 * options["num_workers"]),
        drop_last=options["drop_last"],
        workers=options["num_workers"],
    )
