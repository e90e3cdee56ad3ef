"""Naming functions so a run can be repeated: ``"module:qualname"`` references."""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from rapydli.errors import ConfigError


def callable_ref(fn: Any) -> str | None:
    """``"module:qualname"`` if ``fn`` can be imported back by that name, else ``None``."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or "<" in qualname or module == "__main__":
        return None
    try:
        target: Any = import_module(module)
        for part in qualname.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if target is fn else None


def resolve_callable(ref: Callable[..., Any] | str, argument: str) -> Callable[..., Any]:
    """``ref`` itself if callable, or the object a ``"module:qualname"`` string names."""
    if callable(ref):
        return ref
    if isinstance(ref, str) and ref.count(":") == 1:
        module, qualname = ref.split(":")
        try:
            target: Any = import_module(module)
            for part in qualname.split("."):
                target = getattr(target, part)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"{argument}={ref!r} cannot be imported: {exc}") from None
        if callable(target):
            return target
    raise ConfigError(f"{argument}={ref!r} is invalid: must be a callable or a 'module:qualname' string naming one")
