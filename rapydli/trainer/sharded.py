"""Checkpoints of runs whose state is spread over ranks: pipeline stages, tensor shards, ZeRO shards.

Each rank that holds state no other rank holds writes one *part*,
``part-s<stage>-t<tensor rank>-d<replica>-step<N>.pt``, atomically: replica 0 of every
(stage, tensor rank) writes its model part and optimizer, and with ZeRO every rank
writes its optimizer shard. Only when every part is on disk (the ranks agree on it) does
rank 0 write ``checkpoint.pt``, the *manifest*: the layout, the parts, the step, the
sampler position and every rank's RNG state, atomically too. Parts of older steps are
removed after that. A reader therefore finds the previous complete checkpoint or the new
one: a run that dies between its parts and its manifest resumes from the previous one.

A sharded checkpoint resumes only on the same layout (ranks, data-parallel degree,
pipeline stages and split, tensor-parallel degree, ZeRO stage); another layout is
refused with a :class:`~rapydli.errors.ConfigError` naming both.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapydli.errors import ConfigError
from rapydli.trainer import checkpoint as ckpt


def layout(trainer: Any) -> dict[str, Any]:
    """How ``trainer``'s run is spread over its ranks (what a resume must match)."""
    grid, pipeline = trainer.grid, trainer.pipeline
    return {
        "world_size": trainer.world_size,
        "replicas": trainer.data_size,
        "stages": grid.stages if grid is not None else 1,
        "tensor_parallel": grid.tensor_parallel if grid is not None else 1,
        "zero": trainer.config.zero,
        "bounds": pipeline.bounds if pipeline is not None else None,
    }


def describe(shape: dict[str, Any]) -> str:
    """``"4 ranks (data 2 x pipeline 2 x tensor 1, zero=1)"``."""
    split = f", split {shape['bounds']}" if shape.get("bounds") else ""
    return (
        f"{shape['world_size']} ranks (data {shape['replicas']} x pipeline {shape['stages']} x tensor {shape['tensor_parallel']}, "
        f"zero={shape['zero']}{split})"
    )


def _coordinates(trainer: Any) -> tuple[int, int, int]:
    grid = trainer.grid
    return (grid.stage, grid.tensor_rank, grid.replica) if grid is not None else (0, 0, trainer.rank)


def _world_rank(shape: dict[str, Any], stage: int, tensor_rank: int, replica: int) -> int:
    return (replica * shape["stages"] + stage) * shape["tensor_parallel"] + tensor_rank


def part_name(stage: int, tensor_rank: int, replica: int, step: int) -> str:
    """The file name of one rank's part of the checkpoint of ``step``."""
    return f"part-s{stage}-t{tensor_rank}-d{replica}-step{step}.pt"


def save(trainer: Any) -> Path | None:
    """Write this rank's part, then (rank 0) the manifest; collective over every rank of the run.

    Returns the manifest's path on rank 0, ``None`` elsewhere. If a part cannot be
    written, every rank raises and no manifest names the step: the previous checkpoint
    stays the one a resume reads.
    """
    world, config = trainer.mpi, trainer.config
    directory = Path(config.checkpoint_dir)
    stage, tensor_rank, replica = _coordinates(trainer)
    name = part_name(stage, tensor_rank, replica, trainer.step)
    error = None
    if replica == 0 or config.zero:
        part: dict[str, Any] = {"step": trainer.step, "optimizer": trainer.optimizer.state_dict()}
        if replica == 0:
            part["model"] = trainer.model.state_dict()
        try:
            ckpt.save_atomic(part, directory / name)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it before the manifest
            error = f"rank {trainer.rank}: {type(exc).__name__}: {exc}"
    else:
        name = ""
    rng = world.gather(ckpt.rng_state(), root=0)
    errors = [e for e in world.allgather(error) if e]
    if errors:
        raise RuntimeError(f"checkpoint of step {trainer.step} not written (the previous one in {directory} stays): " + "; ".join(errors))
    names = world.gather(name, root=0)
    path, error = None, None
    if trainer.rank == 0:
        epoch, position = trainer.plan.position(trainer.step, config.global_batch(trainer.data_size))
        manifest = {
            "layout": layout(trainer),
            "parts": names,
            "step": trainer.step,
            "world_size": trainer.world_size,
            "grad_accum": config.grad_accum,
            "scheduler": {"name": config.lr_schedule, "step": trainer.step, "total_steps": trainer.total_steps},
            "sampler": {"epoch": epoch, "position": position, "seed": config.seed},
            "rng": rng,
            "config": config.to_dict(),
        }
        try:
            path = ckpt.save_atomic(manifest, ckpt.checkpoint_path(directory))
        except Exception as exc:  # noqa: BLE001 - the other ranks must not remove the parts the old manifest names
            error = f"rank 0: {type(exc).__name__}: {exc}"
    error = world.bcast(error, root=0)
    if error is not None:
        raise RuntimeError(f"checkpoint of step {trainer.step} not written (the previous one in {directory} stays): {error}")
    if name:  # the manifest names the new parts: this rank's older ones can go
        for old in directory.glob(f"part-s{stage}-t{tensor_rank}-d{replica}-step*.pt"):
            if old.name != name:
                old.unlink(missing_ok=True)
    return path


