"""Checkpoints: one manager for every layout, written atomically and in the background.

A checkpoint of step ``N`` in ``checkpoint_dir`` is a set of *parts* and a *manifest*:

* each rank that holds state no other rank holds writes one part,
  ``part-s<stage>-t<tensor rank>-d<replica>-step<N>.pt``: its parameters and buffers
  (replica 0 of each stage and tensor rank), and its optimizer state (replica 0, or with
  ZeRO every replica its shard), as :class:`~rapydli.trainer.manifest.Entry` lists naming
  each tensor by the full parameter it belongs to and the slice of it held
  (:mod:`rapydli.trainer.manifest`). A replicated (plain data-parallel) run writes one part.
* rank 0 writes ``checkpoint.pt``, the manifest: the layout it was written by, the parts
  and which tensors each holds, the run's progress (step, sampler position, batch), every
  rank's RNG state. It is written only when every part is on disk (the
  ranks agree on it), so a reader finds the previous complete checkpoint or the new one,
  never half of one; parts of older steps are removed after that.

Every file is written with :func:`save_atomic` (temp file, fsync, rename). The step waits
only for a copy of the state in memory: a thread on each rank writes its part, the ranks'
threads agree over a communicator of their own, and rank 0's writes the manifest; the
next checkpoint, the end of :meth:`~rapydli.trainer.loop.Trainer.fit` and
:meth:`~rapydli.trainer.loop.Trainer.close` wait for it.

A checkpoint resumes under any layout (:meth:`CheckpointManager.load`): each rank reads
the parts that hold pieces of what it trains, assembles each full tensor and cuts its own
slice of it. :func:`read_state_dict` assembles the whole model's state the same way (what
``result.model()`` and ``rd.load`` return).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import random
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapydli.errors import ConfigError
from rapydli.parallel.layout import Layout
from rapydli.paths import private_dir

log = logging.getLogger(__name__)

CHECKPOINT_NAME = "checkpoint.pt"
FORMAT_VERSION = 2


def checkpoint_path(directory: str | os.PathLike[str]) -> Path:
    """The checkpoint file inside ``directory``."""
    return Path(directory) / CHECKPOINT_NAME


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and python RNG states."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state`."""
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_atomic(state: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write ``state`` with :func:`torch.save` to ``path`` atomically (temp file + fsync + rename).

    Returns the path. If anything fails, the temporary file is removed, the previous
    file at ``path`` (if any) is untouched, and the error propagates.
    """
    target = Path(path)
    private_dir(target.parent)  # a new checkpoint directory is the user's only; mkstemp's files are 0600
    handle, temp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            torch.save({"format": FORMAT_VERSION, **state}, stream)
            stream.flush()
            os.fsync(stream.fileno())
        os.replace(temp, target)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
    directory = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    return target


class CheckpointWriter:
    """Writes checkpoints with :func:`save_atomic` on a background thread, one at a time.

    Attributes
    ----------
    spans
        ``(start, end)`` of every finished write, in :func:`time.perf_counter` seconds: when
        the thread was writing (``rapydli bench trainer`` sorts the steps by them).

    Examples
    --------
    >>> writer = CheckpointWriter()  # doctest: +SKIP
    >>> writer.submit({"model": model.state_dict()}, "run/checkpoint.pt")  # doctest: +SKIP
    >>> writer.wait()  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.spans: list[tuple[float, float]] = []

    def submit(self, state: dict[str, Any], path: str | os.PathLike[str]) -> None:
        """Copy ``state`` now (tensors cloned) and write the copy in the background.

        Waits for the previous write first, and raises its error if it failed.
        """
        snapshot = copy.deepcopy(state)
        self.run(lambda: save_atomic(snapshot, path))

    def run(self, write: Callable[[], Any], background: bool = True) -> None:
        """Wait for the previous write (raising its error), then call ``write`` on the thread (or here).

        ``write`` must hold its own copy of what it writes. An exception it raises is
        raised by the next :meth:`wait`.
        """
        self.wait()

        def task() -> None:
            started = time.perf_counter()
            try:
                write()
            except BaseException as exc:  # noqa: BLE001 - raised in the training thread by wait()
                self._error = exc
            self.spans.append((started, time.perf_counter()))

        if not background:
            task()
            return
        self._thread = threading.Thread(target=task, name="rapydli-checkpoint", daemon=True)
        self._thread.start()

    def wait(self, raise_error: bool = True) -> None:
        """Block until the write in flight (if any) is on disk; raise its error if it failed.

        With ``raise_error=False`` a failed write is logged instead (for a caller that is
        already raising an error of its own).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None and not raise_error:
            log.warning("a checkpoint write failed: %s", self._error)
            self._error = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def remove_partial_writes(directory: str | os.PathLike[str]) -> None:
    """Delete temporary files of writes that never finished (a process killed mid-write)."""
    for partial in Path(directory).glob(".*.pt.*.tmp"):
        partial.unlink(missing_ok=True)


def load(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint written by :func:`save_atomic`."""
    state = torch.load(Path(path), map_location="cpu", weights_only=False)
    if state.get("format") != FORMAT_VERSION:
        raise ConfigError(
            f"{path} is not a RaPyDLI checkpoint of format {FORMAT_VERSION} (found {state.get('format')!r})"
        )
    return state


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint's manifest says of the run that wrote it (every rank gets it from :meth:`CheckpointManager.read`).

    Attributes
    ----------
    step
        Optimizer steps done.
    epoch, position
        The epoch it was in and the samples of that epoch's global order consumed.
    data_size, grad_accum, batch_size
        Its data-parallel replicas, micro-steps per step and per-replica batch.
    layout
        The layout it was written by (:func:`describe` says it in words).
    history
        Rank 0's metric rows up to ``step`` (every attempt's): a run resumed after its
        engines died sends the ones the notebook never received.
    """

    step: int
    epoch: int
    position: int
    data_size: int
    grad_accum: int
    batch_size: int
    layout: dict[str, Any]
    history: list[dict[str, Any]] = dataclasses.field(default_factory=list)


#: The keys of a layout record written before the degrees had one name each, and their names now.
_EARLIER_LAYOUT_KEYS = {"replicas": "data_parallel", "stages": "pipeline_stages"}


def layout_record(layout: Layout, bounds: list[int] | None) -> dict[str, Any]:
    """What a checkpoint records of ``layout``: its degrees under their names, and a pipeline's ``bounds``."""
    return {
        "world_size": layout.world_size,
        "data_parallel": layout.data_parallel,
        "pipeline_stages": layout.pipeline_stages,
        "tensor_parallel": layout.tensor_parallel,
        "zero": layout.zero,
        "bounds": bounds,
    }


