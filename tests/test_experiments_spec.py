"""``RunSpec``: what to train, resolved and checked once at the front door and passed whole."""

from __future__ import annotations

import pytest
from torch import nn

import rapydli as rd
from rapydli.errors import ConfigError
from rapydli.experiments.spec import RunSpec
from rapydli.zoo import datasets, models


def test_strings_are_imported_once_and_recorded_as_given() -> None:
    spec = RunSpec.of(
        "rapydli.zoo.models:mlp", "rapydli.zoo.datasets:digits", loss_fn=nn.CrossEntropyLoss(), metrics=["accuracy"]
    )
    assert spec.model_fn is models.mlp and spec.data_fn is datasets.digits and spec.name == "mlp"
    params = spec.params()
    assert params["model_fn"] == "rapydli.zoo.models:mlp" and params["data_fn"] == "rapydli.zoo.datasets:digits"
    assert params["loss_fn"] == "CrossEntropyLoss()" and params["metrics"] == ["accuracy"]
    assert spec.code == {"loss_fn": spec.loss_fn, "optimizer_fn": None, "metrics": ["accuracy"]}
    assert RunSpec.of(spec) is spec  # a spec is passed whole, never resolved again
    with pytest.raises(
        ConfigError, match="a RunSpec carries its own data_fn, loss_fn, optimizer_fn and metrics: loss_fn given"
    ):
        RunSpec.of(spec, None, nn.MSELoss())  # not silently dropped


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model_fn": "rapydli.zoo.models:nothing"}, "model_fn='rapydli.zoo.models:nothing' cannot be imported"),
        ({"data_fn": 3}, "data_fn=3 is invalid: must be a callable or a 'module:qualname' string"),
        ({"loss_fn": "mse"}, "loss_fn must be a callable"),
        ({"metrics": ["f1"]}, "metrics: unknown metric 'f1'"),
    ],
)
def test_what_cannot_work_is_one_error_before_anything_starts(kwargs: dict, message: str) -> None:
    given = {"model_fn": models.mlp, "data_fn": datasets.digits, **kwargs}
    with pytest.raises(ConfigError, match=message):
        RunSpec.of(**given)
    with pytest.raises(ConfigError, match=message):  # the front doors check it the same way, before any cluster
        rd.scaling_study(
            given["model_fn"],
            given["data_fn"],
            rd.TrainConfig(),
            workers=[1],
            **{k: v for k, v in given.items() if k not in ("model_fn", "data_fn")},
        )
