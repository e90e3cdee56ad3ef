"""``rd.plan_parallel`` on 2 real engines: measured once, the fastest layouts and a pipeline and a tensor-parallel one trained, one picked."""

from __future__ import annotations

import math

import pytest

import rapydli as rd
from rapydli.experiments.planning.planner import TOLERANCE
from rapydli.zoo import datasets, models

PIPELINE = "dp1 pp2 tp1 m2 1f1b zero0"
TENSOR = "dp1 pp1 tp2 m1 zero0"


@pytest.mark.engines
def test_plan_on_two_engines_runs_the_fastest_and_picks_one() -> None:
    import subprocess
    import sys

    before = len(rd.runs(kind="train"))
    hog = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"]
    )  # a busy machine: the verdict must say when it cannot tell
    try:
        with rd.Cluster(n=2) as cluster:
            plan = rd.plan_parallel(
                models.tiny_lm,
                datasets.synthetic_tokens,
                rd.TrainConfig(batch_size=8),
                ranks=2,
                run_top=2,
                steps=8,
                cluster=cluster,
                run_layouts=[PIPELINE, TENSOR],
            )
    finally:
        hog.kill()
        hog.wait()
    table = plan.table
    assert plan.profile.source == "2 engines" and plan.profile.names == ["embed", "blocks.0", "blocks.1", "head"]
    assert (
        plan.network.allreduce.allreduce_time(2, 1 << 20) > 0 and plan.network.p2p.send_time(1 << 20) > 0
    )  # fitted (alpha may fit 0 on a busy machine)
    ran = table[table["measured_step_s"].notna()]
    fastest = list(table[table["fits"]]["layout"].iloc[:2])
    assert sorted(ran["layout"]) == sorted({*fastest, PIPELINE, TENSOR})  # the 2 fastest predicted, and those asked for
    assert all(math.isfinite(e) for e in ran["error"]) and (ran["measured_step_s"] > 0).all()
    assert (
        (ran["measured_low_s"] <= ran["measured_step_s"]) & (ran["measured_step_s"] <= ran["measured_high_s"])
    ).all()
    widths = (ran["measured_high_s"] - ran["measured_low_s"]) / ran["measured_step_s"]
    # reported either way, no timing asserted; too unsteady to check to TOLERANCE: not validated, and why
    assert plan.validated == bool((ran["error"].abs() <= TOLERANCE).all() and (widths <= TOLERANCE).all())
    noisy = [note for note in plan.notes if note.startswith("not validated") and "step times varied" in note]
    assert len(noisy) == int((widths > TOLERANCE).sum()) and all("cores" in note for note in noisy)
    # steady steps that missed beside the hog: not the model's fault, and the note says so with the load
    busy = [note for note in plan.notes if note.startswith("not validated: the machine was busy")]
    assert len(busy) <= 1 and all("cores" in note and "repeat on a quieter machine" in note for note in busy)
    assert not busy or (plan.validated is False and not noisy)
    best = ran.loc[ran["measured_step_s"].idxmin()]
    assert plan.best_layout == best["layout"] and plan.best is not None and plan.best.workers == 2
    assert (plan.best.pipeline_stages, plan.best.tensor_parallel, plan.best.zero) == (
        best["pipeline_stages"],
        best["tensor_parallel"],
        best["zero"],
    )
    piped = table[table["layout"] == PIPELINE].iloc[0]
    assert piped["split"] in ("blocks.0", "blocks.1", "head") and piped["bubble"] > 0
    runs = rd.runs(kind="train").iloc[: len(rd.runs(kind="train")) - before]
    assert (
        sorted(runs["name"]) == sorted(f"plan {label}" for label in ran["layout"])
        and (runs["status"] == "finished").all()
    )
    assert {trace.name for trace in plan.figure.data} >= {"predicted", "measured", "predicted = measured"}


@pytest.mark.engines
def test_the_models_people_bring_are_planned_from_two_engines_and_run() -> None:
    """GPT-2 as Hugging Face writes it (Conv1D, fused QKV, tied embedding, labels), BERT (an unused pooler) and a ResNet
    (BatchNorm in every block): each measured on the engines, planned, and its fastest layout and a pipeline trained."""
    import functools
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hf_models import bert, gpt2, lm_loss
    from recompute_models import images, resnet

    tokens = functools.partial(datasets.synthetic_tokens, num_samples=80, block_size=8, vocab_size=32)
    whole_batch = "dp1 pp2 tp1 m1 1f1b zero0"  # BatchNorm normalises the replica's batch: a pipeline of one micro-batch
    cases = {
        "gpt2": (gpt2, tokens, lm_loss, PIPELINE),
        "bert": (bert, tokens, lm_loss, PIPELINE),
        "resnet": (resnet, images, None, whole_batch),
    }
    network = None
    with rd.Cluster(n=2) as cluster:
        for name, (model_fn, data_fn, loss_fn, piped) in cases.items():
            plan = rd.plan_parallel(
                model_fn,
                data_fn,
                rd.TrainConfig(batch_size=8),
                ranks=2,
                run_top=1,
                steps=4,
                cluster=cluster,
                loss_fn=loss_fn,
                network=network,
                run_layouts=[piped],
            )
            network = plan.network  # measured once, for the three
            assert plan.profile.source == "2 engines", name
            if name == "resnet":  # convolutions have no tensor plan: tp layouts are left out, saying why
                assert "no built-in tensor plan for TinyResNet" in plan.profile.unsupported[2] and set(
                    plan.table["tensor_parallel"]
                ) == {1}
            else:
                assert not plan.profile.unsupported, (name, plan.profile.unsupported)
            ran = plan.table[plan.table["measured_step_s"].notna()]
            assert piped in set(ran["layout"]) and (ran["measured_step_s"] > 0).all(), (name, plan.table)
            assert plan.best is not None and plan.best_layout in set(ran["layout"]), name
            if name == "gpt2":  # a tensor-parallel layout is planned from the model's own structure (no plan written)
                assert 2 in set(plan.table["tensor_parallel"]), plan.table