def read_record(record: dict[str, Any]) -> dict[str, Any]:
    """A layout record as :func:`layout_record` writes it, also from a checkpoint written before (its earlier keys)."""
    return {_EARLIER_LAYOUT_KEYS.get(key, key): value for key, value in record.items()}


def describe(record: dict[str, Any]) -> str:
    """``"4 ranks (data_parallel=2 x pipeline_stages=2 x tensor_parallel=1, zero=1)"``, as :meth:`Layout.describe`."""
    record = read_record(record)
    return Layout(record["world_size"], record["pipeline_stages"], record["tensor_parallel"], record["zero"]).describe()


class CheckpointManager:
    """The checkpoints of one run, on one rank: save, read and load its state under any layout (collective calls).

    Parameters
    ----------
    directory
        ``checkpoint_dir`` (``None``: the run writes none and resumes from none).
    world
        The mpi4py communicator of every rank of the run.
    whole
        The whole model this rank built (split in place by tensor parallelism): its
        parameter names are the unsplit model's, the names every checkpoint uses.
    layout
        The :func:`layout_record` of this run's layout (recorded in the manifest).
    coordinates
        This rank's ``(stage, tensor rank, replica)``.

    Attributes
    ----------
    writer
        The :class:`CheckpointWriter` of this rank (its ``spans`` are the writes' times).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str] | None,
        world: Any,
        whole: Any,
        layout: dict[str, Any],
        coordinates: tuple[int, int, int],
    ) -> None:
        from mpi4py import MPI

        self.directory = Path(directory) if directory is not None else None
        self.world, self.whole, self.layout = world, whole, layout
        self.rank = world.Get_rank()
        self.stage, self.tensor_rank, self.replica = coordinates
        self.writer = CheckpointWriter()
        self._background = world.Get_size() == 1 or MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self._comm = (
            world.Dup() if self.directory is not None else None
        )  # the writer threads' own: they agree on it while training goes on
        self._manifest: dict[str, Any] | None = None

    # -- writing -------------------------------------------------------------------------
    def save(self, step: int, held: Any, optimizer: Any, progress: dict[str, Any]) -> Path | None:
        """Copy this rank's part of ``step`` in memory and write it in the background; rank 0 then writes the manifest.

        ``held`` is the module this rank trains, ``optimizer`` its optimizer (plain or
        :class:`~rapydli.parallel.zero.ShardedOptimizer`), ``progress`` the run's
        position (``epoch``, ``position``, ``data_size``, ``grad_accum``,
        ``batch_size``, ...). Returns the manifest's path on rank 0, ``None`` elsewhere.
        If a part or the manifest cannot be written, the next :meth:`wait` raises on
        every rank and the previous checkpoint stays the one a resume reads.
        """
        if self.directory is None or self._comm is None:
            return None
        from rapydli.trainer import manifest

        self.writer.wait()
        # replica 0 writes its parameters and buffers and, without ZeRO, its optimizer state; with ZeRO every replica its shard;
        # a tensor rank above 0 only what is split (tensor rank 0 writes the tensors every tensor rank holds whole)
        writes_optimizer = self.replica == 0 or self.layout["zero"] > 0
        found = manifest.entries(
            self.whole,
            held,
            optimizer if writes_optimizer else None,
            model=self.replica == 0,
            split_only=self.tensor_rank > 0,
        )
        name = part_name(self.stage, self.tensor_rank, self.replica, step) if found else ""
        keys = [(e.name, e.field) for e in found]
        rng = self.world.gather(rng_state(), root=0)
        listing = self.world.gather({"file": name, "rank": self.rank, "keys": keys}, root=0)
        part = copy.deepcopy({"step": step, "entries": found}) if found else None
        record = None
        if self.rank == 0:
            parts = [p for p in listing if p["file"]]
            record = {"step": step, "world_size": self.layout["world_size"], "layout": self.layout, "parts": parts,
                      "progress": progress, "rng": rng}  # fmt: skip
        directory, comm, rank = self.directory, self._comm, self.rank

        def write() -> None:
            error = None
            if part is not None:
                try:
                    save_atomic(part, directory / name)
                except Exception as exc:  # noqa: BLE001 - every rank must learn of it before the manifest
                    error = f"rank {rank}: {type(exc).__name__}: {exc}"
            errors = [e for e in comm.allgather(error) if e]
            if not errors and record is not None:
                try:
                    save_atomic(record, checkpoint_path(directory))
                except Exception as exc:  # noqa: BLE001 - the other ranks must not remove the parts the old manifest names
                    errors.append(f"rank 0: {type(exc).__name__}: {exc}")
            errors = comm.bcast(errors, root=0)
            if errors:
                raise RuntimeError(
                    f"checkpoint of step {step} not written (the previous one in {directory} stays): "
                    + "; ".join(errors)
                )
            prefix = f"part-s{self.stage}-t{self.tensor_rank}-d{self.replica}-step"
            for old in directory.glob(
                f"{prefix}*.pt"
            ):  # the manifest names the new parts: this rank's older ones can go
                older = old.name[len(prefix) : -len(".pt")]
                if old.name != name and older.isdigit() and int(older) < step and old.is_file():
                    try:
                        old.unlink(missing_ok=True)
                    except OSError as exc:  # the checkpoint is complete: a part left behind costs space only
                        log.warning("could not remove %s: %s", old, exc)

        self.writer.run(write, background=self._background)
        return checkpoint_path(directory) if self.rank == 0 else None

    def wait(self, raise_error: bool = True) -> None:
        """Block until this rank's write in flight (and its agreement with the others) is done; see :meth:`CheckpointWriter.wait`."""
        self.writer.wait(raise_error)

    def close(self) -> None:
        """Finish the write in flight; release the writers' communicator."""
        self.writer.wait()
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def gather_state(self, held: Any, optimizer: Any = None) -> dict[str, torch.Tensor] | None:
        """The whole model's parameters and buffers (unsplit names, on the CPU) on rank 0, ``None`` elsewhere; collective.

        Assembled from every stage's and tensor rank's pieces by the code that reads
        checkpoints (:func:`rapydli.trainer.manifest.assemble`). ``optimizer``: the
        run's, needed at ZeRO-3 (every replica holds pieces of the parameters).
        """
        from rapydli.trainer import manifest

        gathered = self.world.gather(self._model_entries(held, optimizer), root=0)
        if self.rank != 0:
            return None
        found: dict[tuple[str, str], list[Any]] = {}
        for entry in (e for part in gathered for e in part):
            found.setdefault(entry.key, []).append(entry)
        return {name: manifest.assemble(group).clone() for (name, _), group in found.items()}

    def write_model(self, directory: str | os.PathLike[str], step: int, held: Any, optimizer: Any = None) -> None:
        """Write the model's parameters and buffers to ``directory`` as they lie on the ranks; collective, synchronous.

        Each rank holding pieces of its own writes them (a pipeline stage, a tensor slice,
        ZeRO-3's pieces of every replica); no rank gathers the model. Rank 0 then writes
        the manifest, only when every part was written, so the directory holds a whole
        model or none. :func:`read_state_dict` and :func:`iter_state` assemble it. Raises
        on every rank when a part or the manifest could not be written.
        """
        mine = self._model_entries(held, optimizer)
        target = Path(directory)
        name = part_name(self.stage, self.tensor_rank, self.replica, step) if mine else ""
        error = None
        try:
            if mine:
                target.mkdir(parents=True, exist_ok=True)
                save_atomic({"step": step, "entries": mine}, target / name)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before the manifest
            error = f"rank {self.rank}: {type(exc).__name__}: {exc}"
        listing = self.world.gather(
            {"file": name, "rank": self.rank, "keys": [(e.name, e.field) for e in mine], "error": error}, root=0
        )
        errors: list[str] = []
        if self.rank == 0:
            errors = [p["error"] for p in listing if p["error"]]
            if not errors:
                parts = [{k: v for k, v in p.items() if k != "error"} for p in listing if p["file"]]
                try:
                    target.mkdir(parents=True, exist_ok=True)
                    save_atomic(
                        {
                            "step": step,
                            "world_size": self.layout["world_size"],
                            "layout": self.layout,
                            "parts": parts,
                            "progress": {},
                            "rng": None,
                            "model_only": True,
                        },
                        checkpoint_path(target),
                    )
                except Exception as exc:  # noqa: BLE001 - said on every rank
                    errors.append(f"rank 0: {type(exc).__name__}: {exc}")
        errors = self.world.bcast(errors, root=0)
        if errors:
            raise RuntimeError(f"the trained model was not written to {target}: " + "; ".join(errors))

    def _model_entries(self, held: Any, optimizer: Any) -> list[Any]:
        """This rank's pieces of the model's parameters and buffers (without optimizer state), or none where another rank holds them."""
        from rapydli.trainer import manifest

        if hasattr(
            optimizer, "parameter_pieces"
        ):  # ZeRO-3: every replica its pieces, replica 0 the buffers and frozen parameters too
            return manifest.entries(
                self.whole, held, optimizer, model=self.replica == 0, split_only=self.tensor_rank > 0, state=False
            )
        return (
            manifest.entries(self.whole, held, None, model=True, split_only=self.tensor_rank > 0)
            if self.replica == 0
            else []
        )

    # -- reading -------------------------------------------------------------------------
    def read(self) -> Resumed | None:
        """The manifest in ``directory`` (rank 0 reads, every rank gets it), or ``None`` when there is none; collective."""
        if self.directory is None:
            return None
        found = None
        if self.rank == 0:
            remove_partial_writes(self.directory)
            path = checkpoint_path(self.directory)
            found = load(path) if path.exists() else None
        self._manifest = self.world.bcast(found, root=0)
        if self._manifest is None:
            return None
        self._manifest["layout"] = read_record(self._manifest["layout"])
        progress = self._manifest["progress"]
        return Resumed(
            self._manifest["step"],
            progress["epoch"],
            progress["position"],
            progress["data_size"],
            progress["grad_accum"],
            progress["batch_size"],
            self._manifest["layout"],
            [row for row in progress.get("history", []) if row.get("step", 0) <= self._manifest["step"]],
        )

    def load(self, held: Any, optimizer: Any) -> int:
        """Load the checkpoint :meth:`read` found into ``held`` and ``optimizer`` (cut for this rank's layout); its step.

        Every rank reads only the parts holding pieces of what it trains, each once.
        Restores this rank's RNG state (a rank the writing run did not have takes a
        peer's). Collective.

        Raises
        ------
        ConfigError
            On every rank: a part is missing or of another step, or the checkpoint lacks
            a parameter this run trains (another model).
        """
        assert self._manifest is not None and self.directory is not None, "read() found a checkpoint first"
        meta, error = self._manifest, None
        try:
            _load_into(self.directory, meta, self.whole, held, optimizer)
        except ConfigError as exc:
            error = f"rank {self.rank}: {exc}"
        errors = [e for e in self.world.allgather(error) if e]
        if errors:
            raise ConfigError(
                f"checkpoint {checkpoint_path(self.directory)} (written by {describe(meta['layout'])}) cannot be resumed: {errors[0]}"
            )
        rng = meta["rng"]
        set_rng_state(rng[self.rank % len(rng)])
        self._manifest = None
        return int(meta["step"])


