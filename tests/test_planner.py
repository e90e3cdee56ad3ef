"""The layout planner without processes: enumeration, memory formulas, step-time prediction, refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import rapydli as rd
from rapydli.cluster import current
from rapydli.comm.shm import AREAS_BYTES
from rapydli.comm.synchronizer import FIRST_BUCKET_BYTES
from rapydli.errors import ConfigError
from rapydli.experiments.planning.layouts import (
    CHECKPOINTING,
    NO_SCHEDULE,
    Candidate,
    candidate_sizes,
    enumerate_layouts,
    microbatch_choices,
    spread,
    zero_buffers,
    zero_states,
)
from rapydli.experiments.planning.network import LinkModel, Network, fit_link
from rapydli.experiments.planning.perfmodel import RingModel
from rapydli.experiments.planning.profile import BlockCost, Profile
from rapydli.experiments.planning.stepmodel import exposed_allreduce, exposed_reduce_scatter, gathered, predict
from rapydli.parallel import schedules
from rapydli.zoo import datasets, models

NET = Network(allreduce=RingModel(1e-4, 1e-9), collectives=RingModel(2e-4, 2e-9), p2p=LinkModel(3e-4, 3e-9))
ADAM = rd.TrainConfig(batch_size=8, optimizer="adamw")


def _block(
    forward: float, backward: float, params: int = 1000, saved: int = 100, out: int = 10, tp: tuple[int, ...] = ()
) -> BlockCost:
    return BlockCost(forward, backward, saved, out, (params,) if params else (), tp, tp, holds_parameters=params > 0)


def _profile(blocks_per_size: dict[int, list[BlockCost]], tp: dict[int, list[BlockCost]] | None = None) -> Profile:
    measured = {(1, size): blocks for size, blocks in blocks_per_size.items()}
    measured.update({(2, size): blocks for size, blocks in (tp or {}).items()})
    names = [f"b{i}" for i in range(len(next(iter(blocks_per_size.values()))))]
    return Profile(
        names, measured, optimizer_s_per_byte=1e-6, gradient_copy_s_per_byte=1e-7, data_s={8: 0.01, 16: 0.02}
    )


# -- enumeration --------------------------------------------------------------------------


def test_two_ranks_enumerate_every_layout_once() -> None:
    layouts = enumerate_layouts(2, 32, blocks=4, tensor_parallel=(1, 2))
    assert (
        len(layouts) == len(set(layouts)) == 12 + 8 + 3
    )  # dp2: m 1,2,4 x zero 0-3; pp2: m 1,2,4,8 x 2 schedules; tp2: m 1,2,4
    assert all(layout.ranks == 2 and layout.checkpointing is None for layout in layouts)
    assert {(x.data_parallel, x.pipeline_stages, x.tensor_parallel) for x in layouts} == {
        (2, 1, 1),
        (1, 2, 1),
        (1, 1, 2),
    }
    assert all(x.zero == 0 for x in layouts if x.data_parallel == 1) and {
        x.zero for x in layouts if x.data_parallel == 2
    } == {0, 1, 2, 3}
    both = enumerate_layouts(2, 32, blocks=4, tensor_parallel=(1, 2), checkpointing=CHECKPOINTING)
    assert len(both) == len(set(both)) == 2 * len(layouts) and {x.checkpointing for x in both} == {None, "blocks"}
    assert {x.schedule for x in layouts if x.pipeline_stages == 2} == set(schedules.SCHEDULES)
    assert all(x.schedule == NO_SCHEDULE for x in layouts if x.pipeline_stages == 1)
    assert all(32 // x.data_parallel % x.microbatches == 0 for x in layouts)


def test_enumeration_respects_blocks_batch_degrees_and_zero() -> None:
    assert {(x.data_parallel, x.pipeline_stages, x.tensor_parallel) for x in enumerate_layouts(2, 32, blocks=1)} == {
        (2, 1, 1)
    }  # one block: no pipeline; tp not allowed
    assert {(x.data_parallel, x.pipeline_stages) for x in enumerate_layouts(2, 3, blocks=4)} == {
        (1, 2)
    }  # 3 samples do not split over 2 replicas
    assert {x.zero for x in enumerate_layouts(4, 32, blocks=4, zero=(0, 1))} == {0, 1}
    big = enumerate_layouts(64, 1024, blocks=4, tensor_parallel=(1, 2, 4, 8, 16))
    assert all(x.ranks == 64 and x.pipeline_stages <= 4 and x.tensor_parallel <= 8 for x in big)
    assert {x.tensor_parallel for x in big} == {1, 2, 4, 8} and {x.pipeline_stages for x in big} == {1, 2, 4}


def test_microbatch_choices_and_sizes_to_measure() -> None:
    assert microbatch_choices(16, 1) == [1, 2, 4]
    assert microbatch_choices(32, 2) == [1, 2, 4, 8]
    assert microbatch_choices(6, 4) == [1, 2]
    micro, data = candidate_sizes(2, 32)
    assert micro == [4, 8, 16, 32] and data == [4, 8, 16, 32]
    assert spread(range(1, 101), most=4) == [1, 34, 67, 100] and spread([3, 1, 2]) == [1, 2, 3]


def test_layout_config_sets_batch_pipeline_and_zero() -> None:
    base = rd.TrainConfig(batch_size=16, lr=0.01)
    piped = Candidate.of(1, 2, 1, 4, "gpipe", 0).config(base, 32, ["blocks.1"])
    assert (piped.workers, piped.batch_size, piped.pipeline_stages, piped.microbatches, piped.pipeline_schedule) == (
        2,
        32,
        2,
        4,
        "gpipe",
    )
    assert piped.pipeline_split == "blocks.1" and piped.global_batch(1) == 32 and piped.lr == 0.01
    accumulated = Candidate.of(2, 1, 1, 2, NO_SCHEDULE, 1).config(base, 32)
    assert (accumulated.batch_size, accumulated.grad_accum, accumulated.zero, accumulated.pipeline_stages) == (
        8,
        2,
        1,
        1,
    )
    assert accumulated.global_batch(2) == 32
    recomputed = Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 3, "blocks")
    assert recomputed.label == "dp2 pp1 tp1 m1 zero3 recompute"
    assert (recomputed.config(base, 32).zero, recomputed.config(base, 32).activation_checkpointing) == (3, "blocks")
    assert (
        Candidate.of(2, 1, 1, 2, NO_SCHEDULE, 1).config(recomputed.config(base, 32), 32).activation_checkpointing
        is None
    )  # replaced


def test_every_layout_is_a_config_the_trainer_takes() -> None:
    composed = Candidate.of(1, 2, 2, 4, "1f1b", 0).config(ADAM, 16)
    assert (composed.workers, composed.pipeline_stages, composed.tensor_parallel, composed.microbatches) == (4, 2, 2, 4)
    sharded = Candidate.of(2, 1, 2, 1, NO_SCHEDULE, 2).config(ADAM, 16)
    assert (sharded.workers, sharded.tensor_parallel, sharded.zero, sharded.batch_size) == (4, 2, 2, 8)
    assert (
        Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0).config(composed, 16).tensor_parallel == 1
    )  # a base's degree is replaced


# -- memory formulas ----------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 64])
def test_zero_formulas_in_fp32(n: int) -> None:
    psi = 1_000_000  # parameters; fp32: P = 4 psi bytes
    p = 4.0 * psi
    assert sum(zero_states(p, n, 0, 2)) == 16 * psi  # 4 params + 4 grads + 8 Adam
    assert sum(zero_states(p, n, 1, 2)) == pytest.approx(8 * psi + 8 * psi / n)
    assert sum(zero_states(p, n, 2, 2)) == pytest.approx(4 * psi + 12 * psi / n)
    assert sum(zero_states(p, n, 3, 2)) == pytest.approx(16 * psi / n)  # parameters sharded too
    assert sum(zero_states(p, n, 0, 1)) == 12 * psi  # SGD with momentum: one buffer
    bucket = 25.0 * (1 << 20)
    assert (
        zero_buffers(p, n, 0, bucket) == zero_buffers(p, n, 1, bucket) == zero_buffers(p, 1, 2, bucket) == 0
    )  # parameters live in the buckets
    assert zero_buffers(p, n, 2, bucket) == pytest.approx(
        p
    )  # ZeRO-2: whole gradient buckets, at most the model's; their outputs are the slices
    assert zero_buffers(p, n, 2, bucket, accumulating=True) == pytest.approx(
        p + p / n
    )  # a later backward's outputs beside the slices
    assert zero_buffers(p, n, 2, p / 10) == pytest.approx(3 * p / 10)  # two in flight and one filling
    assert zero_buffers(p, n, 2, p / 10, accumulating=True) == pytest.approx(3 * p / 10 * (1 + 1 / n))
    # ZeRO-3: the root and two neighbouring blocks whole (the one running, the one prefetched), and three blocks' gradient buckets
    units = [p / 10, 2 * p / 10, p / 10, 3 * p / 10, p / 10]  # the root holds the other 2/10
    gathered_blocks = 2 * p / 10 + (3 * p / 10 + p / 10)
    buckets = 3 * p / 10 + 2 * p / 10 + 2 * p / 10  # the three largest units, the root among them
    assert zero_buffers(p, n, 3, bucket, units, root=2 * p / 10) == pytest.approx(gathered_blocks + buckets)
    assert zero_buffers(p, n, 3, bucket, units, root=2 * p / 10, accumulating=True) == pytest.approx(
        gathered_blocks + buckets * (1 + 1 / n)
    )
    assert zero_buffers(p, 1, 3, bucket, units, root=2 * p / 10) == pytest.approx(
        gathered_blocks + buckets
    )  # one replica gathers copies too


# -- prediction ---------------------------------------------------------------------------


def test_exposed_allreduce_overlaps_buckets_with_backward() -> None:
    small = FIRST_BUCKET_BYTES // 2
    # two buckets: the first ready at 1 s, the second at backward's end (2 s)
    grads = [(1.0, small), (2.0, 8 * small)]
    t1, t2 = NET.allreduce.allreduce_time(2, small + 4), NET.allreduce.allreduce_time(2, 8 * small + 4)
    assert exposed_allreduce(grads, 2.0, NET, 2, 25 * (1 << 20)) == pytest.approx(t2)  # the first is hidden
    assert exposed_allreduce(grads, 2.0, NET, 2, 25 * (1 << 20), overlap=False) == pytest.approx(t1 + t2)
    assert exposed_allreduce(grads, 2.0, NET, 1, 25 * (1 << 20)) == 0.0


def test_zero2_reduce_scatters_each_bucket_as_backward_completes_it() -> None:
    grads = [(1.0, 4000), (1.5, 4000), (2.0, 4000)]  # buckets of 8000 bytes: the first two parameters, then the last
    first, second = (NET.collectives.allreduce_time(2, n) / 2 for n in (8000, 4000))
    assert exposed_reduce_scatter(grads, 2.0, NET, 2, 8000) == pytest.approx(max(1.5 + first, 2.0) + second - 2.0)
    assert exposed_reduce_scatter(grads, 2.0, NET, 2, 1 << 20) == pytest.approx(
        NET.collectives.allreduce_time(2, 12000) / 2
    )
    assert exposed_reduce_scatter(grads, 2.0, NET, 1, 8000) == 0.0


def test_data_parallel_prediction_adds_the_exposed_allreduce() -> None:
    blocks = [_block(0.01, 0.02, params=4000), _block(0.03, 0.04, params=8000)]
    profile = _profile({16: blocks, 8: blocks})
    got = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0), profile, NET, 32, ADAM)
    allreduce = NET.allreduce.allreduce_time(2, 12000 + 8)  # one bucket: both parameters and their used flags
    assert got.gradient_s == pytest.approx(allreduce)
    assert got.optimizer_s == pytest.approx(12000 * 1e-6)
    assert got.step_s == pytest.approx(0.02 + 0.10 + allreduce + 0.012)  # data(16) + compute + allreduce + optimizer
    assert got.memory.parameters == 12000 and got.memory.optimizer == 24000 and got.memory.activations == 200
    half_ring = NET.collectives.allreduce_time(2, 12000) / 2  # a reduce-scatter or an allgather
    zero1 = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 1), profile, NET, 32, ADAM)
    assert zero1.gradient_s == pytest.approx(allreduce)  # the synchronizer's allreduce as without ZeRO
    assert zero1.optimizer_s == pytest.approx(12000 * 1e-6 / 2 + half_ring)  # the step on half, then the allgather
    # AdamW's step, a scalar for each of the 2 tensors; the synchronizer's node-shared buckets bring the shared-memory reduction's areas
    assert zero1.memory.optimizer == 12000 and zero1.memory.buffers == 2 * 8 + AREAS_BYTES
    assert (
        predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 1), replace(profile, device="cuda"), NET, 32, ADAM).memory.buffers
        == 2 * 8
    )  # GPU buckets
    zero2 = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 2), profile, NET, 32, ADAM)
    assert zero2.gradient_s == pytest.approx(
        12000 * 1e-7 + half_ring
    )  # gradients added into the bucket, reduce-scattered as backward ends
    assert zero2.optimizer_s == pytest.approx(12000 * 1e-6 / 2 + half_ring)
    assert (
        zero2.memory.gradients == 6000 and zero2.memory.optimizer == 12000 and zero2.memory.buffers == 12000 + 16
    )  # the outputs are the slices


def test_zero3_gathers_each_block_before_forward_and_backward_prefetching_the_next() -> None:
    assert gathered([0.01, 0.03, 0.02], [0.5, 0.2, 0.01]) == pytest.approx(
        [0.5 + 0.2, 0.03, 0.02]
    )  # the first gather waited for
    slow = Network(
        allreduce=NET.allreduce, collectives=RingModel(2e-4, 2e-6), p2p=NET.p2p
    )  # gathers as long as the compute
    blocks = [_block(0.01, 0.02, params=4000), _block(0.03, 0.04, params=8000)]
    profile = _profile({16: blocks, 8: blocks})
    got = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 3), profile, slow, 32, ADAM)
    g0, g1 = (slow.collectives.allreduce_time(2, n) / 2 for n in (4000, 8000))  # an allgather is half a ring
    forward = g0 + max(0.01, g1) + 0.03
    backward = g1 + max(0.04, g0) + 0.02  # block 1 first, block 0's gather during its backward
    assert got.compute_s == pytest.approx(forward + backward)
    first = (
        forward + g1 + max(0.04, g0)
    )  # block 1's gradients are complete: its bucket is reduce-scattered during block 0's backward
    rs0, rs1 = (slow.collectives.allreduce_time(2, n) / 2 for n in (4000, 8000))
    end = forward + backward
    assert got.gradient_s == pytest.approx(12000 * 1e-7 + max(first + rs1, end) + rs0 - end)
    assert got.optimizer_s == pytest.approx(12000 * 1e-6 / 2)  # the step on its slice; nothing gathered after it
    assert (got.memory.parameters, got.memory.gradients, got.memory.optimizer) == (6000, 6000, 12000)
    assert got.memory.buffers == pytest.approx(
        zero_buffers(12000, 2, 3, 0, [4000, 8000]) + 16
    )  # == 12000 gathered + 12000 buckets + the steps
    assert got.step_s == pytest.approx(0.02 + end + got.gradient_s + got.optimizer_s)


def test_checkpointing_keeps_block_inputs_and_one_blocks_activations_and_adds_a_forward() -> None:
    blocks = [
        _block(0.01, 0.02, saved=1000, out=50),
        _block(0.03, 0.04, saved=3000, out=70),
        _block(0.01, 0.02, saved=2000, out=60),
    ]
    blocks = [
        replace(b, input_bytes=i, saved_input_bytes=i) for b, i in zip(blocks, (20, 50, 70))
    ]  # each block saves its input
    profile = _profile({16: blocks, 8: blocks})
    kept = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0), profile, NET, 32, ADAM)
    recomputed = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0, "blocks"), profile, NET, 32, ADAM)
    assert kept.memory.activations == 6000
    # while the second block is recomputed: the first two blocks' inputs, and what it saves beyond its input (the third's input is freed)
    assert recomputed.memory.activations == 20 + 50 + (3000 - 50)
    assert recomputed.compute_s == pytest.approx(kept.compute_s + 0.05)  # one more forward of every block
    piped = predict(
        Candidate.of(1, 3, 1, 4, "gpipe", 0, "blocks"), profile, NET, 32, ADAM
    )  # one block a stage, four micro-batches alive
    # three micro-batches keep the stage's input and output; the fourth, recomputed, holds its input, output and saved bytes
    assert piped.stage_memory[0].activations == 3 * (20 + 50) + (20 + 50 + 1000 - 20)
    assert piped.stage_memory[2].activations == 3 * 70 + (70 + 2000 - 70)


def test_a_block_checkpointing_leaves_alone_keeps_its_activations_and_is_not_recomputed() -> None:
    """A model's head is not one of its blocks (``model_blocks``): recomputing the others leaves its saved bytes and its time as they were."""
    blocks = [
        replace(_block(0.01, 0.02, saved=1000, out=50), input_bytes=20),
        replace(_block(0.03, 0.04, saved=3000, out=0), input_bytes=50, recomputed=False),
    ]
    profile = _profile({16: blocks, 8: blocks})
    kept = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0), profile, NET, 32, ADAM)
    recomputed = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 0, "blocks"), profile, NET, 32, ADAM)
    assert recomputed.memory.activations == 20 + 3000  # the head's saved bytes are there when the forward ends
    assert recomputed.compute_s == pytest.approx(kept.compute_s + 0.01)  # only the first block's forward again


