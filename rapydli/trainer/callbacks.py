"""Trainer callbacks: what they receive and how they are called.

A callback is any object with one or more of these methods (each optional); the
:class:`~rapydli.trainer.loop.Trainer` calls them on every rank, in order:

``on_step_end(metrics)`` after each optimizer step, with :data:`STEP_KEYS`:
    ``kind="train"``, ``step`` (optimizer steps done, from 1), ``epoch`` (from 0),
    ``loss`` (this rank's mean loss over the step's micro-batches), ``lr``,
    ``samples_per_s`` (global: this rank's samples x world size / step time),
    ``step_time_s``, ``data_time_s`` (waiting for batches), ``comm_time_s`` (gradient
    allreduce time, from the synchronizer), ``comm_wait_s`` (time the step blocked
    waiting for communication, i.e. the part not hidden behind backward),
    ``comm_hidden_fraction`` (share of ``comm_time_s`` that ran behind backward), ``grad_norm``
    (before clipping; ``None`` without ``grad_clip``), ``rank``, ``world_size``,
    ``time_s`` (since the trainer was built).
``on_eval_end(metrics)`` after each evaluation, with :data:`EVAL_KEYS`:
    ``kind="eval"``, ``step``, ``epoch``, ``val_loss``, ``val_accuracy`` (averaged over
    all ranks' shards; accuracy only where it means something, and one ``val_<name>`` per
    metric the run was given instead: :mod:`rapydli.objective`), ``rank``,
    ``world_size``, ``time_s``.
``on_epoch_end(metrics)`` after each epoch, with :data:`EPOCH_KEYS`:
    ``epoch``, ``step``, ``train_loss`` (mean over the epoch's steps), ``val_loss``,
    ``val_accuracy`` (when there is validation data), ``epoch_time_s``,
    ``samples_per_s`` (global), ``rank``.

Values are plain Python numbers (picklable, JSON-friendly), so a callback can forward a
row to the notebook unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

STEP_KEYS = (
    "kind", "step", "epoch", "loss", "lr", "samples_per_s", "step_time_s", "data_time_s",
    "comm_time_s", "comm_wait_s", "comm_hidden_fraction", "grad_norm", "rank", "world_size", "time_s",
)  # fmt: skip
EVAL_KEYS = ("kind", "step", "epoch", "val_loss", "val_accuracy", "rank", "world_size", "time_s")
EPOCH_KEYS = ("epoch", "step", "train_loss", "val_loss", "val_accuracy", "epoch_time_s", "samples_per_s", "rank")


class Callback(Protocol):
    """Anything with some of ``on_step_end``, ``on_eval_end``, ``on_epoch_end``."""


def dispatch(callbacks: Sequence[Any], hook: str, metrics: dict[str, Any]) -> None:
    """Call ``hook(dict(metrics))`` on every callback that has it (each gets its own copy)."""
    for callback in callbacks:
        method = getattr(callback, hook, None)
        if method is not None:
            method(dict(metrics))
