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


#: The experiment trackers a run can be logged to (:mod:`rapydli.experiments.trackers`), open to
#: the ``rapydli.trackers`` entry-point group. Named in this base module because
#: ``TrainConfig.trackers`` and ``RAPYDLI_TRACKERS`` (below the experiments layer) are checked
#: against it; naming a tracker imports nothing.
TRACKERS = Registry(
    "tracker",
    {
        "mlflow": "rapydli.experiments.trackers.mlflow:MlflowTracker",
        "tensorboard": "rapydli.experiments.trackers.tensorboard:TensorBoardTracker",
        "wandb": "rapydli.experiments.trackers.wandb:WandbTracker",
    },
    group="rapydli.trackers",
)


def tracker_names(value: object, where: str) -> tuple[str, ...]:
    """The tracker names of ``value`` (a list, a comma-separated text, ``None`` or ``""``), checked.

    ``where`` names the setting in the error (``"TrainConfig.trackers"``).

    Examples
    --------
    >>> tracker_names("mlflow, tensorboard", "RAPYDLI_TRACKERS")
    ('mlflow', 'tensorboard')
    >>> tracker_names(["mlfow"], "TrainConfig.trackers")
    Traceback (most recent call last):
    ...
    rapydli.errors.ConfigError: TrainConfig.trackers=['mlfow'] is invalid: 'mlfow' is not a tracker: allowed are 'mlflow', 'tensorboard', 'wandb'
    """
    if value is None:
        return ()
    if isinstance(value, str):
        items: list[object] = [part.strip() for part in value.split(",") if part.strip()]
    elif isinstance(value, (list, tuple)):
        items = list(value)
    else:
        raise ConfigError(f"{where}={value!r} is invalid: a list of tracker names or a comma-separated text")
    names: list[str] = []
    for item in items:
        try:
            name = TRACKERS.check(item) if isinstance(item, str) else TRACKERS.check(repr(item))
        except ConfigError as exc:
            raise ConfigError(f"{where}={value!r} is invalid: {exc}") from None
        if name not in names:
            names.append(name)
    return tuple(names)