def test_pipeline_prediction_is_the_schedule_simulated() -> None:
    blocks = [_block(0.01, 0.02, out=1000)] * 4
    profile = _profile({8: blocks, 4: blocks})
    for schedule in schedules.SCHEDULES:
        got = predict(Candidate.of(1, 2, 1, 4, schedule, 0), profile, NET, 32, ADAM)
        transfer = NET.p2p.send_time(1000)
        expected = schedules.simulate(schedules.build(schedule, 2, 4), [0.02, 0.02], [0.04, 0.04], transfer)
        assert got.compute_s == pytest.approx(expected.makespan)
        assert got.bubble == pytest.approx(expected.idle_fraction(0))
        assert got.split == ["b2"]  # equal blocks: two per stage
        live = max(schedules.peak_live(a) for a in schedules.build(schedule, 2, 4))
        assert got.memory.activations == pytest.approx(
            live * (200 + 1000)
        )  # two blocks' saved bytes + the stage output kept
    gpipe = predict(Candidate.of(1, 2, 1, 4, "gpipe", 0), profile, NET, 32, ADAM)
    ofob = predict(Candidate.of(1, 2, 1, 4, "1f1b", 0), profile, NET, 32, ADAM)
    assert gpipe.memory.activations > ofob.memory.activations


def test_tensor_parallel_prediction_adds_its_allreduces_without_running() -> None:
    dense = [_block(0.01, 0.02, params=4000)]
    split = [_block(0.006, 0.012, params=2000, tp=(5000, 5000))]
    profile = _profile({16: dense}, tp={16: split})
    got = predict(Candidate.of(1, 1, 2, 1, NO_SCHEDULE, 0), profile, NET, 16, ADAM)
    tp = 2 * 2 * NET.collectives.allreduce_time(2, 5000)  # two allreduces forward, two backward
    assert got.compute_s == pytest.approx(0.018 + tp)
    assert got.memory.parameters == 2000 and got.gradient_s == 0.0


