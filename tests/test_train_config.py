"""TrainConfig: validation names the field and the allowed values; specs drive widgets."""

from __future__ import annotations

import dataclasses

import pytest

from rapydli.errors import ConfigError
from rapydli.trainer.config import TrainConfig, fields_spec


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"lr": 0.0}, "TrainConfig.lr=0.0 is invalid: must be in (0, 10]"),
        ({"lr": float("nan")}, "TrainConfig.lr=nan"),
        ({"epochs": 0}, "TrainConfig.epochs=0 is invalid: must be an integer in [1, 100000]"),
        ({"epochs": 1.5}, "TrainConfig.epochs=1.5"),
        ({"batch_size": True}, "TrainConfig.batch_size=True"),
        ({"optimizer": "adam"}, "TrainConfig.optimizer='adam' is invalid: must be one of 'sgd', 'adamw'"),
        ({"lr_schedule": "linear"}, "'constant', 'cosine', 'step'"),
        ({"precision": "fp16"}, "'fp32', 'bf16'"),
        ({"allreduce": "nccl2"}, "'auto', 'gloo', 'mpi', 'nccl', 'ring', 'shm'"),
        ({"loader": "fast"}, "'clairvoyant', 'default'"),
        ({"momentum": 1.0}, "TrainConfig.momentum=1.0 is invalid: must be in [0, 1)"),
        ({"grad_clip": 0.0}, "TrainConfig.grad_clip=0.0 is invalid: must be in (0, 1000000] or None"),
        ({"grad_accum": 0}, "TrainConfig.grad_accum=0"),
        ({"bucket_mb": -1}, "TrainConfig.bucket_mb=-1"),
        ({"overlap": "yes"}, "TrainConfig.overlap='yes' is invalid: must be True or False"),
        ({"max_steps": 0}, "TrainConfig.max_steps=0 is invalid: must be an integer in [1, 1000000000] or None"),
        ({"workers": 0}, "TrainConfig.workers=0"),
        ({"cache_ram_mb": -5.0}, "TrainConfig.cache_ram_mb=-5.0"),
        ({"resume": True}, "TrainConfig.resume=True needs TrainConfig.checkpoint_dir"),
    ],
)
def test_invalid_values_name_field_and_allowed_range(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig(**changes)
    assert message in str(info.value)


def test_valid_values_are_normalised() -> None:
    cfg = TrainConfig(lr=1, epochs=3.0, bucket_mb=1, max_steps=None, checkpoint_dir=None)
    assert isinstance(cfg.lr, float) and cfg.lr == 1.0
    assert isinstance(cfg.epochs, int) and cfg.epochs == 3
    assert cfg.global_batch(world_size=4) == 32 * 4


def test_pathlike_checkpoint_dir_becomes_str(tmp_path) -> None:
    assert TrainConfig(checkpoint_dir=tmp_path, resume=True).checkpoint_dir == str(tmp_path)


def test_dict_round_trip_and_unknown_keys() -> None:
    cfg = TrainConfig(epochs=2, optimizer="sgd", lr_schedule="cosine", grad_clip=1.0, precision="bf16")
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.replace(lr=0.5).lr == 0.5
    with pytest.raises(ConfigError, match="TrainConfig has no field 'learning_rate'"):
        TrainConfig.from_dict({"learning_rate": 0.1})
    with pytest.raises(ConfigError, match="TrainConfig.lr"):
        cfg.replace(lr=-1.0)


def test_fields_spec_describes_every_field() -> None:
    specs = {spec.name: spec for spec in fields_spec()}
    assert list(specs) == [f.name for f in dataclasses.fields(TrainConfig)]
    assert specs["lr"].type == "float" and specs["lr"].log and specs["lr"].low == 0.0 and specs["lr"].low_open
    assert specs["optimizer"].choices == ("sgd", "adamw") and specs["optimizer"].default == "adamw"
    assert specs["overlap"].type == "bool"
    assert specs["max_steps"].optional and specs["max_steps"].type == "int"
    assert specs["checkpoint_dir"].type == "str" and specs["checkpoint_dir"].optional
    assert specs["workers"].low == 1
    for spec in specs.values():  # every default passes its own spec
        assert spec.help
    TrainConfig(**{name: spec.default for name, spec in specs.items()})


def test_choices_follow_the_registries() -> None:
    from rapydli.comm.base import algorithm_names
    from rapydli.data.kinds import LOADERS

    choices = {spec.name: set(spec.choices or ()) for spec in TrainConfig.fields_spec()}
    assert choices["allreduce"] == set(algorithm_names())
    assert choices["loader"] == set(LOADERS.names())


def test_a_registered_algorithm_is_selectable(monkeypatch: pytest.MonkeyPatch) -> None:
    from rapydli.comm.registry import ALGORITHMS

    with pytest.raises(ConfigError, match="allreduce='tree' is invalid: must be one of"):
        TrainConfig(allreduce="tree")
    monkeypatch.setitem(ALGORITHMS._factories, "tree", "mypackage.tree:TreeAlgorithm")
    assert TrainConfig(allreduce="tree").allreduce == "tree"


def test_config_module_stays_light() -> None:
    """Building a TrainConfig (in the notebook, the CLI, the panel) imports neither torch nor mpi4py."""
    import subprocess
    import sys

    code = "import sys; from rapydli.trainer.config import TrainConfig; TrainConfig(); print(sorted(m for m in ('torch', 'mpi4py') if m in sys.modules))"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


def test_a_misspelt_keyword_names_the_closest_field() -> None:
    with pytest.raises(ConfigError, match=r"TrainConfig has no field 'lrr': did you mean 'lr'\?"):
        TrainConfig(lrr=0.1)
    with pytest.raises(ConfigError, match=r"no field 'bach_size': did you mean 'batch_size'\?"):
        TrainConfig.from_dict({"bach_size": 8})


def test_hang_options_are_validated():
    assert (TrainConfig().hang_timeout_s, TrainConfig().on_hang) == (None, "wait")
    with pytest.raises(ConfigError, match="on_hang"):
        TrainConfig(on_hang="kill")
    with pytest.raises(ConfigError, match="hang_timeout_s"):
        TrainConfig(hang_timeout_s=0)


def test_memory_per_rank_takes_bytes_or_text_with_a_unit_and_keeps_bytes() -> None:
    assert TrainConfig(memory_per_rank="200MB").memory_per_rank == 200e6
    assert TrainConfig(memory_per_rank="1.5 GiB").memory_per_rank == 1.5 * 2**30
    assert (
        TrainConfig(memory_per_rank="512kib").memory_per_rank == 512 * 1024
        and TrainConfig(memory_per_rank=4096).memory_per_rank == 4096.0
    )
    kept = TrainConfig(memory_per_rank="2GB")
    assert TrainConfig.from_dict(kept.to_dict()) == kept and TrainConfig().memory_per_rank is None
    for bad in ("200XB", "MB", "0MB", "-1GB", "2 G B"):
        with pytest.raises(
            ConfigError,
            match=rf"TrainConfig.memory_per_rank='{bad}' is invalid: bytes > 0: a number, or text with a unit",
        ):
            TrainConfig(memory_per_rank=bad)
    with pytest.raises(ConfigError, match=r"TrainConfig.memory_per_rank=0 is invalid: must be in \(0, "):
        TrainConfig(memory_per_rank=0)


def test_a_memory_limit_on_a_model_the_meta_device_cannot_build_is_not_checked_and_says_so() -> None:
    import torch

    from rapydli.experiments.planning.fit import check_fits

    def loads_weights() -> torch.nn.Module:
        model = torch.nn.Linear(4, 4)
        assert model.weight.abs().max().item() < 1  # reading a value: a meta tensor has none
        return model

    with pytest.warns(
        UserWarning, match=r"memory_per_rank=0.9537 MiB was not checked: the model cannot be built on the meta device"
    ):
        assert check_fits(loads_weights, TrainConfig(memory_per_rank="1MB"), 2) is None
    assert check_fits(loads_weights, TrainConfig(), 2) is None  # no limit: nothing to check


def test_an_offloaded_optimizer_leaves_a_gpu_ranks_memory_and_is_suggested_when_it_would_fit() -> None:
    import torch

    from rapydli.experiments.planning.fit import check_fits

    def mlp() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])

    def mlp_on_gpu() -> torch.nn.Module:
        return mlp().to("cuda")  # built on the meta device here: no GPU is needed to check it

    psi = sum(p.numel() for p in mlp().parameters())
    base = TrainConfig(zero=2, workers=4)
    on_cpu, offloaded_cpu = (
        check_fits(mlp, base.replace(memory_per_rank=1e9), 4),
        check_fits(mlp, base.replace(memory_per_rank=1e9, offload_optimizer=True), 4),
    )
    assert (
        on_cpu is not None and offloaded_cpu == on_cpu
    )  # on CPU ranks the state is in host memory already: nothing leaves
    offloaded = check_fits(mlp_on_gpu, base.replace(memory_per_rank=1e9, offload_optimizer=True), 4)
    assert offloaded is not None and offloaded.optimizer == 0
    assert offloaded.host == pytest.approx(
        2 * 4 * psi / 4 + 4 * psi / 4
    )  # AdamW's two moments and the slices' fp32 copies, a quarter each
    assert offloaded.peak == pytest.approx(on_cpu.peak - on_cpu.optimizer)
    limit = (on_cpu.peak + offloaded.peak) / 2  # over without offloading, under with it
    with pytest.raises(ConfigError) as refused:
        check_fits(mlp_on_gpu, base.replace(memory_per_rank=limit), 4)
    least = check_fits(
        mlp_on_gpu, base.replace(zero=1, memory_per_rank=1e9, offload_optimizer=True), 4
    )  # the least sharding that fits, offloaded
    assert least is not None and least.peak <= limit
    assert (
        f"zero=1 with offload_optimizer=True on these 4 ranks ({least.peak / 2**20:.4g} MiB per rank on the cuda device, "
        f"{least.host / 2**20:.4g} MiB in host memory)"
    ) in str(refused.value), str(refused.value)
    with pytest.raises(ConfigError) as still:  # the message says what left for the host
        check_fits(mlp_on_gpu, base.replace(memory_per_rank=offloaded.peak / 2, offload_optimizer=True), 4)
    assert (
        f"{offloaded.host / 2**20:.4g} MiB of optimizer state and slices in host memory (offload_optimizer), not counted"
        in str(still.value)
    )