def part_name(stage: int, tensor_rank: int, replica: int, step: int) -> str:
    """The file name of one rank's part of the checkpoint of ``step``."""
    return f"part-s{stage}-t{tensor_rank}-d{replica}-step{step}.pt"


def _read_entries(directory: Path, meta: dict[str, Any], names: set[str] | None) -> dict[tuple[str, str], list[Any]]:
    """The entries of the parts holding any of ``names`` (``None``: all), by ``(name, field)``."""
    found: dict[tuple[str, str], list[Any]] = {}
    for part in meta["parts"]:
        if names is not None and not any(name in names for name, _ in part["keys"]):
            continue
        path = directory / part["file"]
        if not path.is_file():
            raise ConfigError(f"its manifest names {part['file']} (rank {part['rank']}'s part), which is missing")
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
        if state.get("step") != meta["step"]:
            raise ConfigError(
                f"{part['file']} holds step {state.get('step')}, not the step {meta['step']} its manifest names"
            )
        for entry in state["entries"]:
            if names is None or entry.name in names:
                found.setdefault(entry.key, []).append(entry)
    return found


def _load_into(directory: Path, meta: dict[str, Any], whole: Any, held: Any, optimizer: Any) -> None:
    from rapydli.trainer import manifest

    where = manifest.placements(whole, held)
    slots = list(manifest.optimizer_slots(optimizer, where))
    found = _read_entries(directory, meta, {name for name, _ in where.values()})
    full: dict[tuple[str, str], Any] = {}

    def value(name: str, field: str) -> Any:
        if (name, field) not in full:
            full[name, field] = manifest.assemble(found[name, field])
        return full[name, field]

    def piece(name: str, field: str, placement: manifest.Placement) -> torch.Tensor:
        """The tensor at ``placement``: as stored when a part holds exactly that piece (the same layout), else cut from the whole."""
        same = next((e.value for e in found[name, field] if e.placement == placement), None)
        return same if same is not None else placement.cut(value(name, field))

    sharded = (
        optimizer.sharded_ids() if hasattr(optimizer, "sharded_ids") else frozenset()
    )  # ZeRO-3: loaded into its pieces
    with torch.no_grad():
        for kind, tensors in (("param", held.parameters()), ("buffer", held.buffers())):
            for tensor in tensors:
                name, placement = where[id(tensor)]
                if (name, kind) not in found:
                    raise ConfigError(
                        f"it holds no {kind} {name!r} (the model this run trains has one): was it written by another model?"
                    )
                if id(tensor) not in sharded:
                    tensor.copy_(piece(name, kind, placement).reshape(tensor.shape))
        if sharded:
            pieces = {id(p) for _, p in optimizer.parameter_pieces()}
            for name, placement, slot in slots:
                if id(slot) in pieces:
                    slot.copy_(piece(name, "param", placement).reshape(slot.shape))
        if hasattr(
            optimizer, "refresh"
        ):  # ZeRO: drop what is gathered, and offloaded, copy the loaded slices to the host
            optimizer.refresh()
    inner = getattr(optimizer, "optimizer", optimizer)
    inner.state.clear()
    fields: dict[str, list[str]] = {}
    for name, field in found:
        if field.startswith("optim."):
            fields.setdefault(name, []).append(field)
    for name, placement, slot in slots:
        key = manifest.state_key(optimizer, slot)  # an offloaded piece's state is on its host copy
        state = {}
        for field in fields.get(name, []):
            if found[name, field][0].placement is not None:
                state[field[len("optim.") :]] = (
                    piece(name, field, placement).reshape(slot.shape).to(key.device, copy=True)
                )
            else:
                saved = value(name, field)
                state[field[len("optim.") :]] = (
                    saved.clone() if isinstance(saved, torch.Tensor) else copy.deepcopy(saved)
                )
        if state:
            inner.state[key] = state