def test_profile_interpolates_sizes_and_estimates_degrees() -> None:
    profile = _profile(
        {4: [_block(0.01, 0.02, saved=400)], 8: [_block(0.02, 0.03, saved=800)]},
        tp={4: [_block(0.006, 0.012, params=600, saved=300)], 8: [_block(0.012, 0.018, params=600, saved=600)]},
    )
    mid = profile.blocks(1, 6)[0]
    assert (mid.forward_s, mid.backward_s, mid.saved_bytes) == (pytest.approx(0.015), pytest.approx(0.025), 600)
    beyond = profile.blocks(1, 16)[0]
    assert beyond.forward_s == pytest.approx(0.04) and beyond.saved_bytes == 1600
    # q(t) = q_rep + q_split / t through t = 1 and 2: forward 0.01 = r + s, 0.006 = r + s / 2 -> r = 0.002, s = 0.008
    four = profile.blocks(4, 4)[0]
    assert four.forward_s == pytest.approx(0.004) and four.parameter_bytes == (400,)
    assert profile.supports(4) and profile.data_time(12) == pytest.approx(0.015)


def test_fit_link_recovers_alpha_and_beta() -> None:
    link = LinkModel(2e-5, 3e-10)
    fitted = fit_link([1e3, 1e5, 1e6], [link.send_time(s) for s in (1e3, 1e5, 1e6)])
    assert fitted.alpha == pytest.approx(2e-5) and fitted.beta == pytest.approx(3e-10)
    net = Network.from_ring(RingModel(5e-6, 1e-9))
    assert net.p2p.send_time(1e6) == pytest.approx(5e-6 + 1e-3) and net.collectives is net.allreduce


