"""Predicting a layout's step time and peak memory per rank from a profile and a network.

One step of a :class:`~rapydli.experiments.planning.layouts.Candidate`, as the Trainer runs it:

1. **data**: every rank collates its batch (``pp > 1``: the replica's batch once;
   ``pp = 1``: each of the ``microbatches`` accumulation steps);
2. **compute**: the stages' forward and backward of every micro-batch, played through the
   schedule by :func:`rapydli.parallel.schedules.simulate` (which gives the bubble): a
   stage's time per micro-batch is its blocks' measured times at the micro-batch size on one
   of ``tp`` ranks (:class:`~rapydli.experiments.planning.profile.Profile`) plus their tensor-parallel
   allreduces (``collectives`` ring at ``tp`` ranks, blocking); a transfer between stages
   costs ``p2p`` of the largest boundary activation, and a receive that waited is noticed
   as late as measured (``LinkModel.delay_after``). Stages are cut where the measured
   times balance (:func:`rapydli.parallel.split.balance`), as ``pipeline_split="auto"``
   does, and the layout's config names those cuts. With activation checkpointing a
   block's backward runs its forward again first (one more forward per block, its
   tensor-parallel allreduces included). With ZeRO 3 every block's parameters are
   allgathered (half a ``collectives`` ring at ``dp`` ranks of its bytes) before its
   forward and again before its backward, the next block's gather running during the
   current block's compute (:func:`gathered`: only what a gather takes beyond the
   compute it overlaps is added, and the first gather of each pass);
3. **gradients** (``dp > 1``): ZeRO 0 and 1, the synchronizer's buckets (reverse
   parameter order, the first at most 1 MiB, then ``bucket_mb``) each start their
   allreduce (``allreduce`` ring at ``dp`` ranks) when backward has produced all their
   gradients, during the stage's last backward, one after another; ZeRO 2, the
   :class:`~rapydli.parallel.zero.ShardedOptimizer`'s buckets (reverse order, ``bucket_mb``)
   each reduce-scattered (half a ``collectives`` ring) as backward completes it, after its
   gradients are added into the bucket (a copy of the stage's parameter bytes); ZeRO 3
   the same with one bucket per block. Only what runs past the end of backward counts
   (with ``overlap=False``, all of it: ZeRO 2 and 3 always overlap). Gradients are taken
   as ready when their block's backward ends;
4. **optimizer**: the step's measured time per parameter byte on the rank's share
   (``1 / dp`` with ZeRO), plus with ZeRO 1 and 2 the allgather of the updated parameters
   (half a ``collectives`` ring; they live in the buckets, so nothing else is copied);
   ZeRO 3 gathers nothing after the step (the next forward does);
5. **the loop**: the training loop's own time per step
   (:attr:`~rapydli.experiments.planning.profile.Profile.step_overhead_s`, measured on one rank).

The step is the slowest stage's. Peak memory per rank is the largest stage's
:class:`~rapydli.experiments.planning.layouts.Memory`. The profile's blocks stand for the
units ZeRO-3 gathers and the blocks checkpointing recomputes (a model's pipeline blocks
and :func:`rapydli.parallel.split.model_blocks` are the same modules but for the wrappers
a ``pipeline_blocks()`` may add around embeddings and head).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rapydli.comm.synchronizer import FIRST_BUCKET_BYTES
from rapydli.experiments.planning.layouts import Candidate, Memory, offloads, rank_memory
from rapydli.experiments.planning.network import Network
from rapydli.experiments.planning.profile import BlockCost, Profile
from rapydli.parallel import schedules, split
from rapydli.trainer.config import TrainConfig


@dataclass
class Prediction:
    """What :func:`predict` says of one layout (times in seconds, memory in bytes per rank).

    Attributes
    ----------
    step_s
        Predicted time of one optimizer step.
    data_s, compute_s, bubble, gradient_s, optimizer_s
        Its parts: collating the batch, the pipeline's forward and backward (with
        tensor-parallel allreduces and transfers), the share of ``compute_s`` the slowest
        stage idles, the gradient allreduce not hidden by backward, the optimizer step
        with ZeRO's copies and collectives.
    memory
        The peak per rank (the largest stage's), by kind.
    stage_memory
        Each stage's (the ranks of a stage hold the same).
    split
        The blocks stages 2.. begin with (empty without a pipeline).
    """

    layout: Candidate
    step_s: float
    data_s: float
    compute_s: float
    bubble: float
    gradient_s: float
    optimizer_s: float
    memory: Memory
    stage_memory: list[Memory] = field(default_factory=list)
    split: list[str] = field(default_factory=list)


def _bucketed(
    parameters: Sequence[tuple[float, int]], bucket_bytes: float, first_bytes: float
) -> list[list[tuple[float, int]]]:
    """``parameters`` grouped as they fill buckets of ``bucket_bytes`` (the second at most ``first_bytes``)."""
    buckets: list[list[tuple[float, int]]] = []
    size = 0
    for ready, nbytes in parameters:
        cap = min(bucket_bytes, first_bytes) if len(buckets) == 1 else bucket_bytes
        if buckets and size + nbytes <= cap:
            buckets[-1].append((ready, nbytes))
            size += nbytes
        else:
            buckets.append([(ready, nbytes)])
            size = nbytes
    return buckets


def exposed_allreduce(
    parameters: Sequence[tuple[float, int]],
    backward_end: float,
    network: Network,
    dp: int,
    bucket_bytes: float,
    overlap: bool = True,
) -> float:
    """Seconds the gradient allreduce runs past ``backward_end``.

    ``parameters``: ``(time its gradient is ready, bytes)`` in the order backward produces
    them (reverse registration order); buckets are filled as
    :class:`rapydli.comm.GradientSynchronizer` fills them, and reduced one after another.
    """
    if dp <= 1 or not parameters:
        return 0.0
    clock = 0.0
    for bucket in _bucketed(parameters, bucket_bytes, FIRST_BUCKET_BYTES):
        ready = max(r for r, _ in bucket) if overlap else backward_end
        nbytes = sum(n for _, n in bucket)
        clock = max(clock, ready) + network.allreduce.allreduce_time(
            dp, nbytes + 4 * len(bucket)
        )  # + a "used" flag per parameter
    return max(0.0, clock - backward_end)


def exposed_reduce_scatter(
    parameters: Sequence[tuple[float, int]], backward_end: float, network: Network, dp: int, bucket_bytes: float
) -> float:
    """Seconds ZeRO 2's (or 3's) reduce-scatters run past ``backward_end`` (``parameters`` as for :func:`exposed_allreduce`).

    Buckets are filled as :class:`rapydli.parallel.zero.ShardedOptimizer` fills them (no
    small first bucket) and reduce-scattered one after another from the moment each is
    complete; ``bucket_bytes=0``: every entry is a bucket of its own (ZeRO 3's blocks).
    """
    if dp <= 1 or not parameters:
        return 0.0
    clock = 0.0
    for bucket in _bucketed(parameters, bucket_bytes, bucket_bytes):
        clock = (
            max(clock, max(r for r, _ in bucket))
            + network.collectives.allreduce_time(dp, sum(n for _, n in bucket)) / 2
        )
    return max(0.0, clock - backward_end)


def gathered(computes: Sequence[float], gathers: Sequence[float]) -> list[float]:
    """Each block's time in one pass (forward, or backward in its order) with ZeRO-3's prefetched gathers.

    ``computes[i]``: block ``i``'s compute in the order the pass runs the blocks;
    ``gathers[i]``: the allgather of its parameters. The first block waits for its own
    gather; every block's compute runs while the next block's gather does, and takes the
    longer of the two.
    """
    following = [*gathers[1:], 0.0]
    return [max(c, g) + (gathers[0] if i == 0 else 0.0) for i, (c, g) in enumerate(zip(computes, following))]


def _tp_time(network: Network, tp: int, calls: Sequence[int]) -> float:
    return sum(network.collectives.allreduce_time(tp, nbytes) for nbytes in calls) if tp > 1 else 0.0


def stage_bounds(blocks: Sequence[BlockCost], stages: int) -> list[int]:
    """Where stages begin: the measured forward + backward times balanced (as ``pipeline_split="auto"``)."""
    if stages == 1:
        return [0, len(blocks)]
    return split.balance([b.forward_s + b.backward_s for b in blocks], stages, [b.holds_parameters for b in blocks])


def predict(
    layout: Candidate, profile: Profile, network: Network, global_batch: int, config: TrainConfig
) -> Prediction:
    """Step time and peak memory per rank of ``layout`` (see the module's description)."""
    micro = layout.microbatch(global_batch)
    blocks = profile.blocks(layout.tensor_parallel, micro)
    bounds = stage_bounds(blocks, layout.pipeline_stages)
    stages = [blocks[bounds[s] : bounds[s + 1]] for s in range(layout.pipeline_stages)]
    sharded = layout.zero >= 3 and layout.data_parallel > 1
    recompute = layout.checkpointing is not None
    block_forward, block_backward = [], []  # per stage, per block (forward order) seconds of one micro-batch
    for stage in stages:
        fwd = [b.forward_s + _tp_time(network, layout.tensor_parallel, b.tp_forward_bytes) for b in stage]
        bwd = [
            b.backward_s
            + _tp_time(network, layout.tensor_parallel, b.tp_backward_bytes)
            + (f if recompute and b.recomputed else 0.0)
            for b, f in zip(stage, fwd)
        ]
        if sharded:
            gathers = [network.collectives.allreduce_time(layout.data_parallel, b.parameters_bytes) / 2 for b in stage]
            fwd = gathered(fwd, gathers)
            bwd = gathered(bwd[::-1], gathers[::-1])[::-1]
        block_forward.append(fwd)
        block_backward.append(bwd)
    forward, backward = [sum(f) for f in block_forward], [sum(b) for b in block_backward]
    transfer = max((network.p2p.send_time(stage[-1].output_bytes) for stage in stages[:-1]), default=0.0)
    plan = schedules.build(
        layout.schedule if layout.pipeline_stages > 1 else "1f1b", layout.pipeline_stages, layout.microbatches
    )
    timeline = schedules.simulate(plan, forward, backward, transfer, network.p2p.delay_after)
    data = (
        profile.data_time(layout.replica_batch(global_batch))
        if layout.pipeline_stages > 1
        else layout.microbatches * profile.data_time(micro)
    )
    bucket_bytes = config.bucket_mb * (1 << 20)
    finish, gradient_parts, optimizer_parts, memories = [], [], [], []
    for s, stage in enumerate(stages):
        spans = timeline.spans[s]
        end = spans[-1][2]
        last_backward = max(start for action, start, _ in spans if action.kind == "backward")
        parameter_bytes = sum(b.parameters_bytes for b in stage)
        ready, produced, units = [], last_backward, []
        for block, seconds in zip(reversed(stage), reversed(block_backward[s])):
            produced += seconds
            ready += [(produced, nbytes) for nbytes in reversed(block.parameter_bytes)]
            units.append((produced, block.parameters_bytes))
        copies = profile.gradient_copy_s_per_byte * parameter_bytes if layout.data_parallel > 1 else 0.0
        if layout.zero == 3:  # one bucket per block
            gradient = copies + exposed_reduce_scatter(units, end, network, layout.data_parallel, 0.0)
        elif layout.zero == 2:
            gradient = copies + exposed_reduce_scatter(ready, end, network, layout.data_parallel, bucket_bytes)
        else:
            gradient = exposed_allreduce(ready, end, network, layout.data_parallel, bucket_bytes, config.overlap)
        if offloads(
            layout.offload, layout.zero, profile.device
        ):  # the slices' gradients to the host, the step there, the slices back
            optimizer = (
                (profile.host_optimizer_s_per_byte + 2 * profile.host_copy_s_per_byte)
                * parameter_bytes
                / layout.data_parallel
            )
        else:
            optimizer = profile.optimizer_s_per_byte * parameter_bytes / (layout.data_parallel if layout.zero else 1)
        if layout.zero in (1, 2) and layout.data_parallel > 1:
            optimizer += network.collectives.allreduce_time(layout.data_parallel, parameter_bytes) / 2
        finish.append(end + gradient + optimizer)
        gradient_parts.append(gradient)
        optimizer_parts.append(optimizer)
        memories.append(
            rank_memory(
                parameter_bytes,
                layout.data_parallel,
                layout.zero,
                config,
                units=[float(b.parameters_bytes) for b in stage],
                tensors=sum(len(b.parameter_bytes) for b in stage),
                device=profile.device,
                accumulating=layout.microbatches > 1,
                offload=layout.offload,
                activations=stage_activations(stage, layout, plan[s], s),
                others=sum(b.parameters_bytes for b in blocks) - parameter_bytes,
            )
        )  # every rank builds the whole model
    slowest = max(range(layout.pipeline_stages), key=lambda s: finish[s])
    bubble = timeline.idle_fraction(slowest) if layout.pipeline_stages > 1 else 0.0
    return Prediction(
        layout=layout,
        step_s=data + finish[slowest] + profile.step_overhead_s,
        data_s=data,
        compute_s=timeline.makespan,
        bubble=bubble,
        gradient_s=gradient_parts[slowest],
        optimizer_s=optimizer_parts[slowest],
        memory=max(memories, key=lambda m: m.peak),
        stage_memory=memories,
        split=[profile.names[i] for i in bounds[1:-1]],
    )


def stage_activations(
    stage: Sequence[BlockCost], layout: Candidate, actions: Sequence[schedules.Action], index: int
) -> float:
    """Bytes of activations stage ``index`` holds at its peak.

    Without checkpointing: every block's saved bytes, plus the stage's output kept for the
    gradient that comes back (not on the last stage), times the micro-batches the
    schedule keeps alive at once. With checkpointing, a recomputed block keeps only its
    input (a block checkpointing leaves alone, its saved bytes), and the stage its output,
    for every live micro-batch; the one in backward peaks either where its forward ended
    or while a recomputed block is recomputed: what the blocks up to it keep (those after
    it are freed by then) plus what the recomputation saves beyond its input.
    """
    live = schedules.peak_live(actions) if layout.pipeline_stages > 1 else 1
    held_outputs = stage[-1].output_bytes if index < layout.pipeline_stages - 1 else 0
    if layout.checkpointing is None:
        return live * (sum(b.saved_bytes for b in stage) + held_outputs)
    kept = [b.input_bytes if b.recomputed else b.saved_bytes for b in stage]
    per_batch = sum(kept) + held_outputs
    recomputing = [
        sum(kept[: k + 1]) + held_outputs + b.saved_bytes - b.saved_input_bytes
        for k, b in enumerate(stage)
        if b.recomputed
    ]
    return (live - 1) * per_batch + max([per_batch, *recomputing])
