"""What ``parallel/`` reads of a run's ``TrainConfig``, as types: its degrees are not among them.

``parallel/`` sits below the trainer and never imports ``TrainConfig``; these protocols name
the fields it reads, so a signature says what it depends on and mypy holds the rule that the
degrees come from the :class:`~rapydli.parallel.layout.Layout`:

* :class:`StepSettings`: how a step runs in a layout (micro-batches, schedule, split, tensor
  plan, gradient communication, recomputation, per-replica batch). What the pipeline, the
  model parts and the gradients take, with the ``Layout`` beside it.
* :class:`LayoutSettings`: those and the degrees as the user wrote them. Only the config's
  boundary takes it: :meth:`Layout.of <rapydli.parallel.layout.Layout.of>`, the config's own
  checks (:mod:`rapydli.parallel.config`) and the front doors that are handed a config
  (:func:`~rapydli.parallel.preflight.check_layout`, :func:`~rapydli.parallel.memory.step_memory`).
"""

from __future__ import annotations

from typing import Protocol


class StepSettings(Protocol):
    """How a step runs in a layout (``TrainConfig``'s fields of these names)."""

    batch_size: int
    microbatches: int
    pipeline_schedule: str
    pipeline_split: str
    tensor_plan: str | None
    allreduce: str
    bucket_mb: float
    overlap: bool
    activation_checkpointing: str | None


class LayoutSettings(StepSettings, Protocol):
    """A step's settings and the degrees as the config gives them (read where a :class:`Layout` is made), and
    ``autotune``, which a pipeline refuses."""

    autotune: bool
    workers: int | None
    pipeline_stages: int
    tensor_parallel: int
    zero: int