# -- rd.plan_parallel without a cluster -----------------------------------------------------


def test_sixty_four_ranks_predicted_from_a_given_profile_and_network_start_nothing() -> None:
    blocks = [_block(0.002, 0.004, params=40_000, out=4096)] * 4
    profile = _profile({1: blocks, 16: blocks}, tp={1: blocks, 16: blocks})
    plan = rd.plan_parallel(
        models.tiny_lm, datasets.synthetic_tokens, ADAM, ranks=64, network=RingModel(5e-6, 1 / 12.5e9), profile=profile
    )
    assert current() is None  # no cluster started
    table = plan.table
    assert (
        len(table) > 100 and (table["data_parallel"] * table["pipeline_stages"] * table["tensor_parallel"] == 64).all()
    )
    assert table["measured_step_s"].isna().all() and plan.validated is None
    assert list(table["predicted_step_s"]) == sorted(table["predicted_step_s"])
    assert plan.best is not None and plan.best.workers == 64 and plan.best_layout == table["layout"].iloc[0]
    assert {trace.name for trace in plan.figure.data} >= {"predicted"}


def test_sixty_four_ranks_measured_in_this_process_start_no_cluster() -> None:
    plan = rd.plan_parallel(
        models.mlp, datasets.synthetic_features, rd.TrainConfig(batch_size=2), ranks=64, network=RingModel(5e-6, 1e-9)
    )
    assert current() is None and plan.profile.source == "this process"
    assert plan.profile.names == [
        "0",
        "1",
        "2",
        "3",
        "4",
        "5",
    ]  # Flatten, Linear, ReLU, Linear, ReLU, Linear: an nn.Sequential's items
    assert (
        plan.table["data_parallel"] * plan.table["pipeline_stages"] * plan.table["tensor_parallel"] == 64
    ).all() and plan.table["fits"].all()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ranks": 0}, "ranks=0 is invalid: an integer >= 1"),
        ({"ranks": 2.5}, "ranks=2.5 is invalid"),
        ({"memory_per_rank": -1}, "memory_per_rank=-1 is invalid"),
        ({"network": "fast"}, "network='fast' is invalid"),
        ({"run_top": -1}, "run_top=-1 is invalid"),
        ({"steps": 2}, "steps=2 is invalid: an integer >= 3"),
        ({"profile": {}}, "profile={} is invalid"),
    ],
)
def test_bad_arguments_are_refused_before_anything_starts(kwargs: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")):
        rd.plan_parallel(models.tiny_lm, datasets.synthetic_tokens, ADAM, **kwargs)
    assert current() is None


def test_memory_too_small_for_every_layout_names_the_smallest_need() -> None:
    # on 2 ranks the least model state any layout needs is half the parameters with Adam unsharded: 16 psi / 2
    # (pp2 or tp2; dp2 with ZeRO-2 needs 4 psi + 12 psi / 2 = 10 psi)
    psi = sum(p.numel() for p in models.tiny_lm().parameters())
    need = f"{8 * psi / 2**20:.3g}"
    with pytest.raises(
        ConfigError,
        match=rf"too small for every layout of ranks=2: the smallest needs at least {need} MiB per rank \(dp1 pp1 tp2",
    ):
        rd.plan_parallel(models.tiny_lm, datasets.synthetic_tokens, ADAM, ranks=2, memory_per_rank=1e5)
    assert current() is None


def test_memory_checked_again_once_activations_are_known() -> None:
    blocks = [_block(0.002, 0.004, params=40_000, saved=10_000_000)] * 4
    profile = _profile({1: blocks, 16: blocks}, tp={1: blocks, 16: blocks})
    network = RingModel(5e-6, 1e-9)
    free = rd.plan_parallel(models.tiny_lm, datasets.synthetic_tokens, ADAM, ranks=64, network=network, profile=profile)
    smallest = free.table["peak_mib"].min()
    with pytest.raises(ConfigError, match=rf"the smallest peak is {smallest:.3g} MiB per rank \(dp\d+ pp\d tp\d"):
        rd.plan_parallel(
            models.tiny_lm,
            datasets.synthetic_tokens,
            ADAM,
            ranks=64,
            network=network,
            profile=profile,
            memory_per_rank=0.99 * smallest * 2**20,
        )
    fitted = rd.plan_parallel(
        models.tiny_lm,
        datasets.synthetic_tokens,
        ADAM,
        ranks=64,
        network=network,
        profile=profile,
        memory_per_rank=1.01 * smallest * 2**20,
    )
    assert fitted.table["fits"].sum() >= 1 and not fitted.table["fits"].all()
    assert list(fitted.table["fits"]) == sorted(fitted.table["fits"], reverse=True)  # those that fit first
    assert fitted.table[fitted.table["fits"]]["peak_mib"].max() <= 1.01 * smallest


def test_a_receive_that_waited_is_noticed_late_as_measured() -> None:
    link = LinkModel(1e-5, 1e-10, waits=((1e-3, 2e-4), (4e-3, 5e-4)))
    assert link.delay_after(0.0) == 0.0 and link.delay_after(5e-4) == pytest.approx(1e-4)
    assert link.delay_after(2.5e-3) == pytest.approx(3.5e-4) and link.delay_after(1.0) == pytest.approx(5e-4)
    # in the schedule: stage 1 waits for every activation of a 2-stage GPipe, so each of its receives is late
    plan = schedules.build("gpipe", 2, 2)
    plain = schedules.simulate(plan, 0.01, 0.02)
    late = schedules.simulate(plan, 0.01, 0.02, receive_delay=lambda wait: 0.001)
    assert late.makespan > plain.makespan
    waited = [s for a, s, e in late.spans[1] if a.kind == "recv_activation" and e > s]
    assert waited and all(e - s >= 0.001 for a, s, e in late.spans[1] if a.kind == "recv_activation" and e > s)


# -- the profiler measures through the run's objective ---------------------------------------


class _OwnLoss(torch.nn.Module):
    """nanoGPT's contract: ``forward(inputs, targets=None) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 4)

    def forward(
        self, inputs: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.layer(inputs)
        return logits, (torch.nn.functional.cross_entropy(logits, targets) if targets is not None else None)


def own_loss_model() -> torch.nn.Module:
    return _OwnLoss()


def own_loss_data() -> tuple[torch.utils.data.TensorDataset, torch.utils.data.TensorDataset]:
    generator = torch.Generator().manual_seed(0)
    inputs, targets = torch.randn(64, 16, generator=generator), torch.randint(0, 4, (64,), generator=generator)
    return torch.utils.data.TensorDataset(inputs, targets), torch.utils.data.TensorDataset(inputs[:16], targets[:16])


def test_a_model_returning_logits_and_loss_is_planned_as_rd_train_trains_it() -> None:
    plan = rd.plan_parallel(
        own_loss_model, own_loss_data, rd.TrainConfig(batch_size=8), ranks=2, network=RingModel(5e-6, 1e-9)
    )
    assert current() is None and plan.profile.names == ["model"]
    costs = plan.profile.blocks(1, 8)
    assert costs[0].forward_s > 0 and costs[0].backward_s > 0 and plan.best is not None


def test_the_profiler_scores_with_the_runs_loss_fn() -> None:
    from rapydli.experiments.planning.profile import profile_model

    calls = []

    def loss_fn(outputs: dict[str, torch.Tensor], targets: torch.Tensor) -> torch.Tensor:
        calls.append(outputs["scores"].shape)
        return torch.nn.functional.mse_loss(outputs["scores"].sum(-1), targets)

    class Scores(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(16, 4)

        def forward(self, inputs: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"scores": self.layer(inputs)}  # neither logits nor a loss: only loss_fn can train it

    sample = (torch.randn(8, 16), torch.randn(8))
    profile = profile_model(Scores, sample, [4, 8], repeats=1, loss_fn=loss_fn)
    assert profile.names == ["model"] and calls and {tuple(c) for c in calls} >= {(4, 4), (8, 4)}


def test_the_planner_reads_a_gpt2_with_tied_weights_and_its_tensor_plan() -> None:
    """HF GPT-2's shapes: tp layouts come from the config's tensor_plan, the tied weight counts once, zero=2 across stages is left out."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import train_cases
    from hf_models import gpt2

    from rapydli.experiments.planning.profiling import tensor_plan

    plan_text = {
        "transformer.h.*.attn": "heads",
        "transformer.h.*.mlp.c_fc": "column",
        "transformer.h.*.mlp.c_proj": "row",
    }
    config = rd.TrainConfig(batch_size=4, tensor_plan=plan_text)
    assert tensor_plan(config) == plan_text  # the config keeps it as JSON text; the planner reads it
    plan = rd.plan_parallel(gpt2, train_cases.tokens, config, ranks=4, network=RingModel(5e-6, 1e-9))
    table = plan.table
    assert {1, 2, 4} <= set(table["tensor_parallel"]) and not plan.profile.unsupported
    parameters = sum(p.numel() * p.element_size() for p in gpt2().parameters())  # the tied weight once
    dense = table[(table["tensor_parallel"] == 1) & (table["pipeline_stages"] == 1)]
    held = parameters / dense["data_parallel"].where(dense["zero"] == 3, 1)  # ZeRO-3 keeps 1/dp of them
    assert (abs(dense["params_mib"] * 2**20 - held) < 1).all(), (dense["params_mib"] * 2**20, parameters)
    assert table[(table["pipeline_stages"] > 1) & (table["zero"] == 2)].empty
    assert any(
        "transformer.wte.weight (also lm_head.weight) is shared by pipeline stages 0, 1" in note for note in plan.notes
    ), plan.notes


def test_a_tight_memory_per_rank_keeps_only_zero3_and_checkpointing_layouts() -> None:
    blocks = [_block(0.002, 0.004, params=1_000_000, saved=4_000_000, out=1000)] * 8
    profile = _profile({1: blocks, 8: blocks, 16: blocks})
    network = RingModel(5e-6, 1e-9)
    free = rd.plan_parallel(models.tiny_lm, datasets.synthetic_tokens, ADAM, ranks=4, network=network, profile=profile)
    table = free.table
    assert set(table["zero"]) == {0, 1, 2, 3} and set(table["checkpointing"].fillna("-")) == {"-", "blocks"}
    plain = table[(table["zero"] < 3) & table["checkpointing"].isna()]
    limit = 0.99 * plain["peak_mib"].min() * 2**20
    tight = rd.plan_parallel(
        models.tiny_lm,
        datasets.synthetic_tokens,
        ADAM.replace(memory_per_rank=limit),
        ranks=4,
        network=network,
        profile=profile,
    )
    fits = tight.table[tight.table["fits"]]
    assert len(fits) > 0 and ((fits["zero"] == 3) | (fits["checkpointing"] == "blocks")).all()
    assert (fits["zero"] == 3).any() and (fits["checkpointing"] == "blocks").any()
    assert tight.best.zero == 3 or tight.best.activation_checkpointing == "blocks"
    assert tight.best_layout == fits["layout"].iloc[0]
    same = rd.plan_parallel(
        models.tiny_lm,
        datasets.synthetic_tokens,
        ADAM,
        ranks=4,
        network=network,
        profile=profile,
        memory_per_rank=f"{limit}B",
    )
    assert list(same.table["fits"]) == list(tight.table["fits"])  # the argument, with a unit, as the config's field


def test_every_layout_the_planner_fits_is_one_rd_train_lets_through() -> None:
    from rapydli.experiments.planning.fit import check_fits

    config = rd.TrainConfig(batch_size=2)
    blocks = [(name, sum(4 * p.numel() for p in block.parameters())) for name, block in models.mlp().named_children()]
    costs = [_block(0.001, 0.002, params=nbytes, saved=20_000) for _, nbytes in blocks]
    profile = Profile([name for name, _ in blocks], {(1, size): costs for size in (1, 2, 8)}, optimizer_s_per_byte=1e-9)
    free = rd.plan_parallel(
        models.mlp, datasets.synthetic_features, config, ranks=4, network=RingModel(5e-6, 1e-9), profile=profile
    )
    limit = float(free.table["peak_mib"].median() * 2**20)
    plan = rd.plan_parallel(
        models.mlp,
        datasets.synthetic_features,
        config,
        ranks=4,
        network=RingModel(5e-6, 1e-9),
        profile=profile,
        memory_per_rank=limit,
    )
    assert 0 < plan.table["fits"].sum() < len(plan.table)
    checked = (
        set()
    )  # the model states do not depend on micro-batches, schedule or checkpointing: each grid, split and stage once
    for prediction, fits in zip(plan.predictions, plan.table["fits"]):
        layout = prediction.layout
        key = (
            layout.data_parallel,
            layout.pipeline_stages,
            layout.tensor_parallel,
            layout.zero,
            tuple(prediction.split),
        )
        if fits and key not in checked:
            checked.add(key)
            chosen = layout.config(config.replace(memory_per_rank=limit), plan.global_batch, prediction.split)
            assert check_fits(models.mlp, chosen, 4) is not None, layout.label
    assert plan.best.memory_per_rank == limit and check_fits(models.mlp, plan.best, 4) is not None


def test_a_miss_on_a_busy_machine_or_on_unsteady_steps_earns_no_verdict() -> None:
    from rapydli.experiments.planning.planner import verdict
    from rapydli.spread import Spread

    steady, quiet, busy = Spread(0.05, 0.049, 0.051, 10), {"load_1m": 1.5, "cores": 2.0}, {"load_1m": 3.2, "cores": 2.0}
    assert verdict([], {}, quiet) == (None, [])
    assert verdict([0.05, -0.1], {"dp2": steady}, busy) == (True, [])  # within 20 %: validated, however busy
    assert verdict([-0.4], {"dp2": steady}, quiet) == (False, [])  # a steady miss on a quiet machine: the model missed
    validated, notes = verdict([-0.4], {"dp2": steady}, busy)  # the same miss beside other work: no verdict
    assert (
        validated is False
        and len(notes) == 1
        and notes[0].startswith("not validated: the machine was busy (load 3.2 on 2 cores)")
    )
    validated, notes = verdict([-0.1], {"dp2": Spread(0.05, 0.03, 0.06, 10)}, quiet)  # steps varied 60 %
    assert validated is False and notes[0].startswith(
        "not validated: dp2's step times varied 60% (interquartile, 10 steps; load 1.5"
    )


def test_an_offloaded_optimizer_is_a_layout_choice_on_gpu_ranks_its_state_on_the_host_its_step_and_copies_timed_there() -> (
    None
):
    blocks = [_block(0.01, 0.02, params=4000), _block(0.03, 0.04, params=8000)]
    on_cpu = _profile({16: blocks, 8: blocks})
    on_gpu = replace(
        on_cpu, device="cuda", host_optimizer_s_per_byte=5e-6, host_copy_s_per_byte=2e-7
    )  # a GPU's profile (none here)
    labels = {c.label for c in enumerate_layouts(2, 32, blocks=2, offload=(False, True))}
    assert (
        "dp2 pp1 tp1 m1 zero2 offload" in labels and "dp2 pp1 tp1 m1 zero0 offload" not in labels
    )  # offloading needs a sharded optimizer
    offload = Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 2, offload=True)
    assert (
        offload.config(ADAM, 32).offload_optimizer
        and not Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 2).config(ADAM, 32).offload_optimizer
    )
    kept = predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 2), on_gpu, NET, 32, ADAM)
    moved = predict(offload, on_gpu, NET, 32, ADAM)
    half_ring = NET.collectives.allreduce_time(2, 12000) / 2
    assert moved.optimizer_s == pytest.approx(
        (5e-6 + 2 * 2e-7) * 12000 / 2 + half_ring
    )  # the step on the host, the slices down and up
    assert moved.memory.optimizer == 0 and moved.memory.host == pytest.approx(
        kept.memory.optimizer + 12000 / 2
    )  # the state and the slices' copies
    assert moved.memory.peak == pytest.approx(kept.memory.peak - kept.memory.optimizer)
    same, cpu = (
        predict(Candidate.of(2, 1, 1, 1, NO_SCHEDULE, 2), on_cpu, NET, 32, ADAM),
        predict(offload, on_cpu, NET, 32, ADAM),
    )
    assert (cpu.step_s, cpu.memory) == (
        same.step_s,
        same.memory,
    )  # on CPU ranks the optimizer is in host memory already: nothing changes


