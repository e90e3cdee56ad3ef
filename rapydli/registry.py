"""Registries of pluggable parts by name, open to other packages through entry points.

A :class:`Registry` maps a name to a part (a factory, a class, a spec object), given as
the object or as a ``"module:attribute"`` path (so naming a part does not import it). Other packages add
parts without editing RaPyDLI, as papermill's engines are added: an entry point in the
registry's group, e.g. in their ``pyproject.toml``::

    [project.entry-points."rapydli.allreduce"]
    tree = "mypackage.tree:TreeAlgorithm"

Every list of choices (``TrainConfig`` fields, command-line options, error messages) is
read from the registry, so a registered part is selectable everywhere.

Examples
--------
>>> kinds = Registry("loader kind", {"default": "rapydli.data.loaders:DefaultLoader"})
>>> kinds.names()
['default']
>>> kinds.check("fancy")
Traceback (most recent call last):
...
rapydli.errors.ConfigError: 'fancy' is not a loader kind: allowed are 'default'
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from importlib import import_module, metadata
from typing import Any

from rapydli.errors import ConfigError

#: A registered part: whatever the registry's users call or read (an algorithm class, a
#: builder function, a launcher spec, a kernel candidate).
Part = Any


class Registry:
    """Named parts of one kind; iterating it (or ``in``) goes over the names, entry points included.

    Parameters
    ----------
    what
        What a name names, for messages (``"allreduce algorithm"``).
    builtins
        The parts RaPyDLI ships: ``{name: part or "module:attribute"}``.
    group
        The entry-point group other packages register in (``None``: none).
    """

    def __init__(self, what: str, builtins: Mapping[str, Part], group: str | None = None) -> None:
        self.what, self.group = what, group
        self._factories: dict[str, Part] = dict(builtins)
        self._loaded_entry_points = group is None

    def register(self, name: str, factory: Part) -> None:
        """Add (or replace) ``name``: the part or its ``"module:attribute"`` path."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"a {self.what} needs a non-empty name, got {name!r}")
        self._factories[name] = factory

    def unregister(self, name: str) -> None:
        """Remove ``name`` (a no-op if it is not registered)."""
        self._load_entry_points()  # else a later load would bring an entry point's name back
        self._factories.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __contains__(self, name: object) -> bool:
        return name in self.names()

    def names(self) -> list[str]:
        """Every registered name, sorted (entry points included)."""
        self._load_entry_points()
        return sorted(self._factories)

    def check(self, name: str) -> str:
        """``name`` if registered, else a :class:`ConfigError` listing the allowed names."""
        if name not in self.names():
            allowed = ", ".join(repr(n) for n in self.names())
            raise ConfigError(f"{name!r} is not a {self.what}: allowed are {allowed}")
        return name

    def load(self, name: str) -> Part:
        """The part registered as ``name`` (imported on first use)."""
        factory = self._factories[self.check(name)]
        if isinstance(factory, str):
            module_name, _, attribute = factory.partition(":")
            factory = getattr(import_module(module_name), attribute)
            self._factories[name] = factory
        return factory

    def _load_entry_points(self) -> None:
        if self._loaded_entry_points:
            return
        self._loaded_entry_points = True
        for entry in metadata.entry_points(group=self.group or ""):
            self._factories.setdefault(entry.name, entry.value)
