"""Checks of a pipelined ``TrainConfig`` that involve more than one field (run when it is built)."""

from __future__ import annotations

from typing import Any

from rapydli.errors import ConfigError
from rapydli.parallel.grid import data_parallel_degree


def check_pipeline(config: Any) -> None:
    """Raise :class:`ConfigError` if the pipeline fields of ``config`` cannot work together.

    ``workers`` (the ranks ``rd.train`` starts) must be a multiple of
    ``pipeline_stages``; ``microbatches`` at most ``batch_size``; ``autotune`` off; an explicit
    ``pipeline_split`` names ``pipeline_stages - 1`` points (which points a model has is
    checked when the model is split).
    """
    stages = config.pipeline_stages
    try:
        data_parallel_degree(config.workers, stages)
    except ConfigError as exc:
        raise ConfigError(f"TrainConfig.workers={config.workers}: {exc}") from None
    if config.microbatches > config.batch_size:
        raise ConfigError(
            f"TrainConfig.microbatches={config.microbatches} is larger than batch_size={config.batch_size}: "
            "a micro-batch needs at least one sample; lower microbatches"
        )
    if config.autotune:
        raise ConfigError(
            f"TrainConfig.autotune=True cannot be combined with pipeline_stages={stages} yet "
            "(a stage's inputs are the previous stage's activations, not samples): set autotune=False"
        )
    points = split_names(config.pipeline_split)
    if points != "auto" and len(points) != stages - 1:
        raise ConfigError(
            f"TrainConfig.pipeline_split={config.pipeline_split!r} names {len(points)} split point(s); "
            f"pipeline_stages={stages} needs {stages - 1} (or 'auto')"
        )


def split_names(value: str) -> str | list[str]:
    """``"auto"``, or the block names of a comma-separated ``pipeline_split``."""
    if value.strip() == "auto":
        return "auto"
    return [name.strip() for name in value.split(",") if name.strip()]
