"""Autotuned convolutions: a BEAST-style tuner, generated kernels, tuned models.

A kernel is a template plus a parameter space; device limits (hard constraints) and user
limits (soft constraints) prune it; every surviving instance is compiled with its
parameters as constants, validated against ``F.conv2d`` in float64, benchmarked (in
parallel across a cluster's engines if one is given) and cached; the fastest wins::

    from rapydli.autotune import ConvShape, tune_conv2d, autotune_model, plan_for, apply_plan

    result = tune_conv2d(ConvShape(8, 64, 56, 56, 64, 3, 3, pad=1), mode="train")
    result.best.config, result.table

    tuned_model, report = autotune_model(model, example_batch, budget_s=60)   # tuned copy + report
    plan = plan_for(model, example_batch)                        # once (notebook / rank 0)
    apply_plan(model, plan)                                      # on every rank

Names are imported lazily (the C compiler, Triton and plotly are touched only when used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rapydli.lazy import LazyExports

_LAZY = {
    "ConvShape": "rapydli.autotune.problem",
    "TuneResult": "rapydli.autotune.conv",
    "tune_conv2d": "rapydli.autotune.conv",
    "autotune_model": "rapydli.autotune.model",
    "plan_for": "rapydli.autotune.model",
    "apply_plan": "rapydli.autotune.model",
    "Plan": "rapydli.autotune.model",
    "TunedConv2d": "rapydli.autotune.model",
    "AutotuneReport": "rapydli.autotune.model",
    "Space": "rapydli.autotune.space",
    "Cache": "rapydli.autotune.cache",
    "query": "rapydli.autotune.device",
}

__all__ = [
    "AutotuneReport",
    "Cache",
    "ConvShape",
    "Plan",
    "Space",
    "TuneResult",
    "TunedConv2d",
    "apply_plan",
    "autotune_model",
    "plan_for",
    "query",
    "tune_conv2d",
]


_exports = LazyExports(__name__, _LAZY, globals(), also=__all__)


def __getattr__(name: str) -> Any:
    return _exports.attribute(name)


def __dir__() -> list[str]:
    return _exports.names()


if TYPE_CHECKING:  # pragma: no cover
    from rapydli.autotune.cache import Cache
    from rapydli.autotune.conv import TuneResult, tune_conv2d
    from rapydli.autotune.device import query
    from rapydli.autotune.model import (
        AutotuneReport,
        Plan,
        TunedConv2d,
        apply_plan,
        autotune_model,
        plan_for,
    )
    from rapydli.autotune.problem import ConvShape
    from rapydli.autotune.space import Space
