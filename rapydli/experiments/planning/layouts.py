"""The planner's candidate layouts of a training run over ``N`` ranks, and the memory each rank needs in one.

A :class:`Candidate` is a :class:`~rapydli.parallel.layout.Layout` (the one owner of the
degrees: ``data_parallel`` replicas of a pipeline of ``pipeline_stages`` stages whose every
stage is split ``tensor_parallel`` ways, their product ``N``, and ZeRO stage ``zero`` over
the replicas) with how a step runs in it: each replica's batch cut into ``microbatches``
(pipeline micro-batches, or gradient accumulation without a pipeline), a pipeline
``schedule``, and whether every block recomputes its activations in backward
(``checkpointing``, the config's ``activation_checkpointing="blocks"``). The global batch is
the same in every candidate: each replica reads ``global_batch / data_parallel`` samples per
step. Below, ``dp``, ``pp`` and ``tp`` are short for the three degrees, as in a candidate's
label (``dp2 pp1 tp1 m1 zero0``).

:func:`enumerate_layouts` lists every candidate of ``N`` ranks a model allows: ``pp`` up to
its number of blocks, ``tp`` among the degrees its tensor plan splits (at most
:data:`MAX_TENSOR_PARALLEL`, a node's GPUs, as Megatron-LM keeps tensor parallelism inside a
node), micro-batches powers of two dividing the replica's batch, at most ``4 * pp``
(:data:`MICROBATCHES_PER_STAGE`; 4 without a pipeline), both schedules where ``pp > 1``,
ZeRO 0, 1, 2 and 3 where ``dp > 1``, each with and without activation checkpointing
(:data:`CHECKPOINTING`) and, on GPU ranks where ``zero >= 1``, with and without an
offloaded optimizer (its state and step in host memory: :func:`rank_memory`).

Memory per rank (fp32, bytes; ``P`` = bytes of the parameters a rank holds, ``k`` = 2
optimizer values per parameter for AdamW, 1 for SGD with momentum, 0 without), as the ZeRO
paper counts model states (Rajbhandari et al. 2020, §3; its mixed-precision ``(2 + 2 + K)ψ``
becomes ``(4 + 4 + 4k)ψ`` in fp32):

* ZeRO 0: parameters ``P`` + gradients ``P`` + optimizer ``k·P`` (16ψ for Adam);
* ZeRO 1: ``P + P + k·P/dp`` (optimizer state sharded: 8ψ + 8ψ/N);
* ZeRO 2: ``P + P/dp + k·P/dp`` (gradients sharded too: 4ψ + 12ψ/N);
* ZeRO 3: ``P/dp + P/dp + k·P/dp`` (parameters sharded too: 16ψ/N);

plus activations (the bytes autograd keeps for backward, times the micro-batches a stage
holds at once: :func:`rapydli.parallel.schedules.peak_live`; with checkpointing only each
block's input, plus one block's activations while it is recomputed) and ``buffers``: what
this implementation keeps beyond the formula (:func:`zero_buffers`: ZeRO-2's and 3's whole
gradient buckets in flight, ZeRO-3's gathered blocks; and the parameters of the other
pipeline stages: every rank builds the whole model).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from rapydli.parallel.layout import Layout
from rapydli.parallel.schedules import SCHEDULES
from rapydli.trainer.config import TrainConfig

MAX_TENSOR_PARALLEL = 8
MICROBATCHES_PER_STAGE = 4
#: The ZeRO stages a layout may use.
ZERO_STAGES = (0, 1, 2, 3)
#: The ``activation_checkpointing`` values a layout may use: none, or every block recomputed.
CHECKPOINTING: tuple[str | None, ...] = (None, "blocks")
#: The ``schedule`` of a layout without a pipeline.
NO_SCHEDULE = "-"


@dataclass(frozen=True)
class Candidate:
    """One way to run a training: a layout of the ranks, its micro-batches and its pipeline schedule (see the module's description)."""

    layout: Layout
    microbatches: int
    schedule: str
    checkpointing: str | None = None
    offload: bool = False

    @classmethod
    def of(
        cls,
        data_parallel: int,
        pipeline_stages: int,
        tensor_parallel: int,
        microbatches: int,
        schedule: str,
        zero: int,
        checkpointing: str | None = None,
        offload: bool = False,
    ) -> Candidate:
        """The candidate of ``data_parallel x pipeline_stages x tensor_parallel`` ranks with ZeRO stage ``zero``.

        ``checkpointing``: the ``activation_checkpointing`` it trains with (``None`` or
        ``"blocks"``); ``offload``: ``offload_optimizer`` (GPU ranks, ``zero >= 1``).
        """
        ranks = data_parallel * pipeline_stages * tensor_parallel
        return cls(
            Layout(ranks, pipeline_stages, tensor_parallel, zero), microbatches, schedule, checkpointing, offload
        )

    @property
    def data_parallel(self) -> int:
        """Data-parallel replicas."""
        return self.layout.data_parallel

    @property
    def pipeline_stages(self) -> int:
        """Pipeline stages."""
        return self.layout.pipeline_stages

    @property
    def tensor_parallel(self) -> int:
        """Tensor-parallel degree."""
        return self.layout.tensor_parallel

    @property
    def zero(self) -> int:
        """ZeRO stage."""
        return self.layout.zero

    @property
    def ranks(self) -> int:
        """``data_parallel * pipeline_stages * tensor_parallel``."""
        return self.layout.world_size

    @property
    def label(self) -> str:
        """``dp2 pp1 tp1 m1 zero0``: the plan's name for it, data_parallel, pipeline_stages, tensor_parallel,
        microbatches and zero in short; then the schedule of a pipeline, ``recompute`` with activation
        checkpointing, ``offload`` with an offloaded optimizer."""
        degrees = f"dp{self.data_parallel} pp{self.pipeline_stages} tp{self.tensor_parallel} m{self.microbatches}"
        schedule = f" {self.schedule}" if self.pipeline_stages > 1 else ""
        recompute = (
            ""
            if self.checkpointing is None
            else " recompute"
            if self.checkpointing == "blocks"
            else f" recompute:{self.checkpointing}"
        )
        return f"{degrees}{schedule} zero{self.zero}{recompute}{' offload' if self.offload else ''}"

    def replica_batch(self, global_batch: int) -> int:
        """Samples each replica reads per step."""
        return global_batch // self.data_parallel

    def microbatch(self, global_batch: int) -> int:
        """Samples per micro-batch."""
        return global_batch // self.data_parallel // self.microbatches

    def config(self, base: TrainConfig, global_batch: int, split: Sequence[str] = ()) -> TrainConfig:
        """``base`` set up for this layout: workers, per-replica batch, pipeline, tensor parallelism, ZeRO and checkpointing.

        ``split`` names the block each stage after the first begins with (``pipeline_split``).
        """
        changes: dict[str, Any] = {"workers": self.ranks, "zero": self.zero, "tensor_parallel": self.tensor_parallel,
                                   "activation_checkpointing": self.checkpointing, "offload_optimizer": self.offload}  # fmt: skip
        if self.pipeline_stages > 1:
            changes.update(
                batch_size=self.replica_batch(global_batch),
                grad_accum=1,
                pipeline_stages=self.pipeline_stages,
                microbatches=self.microbatches,
                pipeline_schedule=self.schedule,
                pipeline_split=",".join(split) if split else "auto",
            )
        else:
            changes.update(
                batch_size=self.microbatch(global_batch),
                grad_accum=self.microbatches,
                pipeline_stages=1,
                microbatches=1,
            )
        return base.replace(**changes)


def divisors(n: int) -> list[int]:
    """Divisors of ``n`` in increasing order."""
    return [d for d in range(1, n + 1) if n % d == 0]


def microbatch_choices(batch: int, pp: int) -> list[int]:
    """Powers of two dividing ``batch``, at most ``4 * pp`` (4 without a pipeline)."""
    cap = min(batch, MICROBATCHES_PER_STAGE * pp)
    return [m for m in (2**i for i in range(cap.bit_length())) if m <= cap and batch % m == 0]


def grids(ranks: int, global_batch: int, blocks: int, tensor_parallel: Sequence[int]) -> list[tuple[int, int, int]]:
    """Every ``(dp, pp, tp)`` with ``dp * pp * tp = ranks``, ``dp`` dividing the global batch, ``pp <= blocks``."""
    found = []
    for tp in divisors(ranks):
        if tp not in tensor_parallel or tp > MAX_TENSOR_PARALLEL:
            continue
        for pp in divisors(ranks // tp):
            dp = Layout(ranks, pp, tp).data_parallel
            if pp <= blocks and global_batch % dp == 0:
                found.append((dp, pp, tp))
    return found


def enumerate_layouts(
    ranks: int,
    global_batch: int,
    blocks: int,
    tensor_parallel: Sequence[int] = (1,),
    zero: Sequence[int] = ZERO_STAGES,
    checkpointing: Sequence[str | None] = (None,),
    offload: Sequence[bool] = (False,),
) -> list[Candidate]:
    """Every candidate of ``ranks`` ranks for a model of ``blocks`` pipeline blocks (see the module's description).

    ``tensor_parallel``: the degrees the model's tensor plan splits; ``zero``: the ZeRO
    stages allowed; ``checkpointing``: the ``activation_checkpointing`` values to try
    (:data:`CHECKPOINTING` for both); ``offload``: the ``offload_optimizer`` values to try
    where ``zero >= 1`` (``(False, True)`` for GPU ranks; on CPU ranks it changes nothing).
    """
    layouts = []
    for dp, pp, tp in grids(ranks, global_batch, blocks, tensor_parallel):
        batch = global_batch // dp
        for m in microbatch_choices(batch, pp):
            for schedule in SCHEDULES if pp > 1 else (NO_SCHEDULE,):
                for stage in zero if dp > 1 else (0,):
                    for recompute in checkpointing:
                        for off in offload if stage >= 1 else (False,):
                            layouts.append(Candidate.of(dp, pp, tp, m, schedule, stage, recompute, off))
    return layouts


def candidate_sizes(ranks: int, global_batch: int) -> tuple[list[int], list[int]]:
    """Micro-batch sizes and per-step batch sizes some layout of ``ranks`` ranks uses (what to measure)."""
    micro, data = set(), set()
    for dp in divisors(ranks):
        if global_batch % dp:
            continue
        batch = global_batch // dp
        for pp in divisors(ranks // dp):
            for m in microbatch_choices(batch, pp):
                micro.add(batch // m)
                data.add(batch if pp > 1 else batch // m)
    return sorted(micro), sorted(data)


def spread(sizes: Iterable[int], most: int = 6) -> list[int]:
    """At most ``most`` of ``sizes``: all of them, or the smallest, the largest and some between, evenly on a log scale."""
    ordered = sorted(set(sizes))
    if len(ordered) <= most:
        return ordered
    picks = {ordered[round(i * (len(ordered) - 1) / (most - 1))] for i in range(most)}
    return sorted(picks)


def optimizer_factor(config: TrainConfig) -> int:
    """Optimizer values kept per parameter: AdamW 2 (two moments), SGD 1 with momentum, else 0."""
    if config.optimizer == "adamw":
        return 2
    return 1 if config.momentum > 0 else 0


@dataclass(frozen=True)
class Memory:
    """Bytes one rank holds at its peak, by kind (see the module's description).

    ``host``: bytes kept in the host's memory instead of a GPU rank's (an offloaded
    optimizer's state and the copies of the slices it steps: :func:`rank_memory`), not in
    :attr:`peak`.
    """

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    buffers: float
    host: float = 0.0

    @property
    def model_states(self) -> float:
        """Parameters + gradients + optimizer state: what the ZeRO formula counts."""
        return self.parameters + self.gradients + self.optimizer

    @property
    def peak(self) -> float:
        """Everything: model states, activations and buffers."""
        return self.model_states + self.activations + self.buffers


def zero_states(parameter_bytes: float, dp: int, zero: int, factor: int) -> tuple[float, float, float]:
    """``(parameters, gradients, optimizer)`` bytes per rank by the fp32 ZeRO formulas."""
    parameters = parameter_bytes / dp if zero >= 3 else parameter_bytes
    gradients = parameter_bytes / dp if zero >= 2 else parameter_bytes
    optimizer = factor * parameter_bytes / (dp if zero >= 1 else 1)
    return parameters, gradients, optimizer


def offloads(offload: bool, zero: int, device: str) -> bool:
    """Whether ``offload_optimizer`` moves anything: a sharded optimizer (``zero >= 1``) on a GPU rank; on a CPU rank its state is in host memory already."""
    return offload and zero >= 1 and device != "cpu"


def rank_memory(
    parameter_bytes: float,
    dp: int,
    zero: int,
    config: TrainConfig,
    *,
    units: Sequence[float] = (),
    root: float = 0.0,
    tensors: int = 0,
    device: str = "cpu",
    accumulating: bool = False,
    offload: bool = False,
    activations: float = 0.0,
    others: float = 0.0,
) -> Memory:
    """What one rank holds for ``parameter_bytes`` of trained parameters (the one owner of the sum, for the planner and the memory check).

    The ZeRO formula's states (:func:`zero_states`); as ``buffers``, what this
    implementation keeps beyond them (:func:`zero_buffers` over ``units``, ``root`` and
    ``accumulating``; :func:`synchronizer_bytes`; :func:`optimizer_scalar_bytes` for each of
    ``tensors``) and ``others``, the parameters it holds but does not train; and
    ``activations``. When ``offload`` moves anything (:func:`offloads`), the optimizer
    state and the fp32 copies of the rank's slices (``P / dp``, which it steps) are in
    ``host`` instead: the GPU keeps the parameters and gradients.
    """
    states = zero_states(parameter_bytes, dp, zero, optimizer_factor(config))
    buffers = zero_buffers(parameter_bytes, dp, zero, config.bucket_mb * (1 << 20), units, root, accumulating)
    buffers += synchronizer_bytes(dp, zero, device) + optimizer_scalar_bytes(config) * tensors + others
    memory = Memory(*states, activations=activations, buffers=buffers)
    if offloads(offload, zero, device):
        return replace(memory, optimizer=0.0, host=memory.optimizer + parameter_bytes / dp)
    return memory


def synchronizer_bytes(dp: int, zero: int, device: str) -> float:
    """Bytes the gradient synchronizer (ZeRO 0 and 1 with ``dp > 1``) keeps beyond its buckets on CPU ranks.

    Its buckets are node-shared buffers, and the first one brings the shared-memory
    reduction's areas (:data:`rapydli.comm.shm.AREAS_BYTES`, 1 MiB a rank; counted wherever
    the ranks are, as at most). GPU ranks' buckets are device tensors: nothing.
    """
    from rapydli.comm.shm import AREAS_BYTES

    return float(AREAS_BYTES) if dp > 1 and zero < 2 and device == "cpu" else 0.0


def optimizer_scalar_bytes(config: TrainConfig) -> int:
    """Bytes an optimizer keeps per parameter tensor beyond its per-element state, at most.

    AdamW's ``step``: a float32 scalar, float64 under a float64 default dtype.
    """
    return 8 if config.optimizer == "adamw" else 0


def zero_buffers(
    parameter_bytes: float,
    dp: int,
    zero: int,
    bucket_bytes: float,
    units: Sequence[float] = (),
    root: float = 0.0,
    accumulating: bool = False,
) -> float:
    """Bytes this implementation keeps beyond the formula (:class:`rapydli.parallel.zero.ShardedOptimizer`,
    :class:`rapydli.parallel.zero3.FullyShardedOptimizer`).

    The parameters live in the optimizer's buckets and stage 1's gradients in the
    synchronizer's, so neither is a copy; stage 2 adds each gradient into a whole bucket
    and reduce-scatters it during backward, with up to
    :data:`~rapydli.parallel.zero.IN_FLIGHT` buckets in flight and one filling (at most
    ``P``, where the formula counts ``P / dp``). A step's first reduce-scatter of a bucket
    writes the gradient slice the formula counts; with more than one backward a step
    (``accumulating``: gradient accumulation, a pipeline's micro-batches) the later ones
    write an output beside it (``1 / dp`` of each bucket in flight).

    Stage 3's buckets are its units: ``units`` the bytes of each block's parameters in
    forward order, ``root`` those no block holds (embeddings, final norm, head; empty:
    one unit of everything). Its gradients go through the largest ``IN_FLIGHT + 1``
    units' whole buckets as stage 2's do, and while a block runs its parameters are
    whole, with the next block's prefetched and the root kept gathered from the
    beginning of forward to the end of backward: ``root`` plus the largest sum of two
    neighbouring units (with one replica too: the gathered buffers are copies of its slices).
    """
    from rapydli.parallel.zero import IN_FLIGHT

    if zero < 2 or (zero == 2 and dp == 1):
        return 0.0
    outputs = 1 / dp if accumulating else 0.0
    if zero == 2:
        in_flight = min(parameter_bytes, (IN_FLIGHT + 1) * bucket_bytes)
        return in_flight * (1 + outputs)
    blocks = list(units) or [parameter_bytes - root]
    gathered = root + max([a + b for a, b in zip(blocks, blocks[1:])] or blocks)
    in_flight = sum(sorted([*blocks, root], reverse=True)[: IN_FLIGHT + 1])
    return gathered + in_flight * (1 + outputs)


def smallest_states(
    ranks: int,
    global_batch: int,
    blocks: int,
    parameter_bytes: float,
    factor: int,
    zero: Sequence[int],
    tensor_parallel: Sequence[int],
) -> tuple[float, str]:
    """A lower bound of the model states some layout needs per rank, and that layout's grid.

    Each rank is given an even share of the parameters (``P / (pp * tp)``, which no real split
    beats) and the most ZeRO sharding allowed; activations are not counted.
    """
    best = (float("inf"), "")
    for dp, pp, tp in grids(ranks, global_batch, blocks, tensor_parallel):
        share = parameter_bytes / (pp * tp)
        stage = max(zero) if dp > 1 else 0
        need = sum(zero_states(share, dp, stage, factor))
        best = min(best, (need, f"dp{dp} pp{pp} tp{tp} zero{stage}"))
    return best
