"""Whether a run fits ``TrainConfig.memory_per_rank``: the model states a rank would hold, predicted before anything starts.

:func:`check_fits` is the front door's check (``rd.train`` through
:class:`~rapydli.experiments.job.TrainingJob`, before the cluster starts): the model is
built on the meta device (shapes only, no memory), and :func:`rank_share` finds the
parameters the largest rank trains in the config's layout: its pipeline stage (the
config's ``pipeline_split``; ``"auto"``, measured by the ranks, is estimated here by
balancing the blocks' parameter bytes) and its tensor slices (the model split with the
run's tensor plan on a :class:`~rapydli.experiments.planning.profile.ShardProbe`).
:func:`predict_states` counts what the rank holds for them with the planner's formulas
(:func:`~rapydli.experiments.planning.layouts.zero_states`,
:func:`~rapydli.experiments.planning.layouts.zero_buffers`): parameters, gradients and
optimizer state by ZeRO stage, the buffers this implementation keeps beyond them, the
other pipeline stages' parameters when the split is ``"auto"`` (measured on the whole
model, so every rank builds it whole; a named split is recorded on the meta device and a
rank makes only its stage: :mod:`rapydli.parallel.deferred`) and frozen parameters. Activations are not counted here (they need a batch run through the model:
``rd.plan_parallel`` measures them), so a config that passes can still run out of memory
in its activations; ``activation_checkpointing`` keeps those small.

Examples
--------
>>> from rapydli.trainer.config import TrainConfig
>>> from torch import nn
>>> model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)])  # 526,336 parameters: 16 bytes each with AdamW
>>> round(predict_states(model, TrainConfig(zero=3), 4).model_states)
2105344
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from rapydli.errors import ConfigError
from rapydli.experiments.planning.layouts import Memory, rank_memory
from rapydli.parallel.layout import Layout
from rapydli.trainer.config import TrainConfig

#: The most data-parallel replicas :func:`check_fits` tries when it looks for a number of ranks that would fit.
MOST_REPLICAS = 4096


@dataclass(frozen=True)
class RankShare:
    """The parameters the largest rank of a layout trains, in bytes.

    Attributes
    ----------
    trained
        Its trained parameters (its stage's, its tensor slices), each counted once.
    units
        Their bytes by ZeRO-3 unit (the stage's blocks in forward order).
    root
        Bytes of those no block holds (ZeRO-3's root unit; 0 for a pipeline stage).
    others
        Parameters it holds but does not train: the other stages' (with ``pipeline_split="auto"``,
        where every rank builds the whole model) and frozen ones.
    tensors
        Its trained parameter tensors (the optimizer keeps a scalar or two for each).
    device
        The device type the model trains on (``model_fn`` moved it there): an offloaded
        optimizer leaves a ``cuda`` rank's memory.
    """

    trained: float
    units: tuple[float, ...]
    root: float
    others: float
    tensors: int = 0
    device: str = "cpu"


def _bytes(parameters: Any, seen: set[int]) -> float:
    """Bytes of the trained ``parameters`` not in ``seen`` (added to it)."""
    total = 0
    for p in parameters:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    return float(total)


def rank_share(model: nn.Module, config: TrainConfig, device: str = "cpu") -> RankShare:
    """What the largest rank of ``config``'s layout trains of ``model`` (built on the meta device; it is split in place) on ``device``."""
    from rapydli.parallel import split
    from rapydli.parallel.config import split_names

    if config.tensor_parallel > 1:
        from rapydli.experiments.planning.profile import ShardProbe
        from rapydli.parallel.config import tensor_plan
        from rapydli.parallel.tensor import parallelize
        from rapydli.parallel.tensor_plans import plan_for

        plan = tensor_plan(config.tensor_plan) or plan_for(model, config.tensor_parallel)
        parallelize(model, plan, ShardProbe(config.tensor_parallel))  # type: ignore[arg-type]
    every = _bytes(model.parameters(), set())
    tensors = sum(1 for p in model.parameters() if p.requires_grad)  # the whole model's: at least the largest rank's
    frozen = float(sum(p.numel() * p.element_size() for p in model.parameters() if not p.requires_grad))
    if config.pipeline_stages > 1:
        seen: set[int] = set()
        blocks = [_bytes(block.parameters(), seen) for _, block in split.pipeline_blocks(model)]
        points = split_names(config.pipeline_split)
        if points == "auto":
            bounds = split.balance(blocks, config.pipeline_stages, split.holds_parameters(model))
        else:
            bounds = split.boundaries(model, points, config.pipeline_stages)
        stages = [blocks[bounds[s] : bounds[s + 1]] for s in range(config.pipeline_stages)]
        largest = max(stages, key=sum)
        # a named split is recorded on the meta device and each rank makes only its stage (rapydli.parallel.deferred);
        # "auto" times the whole model's blocks, so every rank builds it whole and keeps the other stages' parameters
        others = every - sum(largest) if points == "auto" else 0.0
        return RankShare(sum(largest), tuple(largest), 0.0, others + frozen, tensors, device)
    seen = set()
    units = tuple(b for b in (_bytes(block.parameters(), seen) for _, block in split.model_blocks(model)) if b)
    return RankShare(every, units, every - sum(units), frozen, tensors, device)


def predict_states(model: nn.Module, config: TrainConfig, world_size: int) -> Memory:
    """Bytes the largest rank holds for ``config`` on ``world_size`` ranks, activations left out (see the module's description)."""
    share = rank_share(model, config)
    return _memory(share, Layout.of(config, world_size), config)


class StatesPredictor:
    """:func:`predict_states` for many configs of one model: the model is built on the meta device once per pipeline and tensor split.

    ``None`` from :meth:`of` when the model cannot be built on the meta device; a split the
    model does not have raises its :class:`ConfigError` (once per split).
    """

    def __init__(self, model_fn: Callable[[], Any]) -> None:
        self.model_fn = model_fn
        self._shares: dict[tuple[Any, ...], RankShare | ConfigError] = {}

    @classmethod
    def of(cls, model_fn: Callable[[], Any]) -> StatesPredictor | None:
        """A predictor of ``model_fn``'s model, or ``None`` if it cannot be built on the meta device."""
        from rapydli.parallel.preflight import meta_model

        return cls(model_fn) if meta_model(model_fn) is not None else None

    def __call__(self, config: TrainConfig, world_size: int) -> Memory:
        """What the largest rank of ``config`` on ``world_size`` ranks holds, activations left out."""
        from rapydli.parallel.preflight import meta_build

        key = (config.pipeline_stages, config.pipeline_split, config.tensor_parallel, config.tensor_plan)
        if key not in self._shares:
            built = meta_build(self.model_fn)
            assert built is not None
            try:
                self._shares[key] = rank_share(built.model, config, built.device.type)
            except ConfigError as exc:  # remembered too: the model is not built again for the same split
                self._shares[key] = exc
        share = self._shares[key]
        if isinstance(share, ConfigError):
            raise share
        return _memory(share, Layout.of(config, world_size), config)


def _memory(share: RankShare, layout: Layout, config: TrainConfig) -> Memory:
    accumulating = config.grad_accum > 1 or (
        layout.pipeline_stages > 1 and config.microbatches > 1
    )  # more than one backward a step
    return rank_memory(
        share.trained,
        layout.data_parallel,
        layout.zero,
        config,
        units=share.units,
        root=share.root,
        tensors=share.tensors,
        device=share.device,
        accumulating=accumulating,
        offload=config.offload_optimizer,
        others=share.others,
    )


def _mb(nbytes: float) -> str:
    """Bytes in MiB, as every memory figure RaPyDLI prints (``memory_per_rank`` may be given in MB or MiB)."""
    return f"{nbytes / 2**20:.4g} MiB"


def check_fits(model_fn: Callable[[], Any], config: TrainConfig, world_size: int) -> Memory | None:
    """Raise :class:`ConfigError` if ``config`` on ``world_size`` ranks is predicted over ``config.memory_per_rank``.

    The message names the predicted bytes per rank (by kind), the limit, and what would
    fit: other ZeRO stages on these ranks, the fewest ranks that fit with ``zero=3``, and
    activation checkpointing for the activations this check does not count. Returns the
    prediction (``None`` without a limit, or with a warning when the model cannot be built
    on the meta device: it loads weights, moves itself to a device).
    """
    limit = config.memory_per_rank
    if limit is None:
        return None
    from rapydli.parallel.preflight import meta_build

    built = meta_build(model_fn)
    if built is None:
        warnings.warn(
            f"memory_per_rank={_mb(limit)} was not checked: the model cannot be built on the meta device (shapes only), "
            "which the prediction needs",
            stacklevel=3,
        )
        return None
    layout = Layout.of(config, world_size)
    share = rank_share(built.model, config, built.device.type)
    memory = _memory(share, layout, config)
    if memory.peak <= limit:
        return memory
    per_replica = layout.pipeline_stages * layout.tensor_parallel
    fitting = [
        f"zero={zero} on these {world_size} ranks ({_mb(other.peak)} per rank)"
        for zero in (3, 2, 1, 0)
        if zero != layout.zero and layout.data_parallel > 1
        for other in [_memory(share, Layout(world_size, layout.pipeline_stages, layout.tensor_parallel, zero), config)]
        if other.peak <= limit
    ]
    if (
        share.device != "cpu" and not config.offload_optimizer and layout.data_parallel > 1
    ):  # a GPU rank can leave its optimizer to the host
        fitting += [
            f"zero={zero} with offload_optimizer=True on these {world_size} ranks ({_mb(other.peak)} per rank on the {share.device} device, "
            f"{_mb(other.host)} in host memory)"
            for zero in (1, 2, 3)
            for other in [
                _memory(
                    share,
                    Layout(world_size, layout.pipeline_stages, layout.tensor_parallel, zero),
                    config.replace(zero=zero, offload_optimizer=True),
                )
            ]
            if other.peak <= limit
        ][:1]
    if not fitting:
        more = next(
            (
                dp
                for dp in range(layout.data_parallel + 1, MOST_REPLICAS + 1)
                if _memory(
                    share, Layout(dp * per_replica, layout.pipeline_stages, layout.tensor_parallel, 3), config
                ).peak
                <= limit
            ),
            None,
        )
        if more is not None:
            bigger = _memory(
                share, Layout(more * per_replica, layout.pipeline_stages, layout.tensor_parallel, 3), config
            )
            fitting.append(f"zero=3 on {more * per_replica} ranks or more ({_mb(bigger.peak)} per rank)")
        else:
            fitting.append(
                f"no zero stage on up to {MOST_REPLICAS * per_replica} ranks of this pipeline and tensor split: split the model "
                "more ways (pipeline_stages, tensor_parallel) or raise the limit"
            )
    if config.activation_checkpointing is None:
        fitting.append("and activation_checkpointing='blocks' keeps the activations (not counted here) small")
    raise ConfigError(
        f"memory_per_rank={_mb(limit)} is too small for {layout.describe()}: a rank is predicted to hold "
        f"{_mb(memory.peak)} ({_mb(memory.parameters)} parameters, {_mb(memory.gradients)} gradients, {_mb(memory.optimizer)} "
        f"optimizer state, {_mb(memory.buffers)} buffers; activations not counted"
        f"{f'; {_mb(memory.host)} of optimizer state and slices in host memory (offload_optimizer), not counted' if memory.host else ''}"
        f"), {_mb(memory.peak - limit)} over. "
        f"What would fit: {'; '.join(fitting)}"
    )
