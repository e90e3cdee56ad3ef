"""A package's public names, imported on first use: the one loader behind every package's ``__getattr__``.

``import rapydli`` (and ``rapydli.cluster``, ``rapydli.trainer``, ...) must stay fast and
must not import torch, ipyparallel or plotly: a ``TrainConfig`` is built, a CLI command
parses its arguments, the Jupyter server lists clusters, without them. Each package names
its public API in a table ``{name: defining module}``; :class:`LazyExports` imports the
module when a name is first read, keeps the value in the package's namespace (so the next
read is a plain attribute), and lists the names for ``dir()`` and completion.

Examples
--------
In a package's ``__init__.py``::

    _LAZY = {"Cluster": "rapydli.cluster.cluster"}
    __all__ = sorted(_LAZY)
    _exports = LazyExports(__name__, _LAZY, globals())


    def __getattr__(name: str) -> Any:
        return _exports.attribute(name)


    def __dir__() -> list[str]:
        return _exports.names()
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from importlib import import_module
from typing import Any


class LazyExports:
    """The public names of ``package``: ``names`` maps each to the module defining it; ``subpackages``
    are imported whole when read as attributes; ``also`` are names the package defines itself (listed
    by :meth:`names`, never loaded here)."""

    def __init__(
        self,
        package: str,
        names: Mapping[str, str],
        namespace: dict[str, Any],
        subpackages: Collection[str] = (),
        also: Collection[str] = (),
    ) -> None:
        self.package, self.table, self.namespace = package, dict(names), namespace
        self.subpackages, self.also = frozenset(subpackages), tuple(also)

    def attribute(self, name: str) -> Any:
        """The value of ``package.name``, imported now and kept in the package's namespace."""
        if name in self.table:
            value = getattr(import_module(self.table[name]), name)
        elif name in self.subpackages:
            value = import_module(f"{self.package}.{name}")
        else:
            raise AttributeError(f"module {self.package!r} has no attribute {name!r}")
        self.namespace[name] = value
        return value

    def names(self) -> list[str]:
        """The public names (``also`` and the table's), sorted: the package's ``dir()``, its subpackages with them."""
        return sorted({*self.also, *self.table, *self.subpackages})
