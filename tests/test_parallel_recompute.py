"""Activation checkpointing (TrainConfig.activation_checkpointing): recomputed blocks give bit-equal results, dropout included."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rapydli.errors import ConfigError

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))


def _train(spec: str | None) -> tuple[dict[str, torch.Tensor], list[int], list[dict]]:
    from mpi4py import MPI
    from recompute_models import dropout_net, features

    from rapydli.trainer import TrainConfig, Trainer

    train, val = features()
    config = TrainConfig(
        batch_size=8, max_steps=3, lr=0.01, eval_every=2, seed=0, activation_checkpointing=spec, workers=1
    )
    trainer = Trainer(dropout_net(), None, train, val, config, comm=MPI.COMM_SELF)
    history = trainer.fit()
    trainer.close()
    return trainer.model.state_dict(), [block.calls for block in trainer.model.blocks], history


def test_recomputed_blocks_train_bit_equal_parameters_with_dropout_on() -> None:
    kept, calls, history = _train(None)
    evals = sum(row["kind"] == "eval" for row in history)
    assert calls == [3 + evals] * 4  # one forward per step and per evaluation batch (8 samples: one batch)
    # the model's blocks are embed, blocks.0-3, head: every_k:2 takes embed, blocks.1, blocks.3
    for spec, recomputed in (("blocks", [0, 1, 2, 3]), ("every_k:2", [1, 3])):
        state, spec_calls, _ = _train(spec)
        assert all(torch.equal(state[k], kept[k]) for k in kept), spec  # the same dropout masks in the recomputation
        assert spec_calls == [3 + evals + 3 * (i in recomputed) for i in range(4)], (
            spec,
            spec_calls,
        )  # evaluation is not recomputed


def test_recomputed_batch_norm_updates_its_running_statistics_once() -> None:
    """A ResNet-style model: the recomputation normalises by the batch again but leaves the running statistics as the forward left them."""
    from mpi4py import MPI
    from recompute_models import images, resnet

    from rapydli.trainer import TrainConfig, Trainer

    train, val = images()
    states, losses = [], []
    for spec in (None, "blocks"):
        config = TrainConfig(
            batch_size=8, max_steps=3, lr=0.01, eval_every=3, seed=0, activation_checkpointing=spec, workers=1
        )
        trainer = Trainer(resnet(), None, train, val, config, comm=MPI.COMM_SELF)
        history = trainer.fit()
        trainer.close()
        states.append(trainer.model.state_dict())
        losses.append([row["val_loss"] for row in history if row["kind"] == "eval"])
    kept, recomputed = states
    assert int(recomputed["blocks.0.bn1.num_batches_tracked"]) == 3  # one update a step, not two
    assert all(torch.equal(recomputed[k], kept[k]) for k in kept) and losses[0] == losses[1] and losses[0]


def test_bad_values_are_refused_by_the_config() -> None:
    from rapydli.trainer.config import TrainConfig

    for bad in ("every_k:0", "every_k:x", "layers", "every_k:2:3"):
        with pytest.raises(
            ConfigError,
            match=rf"TrainConfig.activation_checkpointing='{bad}' is invalid: must be None, 'blocks' or 'every_k:N'",
        ):
            TrainConfig(activation_checkpointing=bad)
    with pytest.raises(ConfigError, match=r"TrainConfig.activation_checkpointing=2 is invalid"):
        TrainConfig(activation_checkpointing=2)
    assert TrainConfig(activation_checkpointing="every_k:3").activation_checkpointing == "every_k:3"


@pytest.mark.mpi
def test_recomputed_blocks_under_zero3_train_bit_equal_parameters_with_dropout_on(run_mpi) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_zero3; cases_zero3.recomputed()"
    result = run_mpi(code, n=2, timeout=300)
    assert result.stderr.count("OK recomputed") == 2
    row = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert row["equal"] == {"None": True, "blocks": True, "every_k:2": True}, row
    assert (
        row["calls"]["blocks"][0] > row["calls"]["None"][0] and row["calls"]["every_k:2"][0] == row["calls"]["None"][0]
    ), row


def test_the_chosen_blocks_and_a_copy_of_the_model() -> None:
    import copy

    from recompute_models import dropout_net

    from rapydli.parallel.recompute import checkpoint_blocks

    model = dropout_net()
    assert checkpoint_blocks(model, "every_k:2") == ["embed", "blocks.1", "blocks.3"]
    assert (
        checkpoint_blocks(model, "every_k:2") == ["embed", "blocks.1", "blocks.3"]
        and checkpoint_blocks(model, None) == []
    )
    twin = copy.deepcopy(model)
    twin(
        torch.randn(2, 8)
    ).sum().backward()  # the copy's recomputed blocks run the copy's forward, recomputed once in backward
    assert [b.calls for b in twin.blocks] == [1, 2, 1, 2] and [b.calls for b in model.blocks] == [0, 0, 0, 0]


@pytest.mark.parametrize("model_name", ["tiny_lm", "llama_style"])
def test_activations_held_with_checkpointing_are_the_planners_prediction_within_10_percent(model_name: str) -> None:
    """One rank trains with every block recomputed; the activation meter's peak (inputs kept, plus what a recomputation
    saves while it runs) is within 10 % of what the planner predicts from its profile of the model."""
    import functools

    from mpi4py import MPI

    from rapydli.experiments.planning.layouts import NO_SCHEDULE, Candidate
    from rapydli.experiments.planning.network import Network
    from rapydli.experiments.planning.perfmodel import RingModel
    from rapydli.experiments.planning.profiling import local_profile
    from rapydli.experiments.planning.stepmodel import predict
    from rapydli.parallel.memory import ActivationMeter
    from rapydli.trainer import TrainConfig, Trainer
    from rapydli.zoo import datasets, models

    build = {
        "tiny_lm": functools.partial(models.tiny_lm, vocab_size=128, block_size=32, dim=64, layers=4, heads=4),
        "llama_style": functools.partial(
            models.llama_style, vocab=128, hidden=64, heads=4, kv_heads=2, intermediate=96, layers=4
        ),
    }[model_name]
    data = functools.partial(datasets.synthetic_tokens, num_samples=64, block_size=32, vocab_size=128)
    config = TrainConfig(
        batch_size=8,
        optimizer="adamw",
        max_steps=2,
        epochs=2,
        eval_every=0,
        workers=1,
        activation_checkpointing="blocks",
    )
    profile = local_profile(build, data, config, [8], [1], [])
    predicted = predict(
        Candidate.of(1, 1, 1, 1, NO_SCHEDULE, 0, "blocks"), profile, Network.from_ring(RingModel(0.0, 0.0)), 8, config
    )
    kept = predict(Candidate.of(1, 1, 1, 1, NO_SCHEDULE, 0), profile, Network.from_ring(RingModel(0.0, 0.0)), 8, config)

    torch.manual_seed(config.seed)
    train, _ = data()
    trainer = Trainer(build(), None, train, None, config, comm=MPI.COMM_SELF)
    try:
        with ActivationMeter([*trainer.model.parameters(), *train.tensors]) as meter:
            trainer.fit()
    finally:
        trainer.close()
    assert meter.peak == pytest.approx(predicted.memory.activations, rel=0.10), (
        meter.peak,
        predicted.memory.activations,
    )
    assert predicted.memory.activations < kept.memory.activations / 2  # and checkpointing does save
