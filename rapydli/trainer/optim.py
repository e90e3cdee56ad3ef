"""The run's optimizer: built from the config or by the user's ``optimizer_fn``; its lr schedule.

``optimizer_fn(model)`` (or ``optimizer_fn(model, config)``, to read ``config.lr`` and
``config.weight_decay`` as sweeps vary them) returns any ``torch.optim.Optimizer``, with
as many parameter groups as it likes (no decay on norms and biases, a smaller rate for an
embedding, ...). The learning-rate schedule (``config.lr_schedule`` after
``config.warmup_steps``) then applies to every group, each from the rate the group was
built with (kept as ``group["initial_lr"]``, as torch's schedulers keep it). Without
``optimizer_fn`` the optimizer is ``config.optimizer`` at ``config.lr``, one group.

Examples
--------
>>> import torch
>>> from rapydli.trainer.config import TrainConfig
>>> model = torch.nn.Linear(2, 2)
>>> opt = make_optimizer(model, TrainConfig(lr=0.1, lr_schedule="cosine"),
...     lambda m: torch.optim.SGD([{"params": [m.weight]}, {"params": [m.bias], "lr": 0.01}], lr=0.1))
>>> apply_schedule(opt, TrainConfig(lr=0.1, lr_schedule="cosine"), step=2, total_steps=4)
[0.05, 0.005]
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from rapydli.errors import ConfigError
from rapydli.trainer.config import TrainConfig
from rapydli.trainer.schedule import lr_at

OptimizerFn = Callable[..., torch.optim.Optimizer]


def make_optimizer(
    model: nn.Module, config: TrainConfig, optimizer_fn: OptimizerFn | None = None
) -> torch.optim.Optimizer:
    """``optimizer_fn(model[, config])``, checked, or ``config.optimizer``; every group remembers its initial lr."""
    if optimizer_fn is None:
        optimizer = build_optimizer(model, config)
    else:
        check_optimizer_fn(optimizer_fn)
        optimizer = optimizer_fn(model, config) if _takes_config(optimizer_fn) else optimizer_fn(model)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer_fn must return a torch.optim.Optimizer, got {type(optimizer).__name__}")
        _check_covers(optimizer, model)
    for group in optimizer.param_groups:
        group.setdefault("initial_lr", group["lr"])
    return optimizer


def check_optimizer_fn(optimizer_fn: Any) -> None:
    """Raise :class:`ConfigError` unless ``optimizer_fn`` is a callable of ``(model)`` or ``(model, config)``."""
    if not callable(optimizer_fn):
        raise ConfigError(
            f"optimizer_fn must be a callable (model) -> torch.optim.Optimizer, got {type(optimizer_fn).__name__}"
        )


def _takes_config(fn: Callable[..., Any]) -> bool:
    try:
        parameters = [
            p
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return False
    return len(parameters) >= 2


def _check_covers(optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
    """Every parameter the optimizer updates must be the model's (a copy's would never move)."""
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for p in group["params"] if id(p) not in own)
    if foreign:
        raise ConfigError(
            f"optimizer_fn returned an optimizer over {foreign} tensors that are not parameters of the model it was given: "
            "build it from the model argument (optimizer_fn(model) -> Optimizer(model.parameters(), ...))"
        )


def apply_schedule(optimizer: Any, config: TrainConfig, step: int, total_steps: int, scale: float = 1.0) -> list[float]:
    """Set every group's lr for ``step`` from its ``initial_lr`` (times ``scale``); returns the rates, group by group."""
    rates = []
    for group in optimizer.param_groups:
        group["lr"] = scale * lr_at(
            config.lr_schedule, step, total_steps, group.get("initial_lr", config.lr), config.warmup_steps
        )
        rates.append(group["lr"])
    return rates


def build_optimizer(model: nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer ``config.optimizer`` names (AdamW uses ``momentum`` as beta1)."""
    return optimizer_over(list(model.parameters()), config)


def optimizer_over(params: list[nn.Parameter], config: TrainConfig) -> torch.optim.Optimizer:
    """``config.optimizer`` over ``params`` (a ZeRO shard's slices, or a model's parameters)."""
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.lr, betas=(config.momentum, 0.999), weight_decay=config.weight_decay)
