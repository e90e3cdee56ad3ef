"""Checkpoints of runs whose ranks hold the same state (no pipeline stages, tensor shards or ZeRO): one file.

Rank 0 writes ``checkpoint.pt`` (:mod:`rapydli.trainer.checkpoint`) with the model, the
optimizer, the schedule and sampler positions, and every rank's RNG state. A run resumes
from it on any world size: the sampler position and the batch scaling come from what it
was written with (:func:`rapydli.trainer.progress.resized_config`). A sharded checkpoint
(:mod:`rapydli.trainer.sharded`) is refused here, naming the layout it was written by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapydli.errors import ConfigError
from rapydli.trainer import checkpoint as ckpt


def save(trainer: Any) -> Path | None:
    """Hand rank 0's state to the trainer's background writer (every rank contributes its RNG state); the path on rank 0."""
    rng_states = trainer.mpi.gather(ckpt.rng_state(), root=0)
    if trainer.rank != 0:
        return None
    epoch, position = trainer.plan.position(trainer.step, trainer.config.global_batch(trainer.world_size))
    state = {
        "model": trainer.model.state_dict(),
        "optimizer": trainer.optimizer.state_dict(),
        "scheduler": {"name": trainer.config.lr_schedule, "step": trainer.step, "total_steps": trainer.total_steps},
        "sampler": {"epoch": epoch, "position": position, "seed": trainer.config.seed},
        "step": trainer.step,
        "world_size": trainer.world_size,
        "grad_accum": trainer.config.grad_accum,
        "rng": rng_states,
        "config": trainer.config.to_dict(),
    }
    path = ckpt.checkpoint_path(trainer.config.checkpoint_dir)
    trainer._writer.submit(state, path)
    return path


def read(trainer: Any) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """Rank 0's checkpoint state (None elsewhere) and, on every rank, what it was written with."""
    path = ckpt.checkpoint_path(trainer.config.checkpoint_dir)
    if trainer.rank == 0:
        ckpt.remove_partial_writes(path.parent)
    state = ckpt.load(path) if trainer.rank == 0 and path.exists() else None
    meta = None
    if state is not None and state.get("layout") is not None:
        from rapydli.trainer.sharded import describe

        meta = {"refused": f"checkpoint {path} was written by {describe(state['layout'])}; this run has {trainer.world_size} ranks "
                           "without pipeline stages, tensor shards or ZeRO: resume it with the layout it was written by"}  # fmt: skip
    elif state is not None:
        meta = {
            "step": state["step"], "world_size": state["world_size"], "grad_accum": state["grad_accum"],
            "epoch": state["sampler"]["epoch"], "position": state["sampler"]["position"],
        }  # fmt: skip
    meta = trainer.mpi.bcast(meta, root=0)
    if meta is not None and "refused" in meta:
        raise ConfigError(meta["refused"])
    return state, meta


def resume(trainer: Any, meta: dict[str, Any]) -> None:
    """Continue from the checkpoint :func:`read` gave ``trainer._checkpoint`` (model, optimizer, RNG, step); collective."""
    state, trainer._checkpoint = trainer._checkpoint, None
    if trainer.rank == 0:
        assert state is not None
        trainer.model.load_state_dict(state["model"])
        trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.sync is not None:
        trainer.sync.broadcast_parameters()
    _broadcast_optimizer_state(trainer)
    rng_states = trainer.mpi.bcast(state["rng"] if state else None, root=0)
    ckpt.set_rng_state(rng_states[trainer.rank % len(rng_states)])  # a rank the old run did not have takes a peer's
    trainer.step = trainer._evaluated_at = trainer._saved_at = meta["step"]


def _broadcast_optimizer_state(trainer: Any) -> None:
    if trainer.world_size > 1:
        state = trainer.mpi.bcast(trainer.optimizer.state_dict() if trainer.rank == 0 else None, root=0)
        if trainer.rank != 0:
            trainer.optimizer.load_state_dict(state)
