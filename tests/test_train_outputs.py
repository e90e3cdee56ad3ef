"""Your own model, loss and optimizer: outputs read without a wrapper, unused parameters as DDP,
metrics, and the same parameters as torch DDP and as one process (``tests/train_cases.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import train_cases
from torch import nn
from train_cases import CASES, ModelOutput, PooledClassifier, TinyGPT

import rapydli as rd
from rapydli.errors import ConfigError, RankFailure, UserCodeError
from rapydli.trainer import TrainConfig, Trainer
from rapydli.trainer.checkpoint import checkpoint_path, read_state_dict
from rapydli.trainer.outputs import Objective, OutputError, interpret, resolve_metrics, target_parameter

TESTS = Path(__file__).resolve().parent


# -- outputs, in one process --------------------------------------------------------------------


def test_interpret_reads_every_documented_shape() -> None:
    logits, loss = torch.randn(2, 3), torch.tensor(0.5)
    assert interpret(logits).logits is logits and interpret(logits).loss is None
    assert interpret((logits, loss)).loss is loss and interpret((logits, loss)).logits is logits  # nanoGPT
    assert interpret((loss, logits, torch.randn(2, 4))).logits is logits  # HF return_dict=False
    assert interpret((logits, None)).loss is None
    assert interpret([logits]).logits is logits
    found = interpret(ModelOutput(loss=loss, logits=logits, hidden_states=None))
    assert found.loss is loss and found.logits is logits
    assert interpret({"loss": loss}).logits is None


def test_target_parameter_is_found_by_name_not_position() -> None:
    assert target_parameter(TinyGPT()) == "targets"
    assert target_parameter(PooledClassifier()) == "labels"
    assert target_parameter(nn.Linear(2, 2)) is None

    class HFStyle(nn.Module):  # attention_mask comes second, as in transformers
        def forward(self, input_ids, attention_mask=None, labels=None):
            return {"loss": (input_ids.float().sum() * 0 + 1.0), "logits": input_ids.float()}

    objective = Objective(HFStyle())
    assert objective.target_parameter == "labels"
    loss, outputs = objective(HFStyle(), torch.ones(2, 3), torch.zeros(2))
    assert float(loss) == 1.0 and "logits" in outputs


def test_an_uninterpretable_output_names_its_type_and_the_three_fixes() -> None:
    class Hidden:  # what a model might return that holds no logits and no loss
        pass

    class Odd(nn.Module):
        def forward(self, x):
            return Hidden()

    with pytest.raises(OutputError) as caught:
        Objective(Odd())(Odd(), torch.ones(2, 2), torch.zeros(2, dtype=torch.long))
    text = str(caught.value)
    assert "Hidden" in text and "neither logits nor a loss" in text
    assert "1. return logits" in text and "2. pass loss_fn=" in text and "3. give forward a 'targets'" in text
    with pytest.raises(OutputError, match=r"dict with keys \['features'\]"):
        interpret({"features": torch.ones(2)})
    with pytest.raises(OutputError, match=r"tuple of \(str, NoneType\)"):
        interpret(("a", None))


def test_bad_code_arguments_fail_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match="loss_fn must be a callable"):
        rd.train(train_cases.RegressionMLP, train_cases.regression, TrainConfig(), loss_fn="mse")
    with pytest.raises(ConfigError, match="optimizer_fn must be a callable"):
        rd.train(
            train_cases.RegressionMLP,
            train_cases.regression,
            TrainConfig(),
            optimizer_fn=torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=1),
        )
    with pytest.raises(ConfigError, match="unknown metric 'f1'.*accuracy, mse, mae"):
        rd.train(train_cases.RegressionMLP, train_cases.regression, TrainConfig(), metrics=["f1"])
    assert list(resolve_metrics(["mae", len])) == ["mae", "len"]


def test_one_process_trainer_reads_outputs_and_reports_metrics_where_they_mean_something() -> None:
    train, val = train_cases.regression()
    trainer = Trainer(
        train_cases.RegressionMLP(), None, train, val, TrainConfig(max_steps=2, batch_size=4), loss_fn=nn.MSELoss()
    )
    trainer.fit()
    evaluation = [row for row in trainer.history if row["kind"] == "eval"][-1]
    assert "val_loss" in evaluation and "val_accuracy" not in evaluation  # regression: no accuracy

    trainer = Trainer(
        train_cases.RegressionMLP(),
        None,
        train,
        val,
        TrainConfig(max_steps=2, batch_size=4),
        loss_fn=nn.MSELoss(),
        metrics={"mae": "mae", "worst": lambda out, y: (out - y).abs().max()},
    )
    row = trainer.evaluate()
    model = trainer.model.eval()
    with torch.no_grad():
        error = model(val.tensors[0]) - val.tensors[1]
    assert row["val_mae"] == pytest.approx(float(error.abs().mean()), rel=1e-5)
    assert row["val_loss"] == pytest.approx(float((error**2).mean()), rel=1e-5)
    assert row["val_worst"] <= float(error.abs().max()) + 1e-6

    train, _ = train_cases.features()
    trainer = Trainer(train_cases.NormedMLP(), None, train, train, TrainConfig(max_steps=1, batch_size=4))
    assert 0.0 <= trainer.evaluate()["val_accuracy"] <= 1.0  # classification: accuracy by default


# -- the same parameters as DDP and one process, on real ranks ---------------------------------


@pytest.mark.mpi
@pytest.mark.parametrize(
    "names",
    [
        ("cnn", "mlp_mse", "gpt", "model_output"),
        ("two_groups", "frozen", "rank0_branch"),
        ("model_output_zero2", "frozen_zero2", "rank0_branch_zero2"),
    ],
)
def test_trainer_matches_ddp_and_one_process(run_mpi, names) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\nfrom train_cases import check_case\n"
    code += "".join(f"check_case({name!r})\n" for name in names)
    result = run_mpi(code, n=2, timeout=240)
    for name in names:
        assert f"{name}: ok" in result.stdout


@pytest.mark.mpi
def test_metrics_averaged_over_two_ranks_equal_one_process(run_mpi) -> None:
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r})\nfrom train_cases import check_metrics_averaged\ncheck_metrics_averaged()\n"
    assert "metrics averaged: ok" in run_mpi(code, n=2, timeout=120).stdout


# -- rd.train on real engines -------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with rd.Cluster(n=2) as started:
        yield started


@pytest.mark.engines
@pytest.mark.parametrize("name", ["gpt", "mlp_mse", "two_groups", "model_output"])
def test_rd_train_gives_the_one_process_parameters(cluster, tmp_path, name) -> None:
    case = CASES[name]
    config = train_cases.config_of(case, checkpoint_dir=str(tmp_path), allreduce="mpi")
    metrics = ["mae"] if name == "mlp_mse" else None
    result = rd.train(
        case.model_fn,
        case.data_fn,
        config,
        cluster=cluster,
        progress=False,
        live=False,
        loss_fn=case.loss_fn,
        optimizer_fn=case.optimizer_fn,
        metrics=metrics,
    )
    trained = result.state_dict()  # the trained model, gathered on the engines
    assert set(read_state_dict(tmp_path)[0]) <= set(
        trained
    )  # its last checkpoint: the same tensors (a tied one under its first name)
    single = train_cases.single_process(name, 2).state_dict()
    for key, value in single.items():
        assert torch.allclose(trained[key], value, atol=train_cases.TOL, rtol=0), (
            key,
            (trained[key] - value).abs().max(),
        )
    if name == "mlp_mse":
        evaluation = result.history[result.history["kind"] == "eval"].iloc[-1]
        assert evaluation["val_mae"] > 0 and "val_accuracy" not in result.history
    if case.unchanged:  # the mapping's unused pooler: not moved, and never a gradient (AdamW made no state for it)
        initial = train_cases.build(case)
        for key in case.unchanged:
            assert torch.equal(trained[key], initial.state_dict()[key]), key
        manifest = torch.load(checkpoint_path(tmp_path), weights_only=False)
        stepped = {key for part in manifest["parts"] for key, field in part["keys"] if field.startswith("optim.")}
        assert stepped == {key for key, _ in initial.named_parameters()} - set(case.unchanged)


@pytest.mark.engines
def test_rd_train_error_names_the_output_type_and_the_user_frame_first(cluster) -> None:
    # the same mistake on every rank: one short OutputError, not a RankFailure with each rank's traceback
    with pytest.raises(OutputError) as caught:
        rd.train(
            train_cases.Unreadable,
            train_cases.features,
            TrainConfig(max_steps=1, batch_size=4),
            cluster=cluster,
            progress=False,
            live=False,
        )
    text = str(caught.value)
    assert "train_cases.Features" in text and "pass loss_fn=" in text, text
    assert "rank 1" not in text and "full traceback" not in text and len(text.splitlines()) < 20, text
    assert caught.value.__suppress_context__  # the RankFailure it replaces is not chained
    with pytest.raises(RankFailure) as caught:
        rd.train(
            train_cases.Failing,
            train_cases.features,
            TrainConfig(max_steps=1, batch_size=4),
            cluster=cluster,
            progress=False,
            live=False,
        )
    text = str(caught.value)  # the user's frames, once for both ranks; RaPyDLI's folded away, one call away
    assert text.startswith("ranks 0, 1 raised the same exception\n--- ranks 0, 1 (error) ---\nin your code"), text
    assert (
        'raise ValueError("this layer is broken")' in text
        and "failure.details()" in text
        and "full traceback" not in text
    ), text
    assert "rapydli/trainer" not in text and len(text.splitlines()) <= 20, text
    details = caught.value.details()
    assert (
        details.startswith("--- rank 0 ---\nin your code")
        and "--- rank 1 ---" in details
        and "rapydli/trainer/task.py" in details
    ), details


@pytest.mark.engines
def test_a_data_fn_returning_one_dataset_is_named_once(cluster) -> None:
    with pytest.raises(UserCodeError) as caught:
        rd.train(
            train_cases.NormedMLP,
            train_cases.features_only,
            TrainConfig(max_steps=1, batch_size=4),
            cluster=cluster,
            progress=False,
            live=False,
        )
    text = str(caught.value)
    assert (
        text.startswith("data_fn train_cases:features_only returned a TensorDataset of ") and "(train, val)" in text
    ), text
    assert "too many values to unpack" not in text and "rank" not in text and len(text.splitlines()) < 10, text


def test_a_loss_that_is_not_a_scalar_is_named_with_its_shape() -> None:
    model, x, y = train_cases.NormedMLP(), torch.zeros(3, 8), torch.zeros(3, dtype=torch.long)
    with pytest.raises(
        OutputError, match=r"^loss_fn per_sample_loss returned a tensor of shape \(3,\); it must return the scalar"
    ):
        Objective(model, train_cases.per_sample_loss)(model, x, y)

    class OwnLoss(nn.Module):  # computes its loss from the labels, per sample
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.fc(x), labels, reduction="none")

    own = OwnLoss()
    with pytest.raises(OutputError, match=r"^forward was given 'labels' and returned a tensor of shape \(3,\)"):
        Objective(own)(own, x, y)
    with pytest.raises(OutputError, match=r"^the model returned a loss of shape \(3,\): the loss must be a scalar"):
        Objective(model).loss({"loss": torch.zeros(3), "logits": torch.zeros(3, 4)}, y)


@pytest.mark.engines
def test_a_per_sample_loss_fn_is_named_once(cluster) -> None:
    with pytest.raises(OutputError) as caught:
        rd.train(
            train_cases.NormedMLP,
            train_cases.features,
            TrainConfig(max_steps=1, batch_size=4),
            cluster=cluster,
            loss_fn=train_cases.per_sample_loss,
            progress=False,
            live=False,
        )
    text = str(caught.value)
    assert text.startswith("loss_fn per_sample_loss returned a tensor of shape (4,)") and "rank 1" not in text, text


def test_check_data_names_what_was_returned() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    from rapydli.trainer.usercheck import check_data

    data = TensorDataset(torch.zeros(3, 2))
    assert check_data((data, None), "f") == (data, None)
    with pytest.raises(UserCodeError, match=r"^data_fn f returned a tuple of 3 items; it must return \(train, val\)"):
        check_data((data, data, data), "f")
    with pytest.raises(
        UserCodeError, match=r"DataLoader of 2 samples as its train set \(a DataLoader: return its \.dataset"
    ):
        check_data((DataLoader(data, batch_size=2), None), "f")


@pytest.mark.engines
def test_main_classes_with_super_run_on_engines(cluster) -> None:
    """A class from ``__main__`` passed itself as model_fn: ipyparallel used to rebuild it (super() broke)."""
    namespace: dict = {"__name__": "__main__"}
    exec(  # noqa: S102 - defines a class whose __module__ is __main__, as a notebook does
        "import torch\nfrom torch import nn\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 4)\n"
        "    def forward(self, x):\n        return self.fc(x)\n",
        namespace,
    )
    net = namespace["Net"]
    assert net.__module__ == "__main__"
    results = cluster.run(_build_and_count, net)
    assert results == [36, 36]
    cluster.push({"Net": net})  # what %%distributed --push does
    assert cluster.run_cell("sum(p.numel() for p in Net().parameters())", gather=True) == [36, 36]


@pytest.mark.engines
def test_a_distributed_cell_error_shows_the_cell_line(cluster) -> None:
    with pytest.raises(RankFailure) as caught:
        cluster.run_cell("x = 1\nraise ValueError('the cell broke at x=' + str(x))")
    assert "raise ValueError('the cell broke at x=' + str(x))" in str(caught.value), str(caught.value)


def _build_and_count(cls: type) -> int:
    return sum(p.numel() for p in cls().parameters())


# -- the recorded loss: the global batch's, in the model's precision ----------------------------


def test_the_default_loss_and_metrics_keep_float64_and_upcast_half_precision() -> None:
    from rapydli.trainer.outputs import cross_entropy, mae, mse

    logits, targets = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 4, (6,))
    assert cross_entropy(logits, targets).dtype == torch.float64
    assert cross_entropy(logits.half(), targets).dtype == torch.float32
    assert cross_entropy(logits.bfloat16(), targets).dtype == torch.float32
    exact = float(torch.nn.functional.cross_entropy(logits, targets))
    assert float(cross_entropy(logits, targets)) == exact  # no float32 rounding on the way
    prediction = torch.randn(5, dtype=torch.float64)
    truth = prediction + 1e-12
    assert mse(prediction, truth)[0] == pytest.approx(5e-24, rel=1e-3) and mae(prediction, truth)[0] == pytest.approx(
        5e-12, rel=1e-3
    )


@pytest.mark.mpi
def test_every_layout_records_the_loss_of_the_global_batch_as_one_process_does(run_mpi) -> None:
    import json

    result = run_mpi(
        f"import sys; sys.path.insert(0, {str(TESTS)!r}); import cases_global_loss; cases_global_loss.main()",
        n=4,
        timeout=400,
    )
    assert result.stderr.count("OK global loss") == 4
    ranks = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("[")))
    one = ranks[0]["one process"]
    assert len(one["loss"]) == 5 and len(one["val_loss"]) >= 1
    for rank, layouts in enumerate(ranks):
        for name in ("dp4 x 8", "pp2 x dp2 x 16", "tp2 x dp2 x 16"):
            got = layouts[name]
            assert got["loss"] == pytest.approx(one["loss"], abs=1e-10, rel=0), (rank, name)  # every step, every rank
            assert got["val_loss"] == pytest.approx(one["val_loss"], abs=1e-12, rel=0), (rank, name)
    own = [ranks[r]["dp4 x 8"]["rank_loss"][0] for r in range(4)]  # each rank's own share of the first batch
    assert len(set(own)) == 4 and sum(own) / 4 == pytest.approx(one["loss"][0], abs=1e-12)