def read_state_dict(directory: str | os.PathLike[str]) -> tuple[dict[str, torch.Tensor], int]:
    """The whole model's state (parameters and buffers, by the unsplit model's names) in ``directory``'s checkpoint, and its step.

    Assembles the pieces every part holds (pipeline stages, tensor slices) as a resume
    does, in this process (no ranks needed).

    Raises
    ------
    ConfigError
        There is no complete checkpoint in ``directory``, or a part is missing.
    """
    path = checkpoint_path(directory)
    if not path.is_file():
        raise ConfigError(f"there is no checkpoint in {directory}: no {CHECKPOINT_NAME}")
    from rapydli.trainer import manifest

    meta = load(path)
    found = _read_entries(Path(directory), meta, None)
    state = {
        name: manifest.assemble(entries).clone()
        for (name, field), entries in found.items()
        if field in ("param", "buffer")
    }
    return state, int(meta["step"])


def iter_state(directory: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The whole model's parameters and buffers in ``directory``'s checkpoint, one ``(name, tensor)`` at a time.

    Each tensor is assembled from the parts holding its pieces (memory-mapped) and
    handed out before the next is read: a model larger than this process's memory can be
    streamed (saved tensor by tensor, or loaded into a model built on the meta device).

    Raises
    ------
    ConfigError
        There is no complete checkpoint in ``directory``, or a part is missing.
    """
    path = checkpoint_path(directory)
    if not path.is_file():
        raise ConfigError(f"there is no checkpoint in {directory}: no {CHECKPOINT_NAME}")
    from rapydli.trainer import manifest

    meta = load(path)
    names = list(
        dict.fromkeys(name for part in meta["parts"] for name, field in part["keys"] if field in ("param", "buffer"))
    )
    for name in names:
        found = _read_entries(Path(directory), meta, {name})
        for (_, field), entries in found.items():
            if field in ("param", "buffer"):
                yield name, manifest.assemble(entries).clone()


def read_layout(directory: str | os.PathLike[str] | None, world: Any) -> dict[str, Any] | None:
    """The layout recorded in ``directory``'s manifest (rank 0 reads, every rank gets it), or ``None``."""
    layout = None
    if directory is not None and world.Get_rank() == 0:
        path = checkpoint_path(directory)
        if path.exists():
            layout = load(path).get("layout")
    return world.bcast(None if layout is None else read_record(layout), root=0)


def load_full_state(model: Any, state: dict[str, torch.Tensor]) -> Any:
    """Load ``state`` (by the unsplit model's names, as :func:`read_state_dict` gives it) into ``model``; returns ``model``.

    A tied tensor (one tensor under two names) is found under its first name.

    Raises
    ------
    ConfigError
        ``state`` lacks a tensor ``model`` has (another model).
    """
    first: dict[int, str] = {}
    for name, tensor in (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)):
        first.setdefault(id(tensor), name)
    alias = {
        name: first[id(tensor)]
        for name, tensor in (
            *model.named_parameters(remove_duplicate=False),
            *model.named_buffers(remove_duplicate=False),
        )
    }
    wanted = model.state_dict()
    missing = [key for key in wanted if alias.get(key, key) not in state]
    if missing:
        raise ConfigError(
            f"the trained state has no {', '.join(missing[:5])}: it belongs to another model than {type(model).__name__}"
        )
    model.load_state_dict({key: state[alias.get(key, key)] for key in wanted})
    return model
