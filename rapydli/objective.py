"""The objective: what a model returns, what it is trained on, and what is measured on it.

This is the model contract of ``rd.train``, used by the plain loop, every pipeline stage
and the planner's profiler (it lives below ``trainer``, ``parallel`` and ``experiments``,
which all call it).

The Trainer does not ask a model to return anything in particular. :class:`Objective`
calls the model on a batch and turns what came back into a loss (and, where they exist,
logits) under these rules, in this order:

1. ``loss_fn`` given: ``loss = loss_fn(outputs, targets)`` with the model's outputs
   unchanged (``nn.MSELoss()``, a contrastive loss, anything).
2. The model computes its own loss: when ``forward`` has a parameter named ``targets``,
   ``target`` or ``labels`` (as nanoGPT's ``forward(idx, targets=None)`` and Hugging Face
   models' ``labels=None`` do), the targets are passed *by that keyword*, and a loss found
   in the outputs is the loss. The name is the test, not the position: Hugging Face's
   second positional parameter is ``attention_mask``.
3. Otherwise the logits found in the outputs are scored by cross-entropy over the last
   dimension (classification ``(B, C)``, language models ``(B, T, V)``).

Outputs understood without a wrapper (:func:`interpret`):

* a tensor: the logits;
* a mapping, e.g. a ``transformers`` ``ModelOutput``: its ``"loss"`` and/or ``"logits"``;
* an object with ``loss``/``logits`` attributes;
* a tuple or list: a scalar tensor in it is the loss, the first tensor with dimensions
  the logits, so nanoGPT's ``(logits, loss)`` and Hugging Face's ``(loss, logits, ...)``
  both read right.

Anything else raises :class:`OutputError` naming the type and the three ways out.

Metrics (:func:`resolve_metrics`) are evaluated on the validation set: names from
:data:`METRICS` or callables ``fn(outputs, targets) -> float`` (a batch mean), each
reported as ``val_<name>`` and averaged over every rank's samples. ``metrics=None`` means
accuracy where it means something (integer targets and logits with one score per target)
and nothing otherwise (regression).

Examples
--------
>>> import torch
>>> interpret((torch.zeros(2, 3), torch.tensor(1.5))).loss
tensor(1.5000)
>>> interpret({"logits": torch.zeros(2, 3)}).logits.shape
torch.Size([2, 3])
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rapydli.errors import ConfigError

#: Parameter names of ``forward`` that make the model compute its own loss (passed by keyword).
TARGET_PARAMETERS = ("targets", "target", "labels")

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
MetricFn = Callable[[Any, torch.Tensor], Any]


class OutputError(ConfigError, TypeError):
    """The model's output holds nothing the trainer can train on."""


@dataclass
class Interpreted:
    """What :func:`interpret` found in a model's output (either may be ``None``)."""

    loss: torch.Tensor | None
    logits: torch.Tensor | None


def interpret(outputs: Any) -> Interpreted:
    """Find the loss and the logits in ``outputs`` (rules in the module docstring).

    Raises
    ------
    OutputError
        Neither a loss nor logits could be found; the message names the type.
    """
    if isinstance(outputs, torch.Tensor):
        return Interpreted(loss=outputs if outputs.ndim == 0 else None, logits=outputs if outputs.ndim > 0 else None)
    if isinstance(outputs, Mapping):
        found = Interpreted(loss=_tensor(outputs.get("loss")), logits=_tensor(outputs.get("logits")))
    elif isinstance(outputs, (tuple, list)):
        tensors = [item for item in outputs if isinstance(item, torch.Tensor)]
        loss = next((t for t in tensors if t.ndim == 0), None)
        logits = next((t for t in tensors if t.ndim > 0), None)
        found = Interpreted(loss=loss, logits=logits)
    else:
        found = Interpreted(
            loss=_tensor(getattr(outputs, "loss", None)), logits=_tensor(getattr(outputs, "logits", None))
        )
    if found.loss is None and found.logits is None:
        raise OutputError(describe_unusable(outputs))
    return found


def describe_unusable(outputs: Any) -> str:
    """The error text for an output nothing can be made of: its type and the three fixes."""
    kind = type(outputs)
    what = f"{kind.__module__}.{kind.__qualname__}" if kind.__module__ != "builtins" else kind.__qualname__
    if isinstance(outputs, Mapping):
        what += f" with keys {sorted(map(str, outputs))}"
    elif isinstance(outputs, (tuple, list)):
        what += " of (" + ", ".join(type(item).__name__ for item in outputs) + ")"
    return (
        f"the model returned a {what}: the trainer found neither logits nor a loss in it. Fix it one of three ways:\n"
        "  1. return logits (a tensor), a tuple whose first tensor is the logits and/or which holds a scalar loss "
        "(nanoGPT's (logits, loss)), or a mapping / ModelOutput with 'loss' and/or 'logits';\n"
        "  2. pass loss_fn=fn to rd.train, where fn(outputs, targets) returns the scalar loss from what the model returns;\n"
        "  3. give forward a 'targets' (or 'labels') parameter and return the loss you compute from it: "
        "the trainer then passes the targets by that name."
    )


