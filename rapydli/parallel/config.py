"""Checks of a ``TrainConfig``'s layout fields that involve more than one field (run when it is built)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from rapydli.errors import ConfigError
from rapydli.parallel.layout import Layout

#: How a tensor plan splits a module (:func:`rapydli.parallel.tensor.parallelize`).
TENSOR_STYLES = ("column", "row", "heads", "vocab")

if TYPE_CHECKING:  # pragma: no cover
    from rapydli.parallel.settings import LayoutSettings


def check_pipeline(config: LayoutSettings) -> None:
    """Raise :class:`ConfigError` if the pipeline fields of ``config`` cannot work together.

    ``workers``, when given (the ranks ``rd.train`` starts without a cluster), must be a
    multiple of ``pipeline_stages x tensor_parallel`` (the ranks that really run are checked
    when they are known: :class:`~rapydli.parallel.layout.Layout`); ``microbatches`` at most ``batch_size``;
    ``autotune`` off; an explicit ``pipeline_split`` names ``pipeline_stages - 1`` points
    (which points a model has is checked when the model is split).
    """
    stages = config.pipeline_stages
    check_grid(config)
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


_EVERY = re.compile(r"every_k:([0-9]+)")


def checkpoint_interval(value: str | None) -> int | None:
    """Every how many blocks one is recomputed (1 for ``"blocks"``), or ``None`` for no recomputation.

    Raises
    ------
    ConfigError
        ``value`` is not ``None``, ``"blocks"`` or ``"every_k:N"`` with ``N >= 1``.
    """
    if value is None:
        return None
    if value == "blocks":
        return 1
    found = _EVERY.fullmatch(value) if isinstance(value, str) else None
    if found is None or int(found.group(1)) < 1:
        raise ConfigError(
            f"TrainConfig.activation_checkpointing={value!r} is invalid: must be None, 'blocks' or 'every_k:N' with N a positive integer"
        )
    return int(found.group(1))


def check_grid(config: LayoutSettings) -> None:
    """Raise :class:`ConfigError` unless ``workers`` (when given) is a multiple of ``pipeline_stages x tensor_parallel``."""
    if config.workers is not None:
        where = f"TrainConfig.workers={config.workers}"
        Layout.check(config.workers, config.pipeline_stages, config.tensor_parallel, where)


def split_names(value: str) -> str | list[str]:
    """``"auto"``, or the block names of a comma-separated ``pipeline_split``."""
    if value.strip() == "auto":
        return "auto"
    return [name.strip() for name in value.split(",") if name.strip()]


def tensor_plan_text(value: Any) -> str | None:
    """``tensor_plan`` as it is stored: ``None`` (the built-in plan) or a JSON object of module glob -> style.

    Accepts ``None``, ``"auto"``, a mapping, or the JSON text of one (what the run store and
    the command line carry); a style other than ``column``/``row``/``heads`` or anything
    else is a :class:`ConfigError`.

    Examples
    --------
    >>> tensor_plan_text({"1": "column", "3": "row"})
    '{"1": "column", "3": "row"}'
    >>> tensor_plan_text("auto") is None
    True
    """
    if value is None or (isinstance(value, str) and value.strip() == "auto"):
        return None
    plan = value
    if isinstance(value, str):
        try:
            plan = json.loads(value)
        except json.JSONDecodeError:
            plan = None
    usage = (
        "a dict {module glob: 'column' | 'row' | 'heads'} (or its JSON text), or None / 'auto' for the built-in plan"
    )
    if (
        not isinstance(plan, Mapping)
        or not plan
        or not all(isinstance(k, str) and isinstance(v, str) for k, v in plan.items())
    ):
        raise ConfigError(f"TrainConfig.tensor_plan={value!r} is invalid: it must be {usage}")
    for pattern, style in plan.items():
        if style not in TENSOR_STYLES:
            raise ConfigError(
                f"TrainConfig.tensor_plan {pattern!r}: {style!r} is not a style; allowed: {', '.join(TENSOR_STYLES)}"
            )
    return json.dumps(dict(plan))


def tensor_plan(text: str | None) -> dict[str, str] | None:
    """The plan a stored ``tensor_plan`` names: a dict, or ``None`` for the model's built-in plan."""
    return None if text is None else dict(json.loads(text))
