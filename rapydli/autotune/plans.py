"""Finished model plans in the cache: their key, and :class:`~rapydli.autotune.model.Plan` as JSON.

A plan is stored once its tuning finished (an interrupted one stores none: its rerun
resumes from the cached measurements). It is keyed by the device (fingerprint, kernel
templates, timing), the model (class, text form, every convolution's hyperparameters), the input's
shape, dtype and layout, the mode and the tuning options (the budget included: a larger
budget tunes again, from the cache). A warm start reads it and applies it: no forward
pass, no profiling, no measuring, no whole-model check.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch
from torch import nn

from rapydli.autotune.model import LayerChoice, Plan
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.search import Config

FORMAT = 2  # 2: shapes carry groups and dilation


def model_signature(model: nn.Module) -> list[Any]:
    """The model's class, its text form and every convolution's name and hyperparameters (no forward pass)."""
    convs = [
        [
            name,
            type(m).__name__,
            m.in_channels,
            m.out_channels,
            list(m.kernel_size),
            list(m.stride),
            str(m.padding),
            list(m.dilation),
            m.groups,
            m.bias is not None,
            m.padding_mode,
        ]
        for name, m in model.named_modules()
        if isinstance(m, nn.Conv2d)
    ]
    text = hashlib.sha256(repr(model).encode()).hexdigest()
    return [type(model).__module__, type(model).__qualname__, text, convs]


def plan_key(
    fingerprint: str,
    model: nn.Module,
    example_input: torch.Tensor,
    mode: str,
    verify: bool,
    budget_s: float | None,
    options: Mapping[str, Any],
) -> str:
    """A stable key of one tuning's question (see the module docstring); computed without running the model."""
    channels_last = (
        example_input.dim() == 4
        and example_input.is_contiguous(memory_format=torch.channels_last)
        and not example_input.is_contiguous()
    )
    payload = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "mode": mode,
        "verify": verify,
        "budget_s": budget_s,
        "input": [list(example_input.shape), str(example_input.dtype), channels_last],
        "model": model_signature(model),
        "options": {k: repr(v) for k, v in sorted(options.items()) if k != "cache"},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _config(data: Any) -> Config | None:
    return None if data is None else Config(data[0], tuple((k, v) for k, v in data[1]))


def _config_data(config: Config | None) -> Any:
    return None if config is None else [config.candidate, [list(p) for p in config.params]]


def plan_to_json(plan: Plan) -> str:
    """``plan`` as JSON text (see :func:`plan_from_json`)."""
    layers = {}
    for name, c in plan.layers.items():
        layers[name] = {
            "shape": asdict(c.shape),
            "candidate": c.candidate,
            "params": [list(p) for p in c.params],
            "layout": c.layout,
            "time_ms": c.time_ms,
            "default_ms": c.default_ms,
            "data_grad": _config_data(c.data_grad),
            "weight_grad": _config_data(c.weight_grad),
        }
    return json.dumps(
        {
            "format": FORMAT,
            "layers": layers,
            "mode": plan.mode,
            "fingerprint": plan.fingerprint,
            "estimates_ms": plan.estimates_ms,
            "chosen": plan.chosen,
        }
    )


def plan_from_json(text: str) -> Plan:
    """The :class:`Plan` written by :func:`plan_to_json`."""
    data = json.loads(text)
    layers = {
        name: LayerChoice(
            ConvShape(**c["shape"]),
            c["candidate"],
            tuple((k, v) for k, v in c["params"]),
            c["layout"],
            c["time_ms"],
            c["default_ms"],
            _config(c["data_grad"]),
            _config(c["weight_grad"]),
        )
        for name, c in data["layers"].items()
    }
    return Plan(layers, data["mode"], data["fingerprint"], data["estimates_ms"], data["chosen"])