def _tensor(value: Any) -> torch.Tensor | None:
    return value if isinstance(value, torch.Tensor) else None


def target_parameter(model: nn.Module) -> str | None:
    """The name under which ``model``'s ``forward`` takes targets, if it takes them at all."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # builtins, some compiled modules
        return None
    return next((name for name in TARGET_PARAMETERS if name in parameters), None)


def at_least_float32(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in its own floating precision, or float32 if lower (half precision, integers):
    a loss or metric of a float64 model is computed in float64."""
    return tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position (``(B, C)`` or ``(B, T, V)`` logits), in the
    logits' precision or float32 if lower (:func:`at_least_float32`).

    Logits a vocabulary-split LM head gathered, unchanged since, are scored from each
    tensor rank's own rows (:class:`rapydli.parallel.tensor.VocabShard`): the same loss,
    without a softmax over the whole vocabulary on every rank.
    """
    shard = getattr(logits, "vocab_parallel", None)
    if shard is not None and shard.unchanged(logits):
        return shard.cross_entropy(targets)
    return F.cross_entropy(at_least_float32(logits.reshape(-1, logits.shape[-1])), targets.reshape(-1))


class Objective:
    """Calls the model on a batch and returns its loss and what came out.

    Parameters
    ----------
    model
        The model (its ``forward`` signature decides whether it gets the targets).
    loss_fn
        ``loss_fn(outputs, targets) -> scalar loss``, or ``None`` (the model's own loss,
        else cross-entropy on the logits).
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn | None = None) -> None:
        if loss_fn is not None and not callable(loss_fn):
            raise ConfigError(f"loss_fn must be a callable (outputs, targets) -> loss, got {type(loss_fn).__name__}")
        self.loss_fn = loss_fn
        self.target_parameter = target_parameter(model) if loss_fn is None else None

    def __call__(self, model: nn.Module, inputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``(loss, outputs)`` of one batch."""
        if self.target_parameter is not None:
            outputs = model(inputs, **{self.target_parameter: targets})
            if isinstance(outputs, torch.Tensor) and outputs.numel() != 1:
                raise OutputError(
                    f"forward was given {self.target_parameter!r} and returned {_shape_or_type(outputs)}: a model that "
                    "takes the targets must return the scalar loss (reduce it, e.g. `.mean()`), or a mapping "
                    "/ tuple holding it"
                )
        else:
            outputs = model(inputs)
        return self.loss(outputs, targets), outputs

    def loss(self, outputs: Any, targets: torch.Tensor) -> torch.Tensor:
        """The scalar loss of what the model returned for ``targets`` (rules 1-3 above).

        A pipeline's last stage calls this on its outputs: the model's forward ran as
        stages, so the loss is taken from what the last one returned.
        """
        if self.loss_fn is not None:
            loss = self.loss_fn(outputs, targets)
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise OutputError(
                    f"loss_fn {_name_of(self.loss_fn)} returned {_shape_or_type(loss)}; it must return the scalar "
                    "loss of the batch (reduce it, e.g. `.mean()`)"
                )
            return loss.reshape(())
        found = interpret(outputs)
        if found.loss is not None and found.loss.numel() != 1:
            raise OutputError(
                f"the model returned a loss of shape {tuple(found.loss.shape)}: the loss must be a scalar "
                "(reduce it, e.g. `.mean()`)"
            )
        if found.loss is not None:
            return found.loss
        return cross_entropy(found.logits, targets)  # type: ignore[arg-type]

    def check_pipelined(self, model: nn.Module, stages: int, traced: bool = False) -> None:
        """Raise :class:`ConfigError` if this objective cannot be computed on a pipeline's last stage.

        A model whose ``forward`` takes the targets (rule 2) computes its loss inside
        ``forward``. Its blocks read by tracing that ``forward`` (``traced``:
        :mod:`rapydli.parallel.traced`) keep the loss in the last block, which the last
        stage gives the targets; blocks the model lists itself (``pipeline_blocks()``, an
        ``nn.Sequential``) never run that ``forward``, so the targets would never reach
        it. One stage (no pipeline) always can.
        """
        if self.target_parameter is not None and stages > 1 and not traced:
            name = type(model).__name__
            raise ConfigError(
                f"{name}.forward takes {self.target_parameter!r} and computes its own loss, which pipeline_stages={stages} cannot run: "
                f"the stages run the blocks {name}.pipeline_blocks() lists on separate ranks and never call its forward. Pass the "
                "loss the last block's output needs, e.g. rd.train(..., loss_fn=lambda logits, targets: "
                "torch.nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())), remove pipeline_blocks() so that "
                "the blocks are read from forward (its loss included), or train with pipeline_stages=1"
            )


def _name_of(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def _shape_or_type(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}"


# -- metrics ------------------------------------------------------------------------------


def _classes(outputs: Any, targets: torch.Tensor) -> torch.Tensor | None:
    """Argmax predictions, or ``None`` where accuracy means nothing (not integer targets, no logits)."""
    if targets.is_floating_point() or targets.is_complex():
        return None
    try:
        logits = outputs if isinstance(outputs, torch.Tensor) else interpret(outputs).logits
    except OutputError:
        return None
    if logits is None or logits.ndim < 1 or tuple(logits.shape[:-1]) != tuple(targets.shape):
        return None
    return logits.argmax(-1)


def accuracy(outputs: Any, targets: torch.Tensor) -> tuple[float, float] | None:
    """``(correct, positions)``: argmax of the logits against integer targets; ``None`` if not classification."""
    predicted = _classes(outputs, targets)
    if predicted is None:
        return None
    return float((predicted == targets).sum()), float(targets.numel())


def _regression_outputs(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    prediction = outputs if isinstance(outputs, torch.Tensor) else interpret(outputs).logits
    if prediction is None:
        raise ConfigError("the mse/mae metrics need a model that returns its predictions (a tensor)")
    return at_least_float32(prediction).reshape(targets.shape)


def mse(outputs: Any, targets: torch.Tensor) -> tuple[float, float]:
    """``(sum of squared errors, elements)``, in the predictions' precision or float32 if lower."""
    prediction = _regression_outputs(outputs, targets)
    error = prediction - targets.to(prediction.dtype)
    return float((error**2).sum()), float(targets.numel())


def mae(outputs: Any, targets: torch.Tensor) -> tuple[float, float]:
    """``(sum of absolute errors, elements)``, in the predictions' precision or float32 if lower."""
    prediction = _regression_outputs(outputs, targets)
    error = prediction - targets.to(prediction.dtype)
    return float(error.abs().sum()), float(targets.numel())


#: Metrics by name: ``fn(outputs, targets) -> (sum, count)`` (``None``: not meaningful here).
METRICS: dict[str, Callable[[Any, torch.Tensor], tuple[float, float] | None]] = {
    "accuracy": accuracy,
    "mse": mse,
    "mae": mae,
}

#: ``metrics`` as ``rd.train`` takes it.
MetricsArg = Sequence["str | MetricFn"] | Mapping[str, MetricFn] | None


def resolve_metrics(metrics: MetricsArg) -> dict[str, Callable[[Any, torch.Tensor], tuple[float, float] | None]] | None:
    """``{name: fn(outputs, targets) -> (sum, count) | None}``, or ``None`` for the default.

    Names must be in :data:`METRICS`; a callable ``fn(outputs, targets)`` returns a batch
    mean (a number or a scalar tensor) and is weighted by the batch's size. Raises
    :class:`ConfigError` naming what is wrong (called on the client before anything starts,
    and again on every rank).
    """
    if metrics is None:
        return None
    if isinstance(metrics, str):
        metrics = [metrics]
    items = list(metrics.items()) if isinstance(metrics, Mapping) else [(_metric_name(m), m) for m in metrics]
    resolved = {}
    for name, metric in items:
        if isinstance(metric, str):
            if metric not in METRICS:
                raise ConfigError(
                    f"metrics: unknown metric {metric!r}: the names are {', '.join(METRICS)}, or pass a callable"
                )
            resolved[name] = METRICS[metric]
        elif callable(metric):
            resolved[name] = _batch_mean(metric)
        else:
            raise ConfigError(f"metrics: {metric!r} is neither a metric name ({', '.join(METRICS)}) nor a callable")
    return resolved


def _metric_name(metric: Any) -> str:
    if isinstance(metric, str):
        return metric
    return getattr(metric, "__name__", None) or type(metric).__name__


def _batch_mean(fn: MetricFn) -> Callable[[Any, torch.Tensor], tuple[float, float]]:
    def metric(outputs: Any, targets: torch.Tensor) -> tuple[float, float]:
        value = fn(outputs, targets)
        count = float(len(targets))
        return float(value) * count, count

    return metric


def default_metrics() -> dict[str, Callable[[Any, torch.Tensor], tuple[float, float] | None]]:
    """Accuracy, reported only where it means something (see :func:`accuracy`)."""
    return {"accuracy": accuracy}
