"""``TrainConfig``: the typed, validated hyperparameters of a training run.

Every field carries its own spec (type, allowed range or choices, log scale, help) in
its dataclass metadata; ``__post_init__`` validates against that spec, and
:func:`fields_spec` hands the same spec to front ends (widgets are generated from it),
so the rules live in one place.

Examples
--------
>>> cfg = TrainConfig(epochs=2, lr=0.01, optimizer="sgd")
>>> TrainConfig.from_dict(cfg.to_dict()) == cfg
True
>>> TrainConfig(lr=-1)
Traceback (most recent call last):
...
rapydli.errors.ConfigError: TrainConfig.lr=-1 is invalid: must be in (0, 10]
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rapydli.cluster.hang import ACTIONS as HANG_ACTIONS
from rapydli.comm.registry import ALGORITHMS
from rapydli.data.kinds import LOADERS
from rapydli.errors import ConfigError
from rapydli.parallel.config import check_grid, check_pipeline, checkpoint_interval, tensor_plan_text
from rapydli.parallel.schedules import SCHEDULES as PIPELINE_SCHEDULES
from rapydli.registry import Registry, tracker_names


@dataclass(frozen=True)
class FieldSpec:
    """What a front end needs to know to build a control for one config field.

    Attributes
    ----------
    name, type, default
        Field name, its Python type name (``"int"``, ``"float"``, ``"bool"``, ``"str"``)
        and default value.
    choices
        Allowed values of an enumerated field, else ``None``.
    low, high
        Numeric bounds (``None`` where unbounded); ``low_open``/``high_open`` say whether
        the bound itself is excluded.
    log
        Whether a slider should be log-scaled (learning rates, sizes).
    optional
        ``None`` is allowed (meaning "off" / "unlimited").
    help
        One line describing the field.
    """

    name: str
    type: str
    default: Any
    choices: tuple[Any, ...] | None = None
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    log: bool = False
    optional: bool = False
    help: str = ""

    def describe(self) -> str:
        """The allowed values in words, for error messages (``"must be in (0, 10]"``)."""
        if self.choices is not None:
            text = "must be one of " + ", ".join(repr(c) for c in self.choices)
        elif self.type == "bool":
            text = "must be True or False"
        elif self.type in ("int", "float"):
            left = "(" if self.low_open or self.low is None else "["
            right = ")" if self.high_open or self.high is None else "]"
            low = "-inf" if self.low is None else _num(self.low)
            high = "inf" if self.high is None else _num(self.high)
            kind = "an integer in " if self.type == "int" else "in "
            text = f"must be {kind}{left}{low}, {high}{right}"
        else:
            text = f"must be a {self.type}"
        return text + " or None" if self.optional else text


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def _spec(default: Any, help: str, **kwargs: Any) -> Any:  # noqa: A002 - matches FieldSpec.help
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class TrainConfig:
    """Hyperparameters of a data-parallel training run; validated when built.

    A bad value raises :class:`~rapydli.errors.ConfigError` naming the field and the
    allowed range, before any process starts. ``batch_size`` is per rank; the global
    batch of one optimizer step is ``batch_size * grad_accum * world_size``.
    ``max_steps`` and ``warmup_steps`` count optimizer steps.

    The ``step`` schedule multiplies the learning rate by 0.1 at 50% and again at 75% of
    the run's steps; ``cosine`` decays to 0 at the last step; both after the linear
    warm-up. ``eval_every=0`` evaluates at the end of every epoch only;
    ``checkpoint_every=0`` checkpoints at the end of every epoch only (when
    ``checkpoint_dir`` is set).

    Examples
    --------
    >>> TrainConfig(batch_size=64, lr=3e-4, precision="bf16").global_batch(world_size=2)
    128
    """

    epochs: int = _spec(1, "passes over the training data", low=1, high=100_000)
    max_steps: int | None = _spec(
        None, "stop after this many optimizer steps (None: run all epochs)", low=1, high=10**9, optional=True, log=True
    )
    batch_size: int = _spec(32, "samples per rank per micro-step", low=1, high=65_536, log=True)
    lr: float = _spec(1e-3, "peak learning rate", low=0.0, high=10.0, low_open=True, log=True)
    optimizer: str = _spec("adamw", "optimizer", choices=("sgd", "adamw"))
    momentum: float = _spec(0.9, "SGD momentum (AdamW: beta1)", low=0.0, high=1.0, high_open=True)
    weight_decay: float = _spec(0.0, "decoupled weight decay (AdamW) or L2 (SGD)", low=0.0, high=1.0)
    lr_schedule: str = _spec("constant", "learning-rate schedule after warm-up", choices=("constant", "cosine", "step"))
    warmup_steps: int = _spec(0, "optimizer steps of linear warm-up", low=0, high=10**9)
    grad_clip: float | None = _spec(
        None,
        "clip the global gradient norm to this (None: no clipping)",
        low=0.0,
        high=1e6,
        low_open=True,
        optional=True,
        log=True,
    )
    grad_accum: int = _spec(1, "micro-steps accumulated per optimizer step", low=1, high=1024)
    precision: str = _spec("fp32", "forward/loss precision (bf16: autocast)", choices=("fp32", "bf16"))
    allreduce: str = _spec("auto", "allreduce algorithm for gradients", choices=ALGORITHMS)
    bucket_mb: float = _spec(25.0, "gradient bucket size in MiB", low=0.0, high=4096.0, low_open=True, log=True)
    overlap: bool = _spec(True, "start each bucket's allreduce during backward")
    seed: int = _spec(0, "seed of weights, shuffling and dropout", low=0, high=2**32 - 1)
    eval_every: int = _spec(0, "evaluate every N steps (0: at epoch ends only)", low=0, high=10**9)
    checkpoint_dir: str | None = _spec(None, "directory for checkpoints (None: no checkpoints)", optional=True)
    checkpoint_every: int = _spec(0, "checkpoint every N steps (0: at epoch ends only)", low=0, high=10**9)
    resume: bool = _spec(False, "continue from the checkpoint in checkpoint_dir if there is one")
    zero: int = _spec(
        0,
        "shard over the data-parallel ranks: 0 off, 1 the optimizer state (ZeRO-1), 2 the gradients too, 3 the parameters too",
        low=0,
        high=3,
    )
    offload_optimizer: bool = _spec(
        False,
        "keep the sharded optimizer state in host memory and step there (zero>=1, ZeRO-Offload): a no-op on CPU ranks, where it already is",
    )
    activation_checkpointing: str | None = _spec(
        None,
        "recompute activations in backward: None (keep them), 'blocks' (every block) or 'every_k:N' (blocks 0, N, 2N, ...)",
        optional=True,
    )
    memory_per_rank: float | None = _spec(
        None,
        "bytes a rank may hold for training ('200MB', '1.5GiB' or a number of bytes): a layout predicted over it is refused "
        "before the run starts (None: no limit)",
        low=0.0,
        high=1e15,
        low_open=True,
        optional=True,
        log=True,
    )
    on_resize: str = _spec(
        "keep",
        "resuming on another number of ranks: keep the global batch (grad_accum) or scale the lr",
        choices=("keep", "scale"),
    )
    max_restarts: int = _spec(
        0, "restart the cluster and resume from the last checkpoint when a rank dies, at most N times", low=0, high=100
    )
    min_workers: int | None = _spec(
        None,
        "a restart may go on with this many engines when fewer come back (None: all)",
        low=1,
        high=4096,
        optional=True,
    )
    num_workers: int = _spec(0, "data-loading worker processes/threads per rank", low=0, high=64)
    loader: str = _spec("default", "data loader kind", choices=LOADERS)
    cache_ram_mb: float = _spec(
        256.0, "clairvoyant loader: RAM cache budget per rank (MiB)", low=0.0, high=1e7, log=True
    )
    cache_disk_mb: float = _spec(0.0, "clairvoyant loader: local-disk cache budget per rank (MiB)", low=0.0, high=1e8)
    autotune: bool = _spec(False, "tune the model's convolutions once (rank 0) and use the plan on every rank")
    autotune_budget_s: float | None = _spec(
        60.0,
        "seconds rank 0 may spend tuning (None: no limit)",
        low=0.0,
        high=1e6,
        low_open=True,
        optional=True,
        log=True,
    )
    workers: int | None = _spec(
        None,
        "ranks rd.train starts when it is given no cluster (None: 2, or pipeline_stages x tensor_parallel when more); "
        "with a cluster its engines are the ranks, and a workers that differs is refused",
        low=1,
        high=4096,
        optional=True,
    )
    pipeline_stages: int = _spec(
        1, "pipeline stages the model is split into (ranks = data-parallel degree x stages)", low=1, high=1024
    )
    microbatches: int = _spec(1, "micro-batches each pipeline step cuts a batch into", low=1, high=4096, log=True)
    pipeline_schedule: str = _spec("1f1b", "pipeline schedule", choices=PIPELINE_SCHEDULES)
    pipeline_split: str = _spec(
        "auto", "where stages begin: 'auto' (measured) or block names, comma-separated ('blocks.2,blocks.4')"
    )
    tensor_parallel: int = _spec(
        1,
        "ranks each layer's weights are split over (ranks = data-parallel x pipeline_stages x tensor_parallel)",
        low=1,
        high=1024,
    )
    tensor_plan: str | None = _spec(
        None,
        "how layers are split: None / 'auto' (the model's built-in plan), or {module glob: 'column' | 'row' | 'heads'} (dict or JSON)",
        optional=True,
    )
    trackers: str = _spec(
        "",
        "experiment trackers the client also logs the run to, comma-separated ('mlflow,tensorboard'; a list works too; '' none)",
    )
    hang_timeout_s: float | None = _spec(
        None,
        "seconds no rank progresses before the run counts as hung (None: 5x the median step, at least 60 s)",
        low=0.0,
        high=1e6,
        low_open=True,
        optional=True,
        log=True,
    )
    on_hang: str = _spec(
        "wait", "when the run hangs: print the diagnosis and keep waiting, or abort the run", choices=HANG_ACTIONS
    )

    def __post_init__(self) -> None:
        if isinstance(self.pipeline_split, list | tuple) and all(isinstance(n, str) for n in self.pipeline_split):
            self.pipeline_split = ",".join(self.pipeline_split)  # ["blocks.2", "blocks.4"] is "blocks.2,blocks.4"
        self.trackers = ",".join(
            tracker_names(self.trackers, "TrainConfig.trackers")
        )  # checked against rapydli.registry.TRACKERS
        self.tensor_plan = tensor_plan_text(
            self.tensor_plan
        )  # a dict is kept as its JSON text (the run store and the CLI carry text)
        if isinstance(self.memory_per_rank, str):  # "200MB" is kept as its bytes
            self.memory_per_rank = byte_size(self.memory_per_rank, "TrainConfig.memory_per_rank")
        for spec in fields_spec():
            setattr(self, spec.name, _validated(spec, getattr(self, spec.name)))
        if self.resume and self.checkpoint_dir is None:
            raise ConfigError("TrainConfig.resume=True needs TrainConfig.checkpoint_dir (a directory path), got None")
        checkpoint_interval(self.activation_checkpointing)
        if self.offload_optimizer and self.zero == 0:
            raise ConfigError(
                "TrainConfig.offload_optimizer=True needs zero=1, 2 or 3 (it offloads the sharded optimizer state), got zero=0"
            )
        if self.pipeline_stages > 1:
            check_pipeline(self)
        elif self.tensor_parallel > 1:
            check_grid(self)

    def ranks_to_start(self) -> int:
        """The engines ``rd.train`` starts when it is given no cluster.

        ``workers``, or when it is ``None`` the smallest multiple of ``pipeline_stages x
        tensor_parallel`` that is at least 2.

        Examples
        --------
        >>> TrainConfig().ranks_to_start(), TrainConfig(pipeline_stages=3).ranks_to_start(), TrainConfig(workers=1).ranks_to_start()
        (2, 3, 1)
        """
        if self.workers is not None:
            return self.workers
        per_replica = self.pipeline_stages * self.tensor_parallel
        return per_replica * -(-2 // per_replica)

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step across all ranks."""
        return self.batch_size * self.grad_accum * world_size

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-friendly dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        """Build from a dict; unknown keys are a :class:`ConfigError` naming them."""
        return cls(**values)

    def replace(self, **changes: Any) -> TrainConfig:
        """A validated copy with ``changes`` applied."""
        return self.from_dict({**self.to_dict(), **changes})

    def with_trackers(self, trackers: Sequence[str] | str | None) -> TrainConfig:
        """A copy that also logs to ``trackers`` (names, or one comma-separated string), beside its own ``trackers``;
        the keyword ``trackers=`` of ``rd.train``, ``rd.sweep``, ``rd.scaling_study`` and ``rd.batch`` goes through here."""
        if not trackers:
            return self
        return self.replace(
            trackers=",".join(filter(None, [self.trackers, *([trackers] if isinstance(trackers, str) else trackers)]))
        )

    @staticmethod
    def fields_spec() -> list[FieldSpec]:
        """See :func:`fields_spec`."""
        return fields_spec()


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def byte_size(value: Any, name: str = "memory_per_rank") -> float:
    """Bytes that ``value`` names: a number of bytes, or text with a unit (``"200MB"``, ``"1.5 GiB"``).

    Units: ``B``, ``KB``/``MB``/``GB``/``TB`` (powers of 1000) and ``KiB``/``MiB``/``GiB``/``TiB``
    (powers of 1024), in any case. Anything else, or a size not above 0, is a
    :class:`ConfigError` naming ``name``.

    Examples
    --------
    >>> byte_size("200MB"), byte_size("1.5 GiB"), byte_size(4096)
    (200000000.0, 1610612736.0, 4096.0)
    """
    usage = (
        "bytes > 0: a number, or text with a unit such as '200MB' or '1.5GiB' (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )
    if isinstance(value, str):
        found = _SIZE.fullmatch(value)
        unit = found.group(2).lower() if found else None
        if found is None or unit not in _UNITS:
            raise ConfigError(f"{name}={value!r} is invalid: {usage}")
        size = float(found.group(1)) * _UNITS[unit]
    elif isinstance(value, int | float) and not isinstance(value, bool):
        size = float(value)
    else:
        raise ConfigError(f"{name}={value!r} is invalid: {usage}")
    if not math.isfinite(size) or size <= 0:
        raise ConfigError(f"{name}={value!r} is invalid: {usage}")
    return size


def _check_keywords(init: Any) -> Any:
    """Wrap the dataclass ``__init__`` so an unknown keyword names the closest field."""

    def checked(self: TrainConfig, *args: Any, **kwargs: Any) -> None:
        known = [f.name for f in dataclasses.fields(TrainConfig)]
        for name in kwargs:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"the fields are {', '.join(known)}"
                raise ConfigError(f"TrainConfig has no field {name!r}: {hint}")
        init(self, *args, **kwargs)

    checked.__doc__, checked.__wrapped__ = init.__doc__, init  # type: ignore[attr-defined]
    return checked


TrainConfig.__init__ = _check_keywords(TrainConfig.__init__)  # type: ignore[method-assign]

_TYPES = {int: "int", float: "float", bool: "bool", str: "str"}


def fields_spec() -> list[FieldSpec]:
    """One :class:`FieldSpec` per ``TrainConfig`` field, in declaration order.

    Examples
    --------
    >>> spec = {s.name: s for s in fields_spec()}
    >>> spec["lr"].log, spec["optimizer"].choices
    (True, ('sgd', 'adamw'))
    """
    specs = []
    for f in dataclasses.fields(TrainConfig):
        meta = dict(f.metadata)
        if isinstance(meta.get("choices"), Registry):  # read now: a registered part is a choice
            meta["choices"] = tuple(meta["choices"].names())
        type_name = _type_name(f.type)
        specs.append(FieldSpec(name=f.name, type=type_name, default=f.default, **meta))
    return specs


def _type_name(annotation: Any) -> str:
    text = str(annotation).replace(" | None", "")
    return text if text in _TYPES.values() else "str"


def _validated(spec: FieldSpec, value: Any) -> Any:
    where = f"TrainConfig.{spec.name}={value!r} is invalid: {spec.describe()}"
    if value is None:
        if spec.optional:
            return None
        raise ConfigError(where)
    if spec.type == "bool":
        if not isinstance(value, bool):
            raise ConfigError(where)
        return value
    if spec.type == "str":
        if spec.choices is None and isinstance(value, os.PathLike):
            value = os.fspath(value)
        if not isinstance(value, str) or (spec.choices is not None and value not in spec.choices):
            raise ConfigError(where)
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(where)
    if spec.type == "int":
        if isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(where)
            value = int(value)
    else:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(where)
    if spec.low is not None and (value < spec.low or (spec.low_open and value == spec.low)):
        raise ConfigError(where)
    if spec.high is not None and (value > spec.high or (spec.high_open and value == spec.high)):
        raise ConfigError(where)
    return value