def test_the_profile_times_an_offloaded_step_and_the_copies_beside_the_parameters() -> None:
    from rapydli.experiments.planning.profile import offload_times

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    step, copy = offload_times(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), repeats=3)
    assert (
        step > 0 and copy > 0
    )  # on this CPU both sides are host memory: the figures a GPU's profile would give, measured the same way
    assert offload_times(model, None, repeats=1)[0] == 0.0


def test_the_profiler_times_the_runs_own_optimizer() -> None:
    """The planner profiles what the run trains: the user's optimizer_fn (it timed config.optimizer's step instead)."""
    from rapydli.experiments.planning.profiling import local_profile, optimizer_factory
    from rapydli.experiments.spec import RunSpec

    built = []

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        built.append(model)
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5, nesterov=True)

    model = models.mlp()
    made = optimizer_factory(model, rd.TrainConfig(optimizer="adamw"), sgd)([torch.nn.Parameter(torch.zeros(3))])
    assert isinstance(made, torch.optim.SGD) and made.defaults["momentum"] == 0.5 and made.defaults["nesterov"]
    assert isinstance(
        optimizer_factory(model, rd.TrainConfig(optimizer="adamw"), None)([torch.nn.Parameter(torch.zeros(3))]),
        torch.optim.AdamW,
    )
    built.clear()
    config = rd.TrainConfig(batch_size=8, optimizer="adamw", max_steps=2, epochs=1, eval_every=0, workers=1)
    profile = local_profile(
        RunSpec.of(models.mlp, datasets.digits, optimizer_fn=sgd, metrics=["accuracy"]), None, config, [8], [1], []
    )
    assert built and profile.optimizer_s_per_byte > 0  # the run's SGD was built on the model and its step timed
