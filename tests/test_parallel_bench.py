"""``rapydli bench pipeline``, ``parallel --zero 3`` and ``parallel --peers``: their summaries, and parts on real ranks (bytes and losses, not timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from rapydli.bench.pipeline import command, summarize


def test_summary_ratios_and_targets_from_rows() -> None:
    rows = [
        {
            "part": "bubble",
            "schedule": "1f1b",
            "stages": 2,
            "microbatches": 4,
            "bubble_measured": 0.21,
            "bubble_theory": 0.2,
            "relative_error": 0.05,
        },
        {
            "part": "bubble",
            "schedule": "1f1b",
            "stages": 2,
            "microbatches": 8,
            "bubble_measured": 0.15,
            "bubble_theory": 1 / 9,
            "relative_error": 0.35,
        },
        {
            "part": "bubble",
            "schedule": "gpipe",
            "stages": 2,
            "microbatches": 1,
            "bubble_measured": 0.5,
            "bubble_theory": 0.5,
            "relative_error": 0.0,
        },
        {"part": "throughput", "variant": "rapydli", "step_ms": 10.0, "torch": "2.13.0+cpu"},
        {"part": "throughput", "variant": "torch", "step_ms": 12.0, "torch": "2.13.0+cpu"},
        {"part": "throughput", "variant": "torch", "timed_out": True},
    ]
    summary = summarize(rows)
    assert summary["bubble 1f1b p=2 m=4: target within 10%"] == "met"
    assert summary["bubble 1f1b p=2 m=8: target within 10%"] == "not met"
    assert "bubble gpipe p=2 m=1: target within 10%" not in summary  # the target is for m >= 4
    assert summary["throughput 1f1b: torch step / rapydli step"] == pytest.approx(1.2)
    assert summary["throughput target rapydli >= 1.0x torch"] == "met"
    assert summary["torch.distributed.pipelining launches that timed out"] == 1
    assert summary["throughput peer: torch.distributed.pipelining of torch"] == "2.13.0+cpu (checked against 2.13: yes)"


@pytest.mark.mpi
def test_memory_part_gpipe_grows_with_m_1f1b_with_p(tmp_path: Path) -> None:
    """Bytes on real ranks (2 and 4; 4 ranks on 2 cores are fine for bytes), against the theory."""
    out = tmp_path / "pipeline.json"
    result = CliRunner().invoke(command, ["--parts", "memory", "--json", str(out)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    summary = payload["summary"]
    for p in (2, 4):
        for m in (2, 4, 8):
            for rank in range(p):
                measured = summary[f"memory p={p} m={m} rank {rank}: gpipe / 1f1b"]
                theory = summary[f"memory p={p} m={m} rank {rank}: theory (live micro-batches)"]
                assert measured == pytest.approx(theory, rel=0.1), (p, m, rank)
            for schedule in ("gpipe", "1f1b"):  # live micro-batches x one micro-batch's bytes on the stage
                ratios = [
                    float(v) for v in summary[f"memory p={p} m={m} {schedule}: measured / theory, per rank"].split(", ")
                ]
                assert len(ratios) == p and all(r == pytest.approx(1.0, abs=0.1) for r in ratios), (
                    p,
                    m,
                    schedule,
                    ratios,
                )
    assert summary["memory m=8: 1f1b rank 0 live micro-batches by p"] == "p=2: 2, p=4: 4"  # 1F1B grows with p
    assert summary["memory p=2 m=8 rank 1: 1f1b / data parallel"] < 0.2  # one micro-batch of half the model
    rows = [
        row for row in payload["rows"] if row["variant"] == "1f1b" and row["rank"] == 0 and row["microbatches"] == 8
    ]
    assert sorted(row["ranks"] for row in rows) == [2, 4]


def test_memory_ranks_are_checked_before_anything_starts() -> None:
    result = CliRunner().invoke(command, ["--parts", "memory", "--memory-ranks", "2,3"])
    assert result.exit_code != 0 and "integers >= 2 that divide the batch" in result.output


# -- rapydli bench parallel --zero 3: ZeRO-3 against PyTorch's FSDP2 ------------------------------


def _zero3_row(
    impl: str, checkpointing: bool, round_: int, step_ms: float, peak_mib: float, losses: list[float]
) -> dict:
    return {
        "part": "zero3",
        "impl": impl,
        "ranks": 2,
        "checkpointing": checkpointing,
        "round": round_,
        "step_ms": step_ms,
        "peak_mib": peak_mib,
        "activation_mib": 4.0 if checkpointing else 20.0,
        "losses": losses,
        "load_1m": 1.0,
        "other_cores": 0.0,
    }


def test_zero3_summary_pairs_rounds_and_says_when_the_rounds_disagree() -> None:
    from rapydli.bench.parallel import zero3_summary

    same, other = [5.0, 4.9], [5.0, 4.8]
    rows = [
        _zero3_row("rapydli", False, 0, 90.0, 100.0, same), _zero3_row("fsdp2", False, 0, 100.0, 120.0, same),
        _zero3_row("rapydli", False, 1, 120.0, 100.0, same), _zero3_row("fsdp2", False, 1, 100.0, 120.0, same),
        _zero3_row("rapydli", True, 0, 120.0, 80.0, same), _zero3_row("fsdp2", True, 0, 130.0, 90.0, other),
        _zero3_row("rapydli", True, 1, 150.0, 80.0, same), _zero3_row("fsdp2", True, 1, 160.0, 90.0, other),
    ]  # fmt: skip
    summary = zero3_summary(rows)
    assert summary["zero3 2 ranks: step time rapydli / FSDP2"] == pytest.approx(1.05)  # the median of 0.9 and 1.2
    assert summary["zero3 2 ranks: target step time rapydli <= FSDP2"].startswith("too noisy to tell")
    assert summary["zero3 2 ranks: peak memory per rank rapydli / FSDP2"] == pytest.approx(100 / 120)
    assert summary["zero3 2 ranks: target peak memory per rank rapydli <= FSDP2"] == "met"
    assert summary["zero3 2 ranks, checkpointing: target step time rapydli <= FSDP2"] == "met"
    assert summary[
        "zero3 2 ranks, rapydli: activation checkpointing step time overhead (with / without - 1)"
    ].startswith("+29.2%")  # 1.33, 1.25
    assert summary[
        "zero3 2 ranks, rapydli: activation checkpointing saving in activations (without / with)"
    ].startswith("5x")
    assert summary["zero3 2 ranks: losses rapydli vs FSDP2, the same 2 steps"].startswith(
        "DIFFERENT"
    )  # checkpointed FSDP2's second loss


@pytest.mark.mpi
def test_zero3_part_runs_both_sides_and_they_compute_the_same_losses(tmp_path: Path) -> None:
    """The tiny size on 2 real ranks, one round: every variant ran, both shard per block, and the losses agree (no timing is checked)."""
    from rapydli.bench.parallel import command as parallel_command
    from rapydli.bench.zero3_worker import SIZES

    out = tmp_path / "zero3.json"
    args = ["--zero", "3", "--size", "tiny", "--ranks", "2", "--rounds", "1", "--steps", "3", "--json", str(out)]
    result = CliRunner().invoke(parallel_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    rows, summary = payload["rows"], payload["summary"]
    assert sorted((r["impl"], r["checkpointing"]) for r in rows) == [
        ("fsdp2", False),
        ("fsdp2", True),
        ("rapydli", False),
        ("rapydli", True),
    ]
    units = SIZES["tiny"].n_layer + 1  # a unit per block and the root, on both sides
    for row in rows:
        assert row["ranks"] == 2 and row["units"] == units and len(row["peak_mib_per_rank"]) == 2
        assert len(row["losses"]) == 3 and row["step_ms"] > 0 and row["peak_mib"] > 0 and row["activation_mib"] > 0
    by = {(r["impl"], r["checkpointing"]): r for r in rows}
    for checkpointing in (False, True):  # the same model, seed, batches and AdamW: the same losses, step by step
        assert by["rapydli", checkpointing]["losses"] == pytest.approx(by["fsdp2", checkpointing]["losses"], rel=1e-5)
        assert by["rapydli", checkpointing]["activation_mib"] == pytest.approx(
            by["fsdp2", checkpointing]["activation_mib"], rel=0.05
        )
    for impl in ("rapydli", "fsdp2"):  # checkpointing every block keeps less for backward
        assert by[impl, True]["activation_mib"] < by[impl, False]["activation_mib"] / 2
    assert summary["zero3 2 ranks: losses rapydli vs FSDP2, the same 3 steps"].startswith("equal")
    for key in (
        "zero3 2 ranks: target step time rapydli <= FSDP2",
        "zero3 2 ranks: target peak memory per rank rapydli <= FSDP2",
        "zero3 2 ranks, checkpointing: step time rapydli / FSDP2, range",
        "zero3 load: cores other processes used during each launch",
        "zero3 2 ranks, FSDP2: activation checkpointing saving in activations (without / with)",
        "zero3 model",
    ):
        assert key in summary, key
    assert "FSDP2 (fully_shard) of torch" in summary["zero3 training"]


def test_zero3_ranks_must_divide_the_global_batch() -> None:
    from rapydli.bench.parallel import command as parallel_command

    result = CliRunner().invoke(parallel_command, ["--zero", "3", "--size", "tiny", "--ranks", "2,3"])
    assert result.exit_code != 0 and "must divide by each" in result.output


# -- rapydli bench parallel --peers: tensor parallelism and the pipeline against PyTorch's own ------------------------------


@pytest.mark.mpi
def test_peers_part_runs_both_sides_of_every_model_and_layout_and_they_compute_the_same_losses(tmp_path: Path) -> None:
    """The tiny size on 2 real ranks, one round: each (model, layout) ran on both sides and the losses agree (no timing is checked)."""
    from rapydli.bench.parallel import command as parallel_command

    out = tmp_path / "peers.json"
    args = ["--peers", "--size", "tiny", "--rounds", "1", "--steps", "3", "--json", str(out)]
    result = CliRunner().invoke(parallel_command, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    payload = json.loads(out.read_text())
    rows, summary = payload["rows"], payload["summary"]
    pairs = [(model, layout) for model in ("gpt2", "llama") for layout in ("tp2", "pp2")]
    assert sorted((r["model"], r["layout"], r["impl"]) for r in rows) == sorted(
        (*pair, impl) for pair in pairs for impl in ("rapydli", "torch")
    )
    by = {(r["model"], r["layout"], r["impl"]): r for r in rows}
    for model, layout in pairs:
        ours, theirs = by[model, layout, "rapydli"], by[model, layout, "torch"]
        assert len(ours["losses"]) == len(theirs["losses"]) == 3 and len(ours["step_ms_per_rank"]) == 2
        compared = (
            3 if layout == "tp2" else 1
        )  # torch's pipeline trains GPT-2's tied embedding as two copies: the first step only
        assert ours["losses"][:compared] == pytest.approx(theirs["losses"][:compared], rel=1e-5), (model, layout)
        what = "the same 3 steps" if layout == "tp2" else "the first step"
        assert summary[f"peers {model} {layout}: losses rapydli vs torch, {what}"].startswith("equal"), (model, layout)
        assert f"peers {model} {layout}: target rapydli at least as fast (torch / rapydli >= 1)" in summary
    assert by["llama", "pp2", "rapydli"]["losses"] == pytest.approx(
        by["llama", "pp2", "torch"]["losses"], rel=1e-5
    )  # nothing tied: every step
    assert (
        "peers load: cores other processes used during each launch" in summary
        and "Schedule1F1B" in summary["peers peer"]
    )


def test_peers_size_must_be_one_of_the_peers_sizes() -> None:
    from rapydli.bench.parallel import command as parallel_command

    result = CliRunner().invoke(parallel_command, ["--peers", "--size", "gpt2-63m"])
    assert result.exit_code != 0 and "with --peers, one of bench, tiny" in result.output


def test_the_time_parts_models_are_the_peers_shapes_and_an_unknown_one_is_refused() -> None:
    from rapydli.bench.parallel import command as parallel_command
    from rapydli.bench.parallel_worker import TIME_MODELS
    from rapydli.bench.peers_worker import SHAPES

    result = CliRunner().invoke(parallel_command, ["--parts", "time", "--model", "gpt3"])
    assert result.exit_code == 2 and "'gpt3' is not one of 'gpt2', 'llama', 'tiny_lm'" in result.output, result.output
    for name in ("gpt2", "llama"):  # the --peers bench size, so both benches speak of the same models
        model_fn, data_fn = TIME_MODELS[name]
        assert sum(p.numel() for p in model_fn().parameters()) == sum(
            p.numel() for p in SHAPES["bench"].model(name).parameters()
        )
        train, _ = data_fn()
        assert train[0][0].shape == (SHAPES["bench"].positions,)