def read_layout(directory: str | Path, world: Any) -> dict[str, Any] | None:
    """The layout recorded in ``directory``'s manifest (rank 0 reads, every rank gets it), or ``None``."""
    shape = None
    if world.Get_rank() == 0:
        path = ckpt.checkpoint_path(directory)
        if path.exists():
            shape = ckpt.load(path).get("layout")
    return world.bcast(shape, root=0)


def resume(trainer: Any) -> None:
    """Load this rank's parts of the checkpoint in ``checkpoint_dir`` (if any); restore RNG and step (collective).

    Raises
    ------
    ConfigError
        On every rank: the checkpoint was written with another layout, was not sharded,
        or names a part that is missing or of another step.
    """
    world, directory = trainer.mpi, Path(trainer.config.checkpoint_dir)
    path = ckpt.checkpoint_path(directory)
    meta = None
    if trainer.rank == 0:
        ckpt.remove_partial_writes(directory)
        if path.exists():
            state = ckpt.load(path)
            meta = {k: state.get(k) for k in ("layout", "parts", "step", "world_size", "rng")}
    meta = world.bcast(meta, root=0)
    if meta is None:
        return
    mine, error = layout(trainer), None
    if meta["layout"] is None:
        error = (
            f"checkpoint {path} was written by {meta['world_size']} ranks without sharded state; this run has "
            f"{describe(mine)}: resume it with pipeline_stages=1, tensor_parallel=1 and zero=0"
        )
    elif meta["layout"] != mine:
        error = (
            f"checkpoint {path} was written by {describe(meta['layout'])}; this run has {describe(mine)}: "
            "a sharded checkpoint resumes only on the same layout (the same workers, pipeline_stages, split, tensor_parallel and zero)"
        )
    else:
        try:
            _load_parts(trainer, meta, directory)
        except ConfigError as exc:
            error = str(exc)
    errors = [e for e in world.allgather(error) if e]
    if errors:
        raise ConfigError(errors[0])
    ckpt.set_rng_state(meta["rng"][trainer.rank])
    trainer.step = trainer._evaluated_at = trainer._saved_at = meta["step"]


def _load_parts(trainer: Any, meta: dict[str, Any], directory: Path) -> None:
    stage, tensor_rank, replica = _coordinates(trainer)
    model_part = _part(meta, directory, _world_rank(meta["layout"], stage, tensor_rank, 0))
    trainer.model.load_state_dict(model_part["model"])
    if trainer.config.zero:
        trainer.optimizer.refresh()
        own = model_part if replica == 0 else _part(meta, directory, _world_rank(meta["layout"], stage, tensor_rank, replica))
        trainer.optimizer.load_state_dict(own["optimizer"])
    else:
        trainer.optimizer.load_state_dict(model_part["optimizer"])


def _part(meta: dict[str, Any], directory: Path, rank: int) -> dict[str, Any]:
    path = directory / meta["parts"][rank]
    if not path.is_file():
        raise ConfigError(f"checkpoint {directory / ckpt.CHECKPOINT_NAME} names {path.name} (rank {rank}'s part), which is missing")
    part = ckpt.load(path)
    if part.get("step") != meta["step"]:
        raise ConfigError(f"{path} holds step {part.get('step')}, not the step {meta['step']} its manifest names")
    return part
