"""The package surface: lazy imports, the public API, and the command line's contract."""

import subprocess
import sys

import click
import pytest

import rapydli as rd
from rapydli.cli import cli, main


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()


def test_import_is_light():
    loaded = _python(
        "import rapydli, sys; print(sorted(m for m in ('torch', 'plotly', 'optuna', 'ipyparallel', 'lmdb') if m in sys.modules))"
    )
    assert loaded == "[]"


def test_rd_train_is_callable_and_its_submodules_import():
    import rapydli.zoo.models as models

    assert models.__name__ == "rapydli.zoo.models"
    assert rd.TrainConfig.__module__ == "rapydli.trainer.config"
    with pytest.raises(rd.ConfigError, match="lr"):  # calling rd.train reaches the trainer entry point
        rd.train(models.mlp, "rapydli.zoo.datasets:digits", {"lr": -1.0})


def test_public_api_names_resolve():
    for name in rd.__all__:
        assert getattr(rd, name) is not None, name


def test_every_command_loads_and_has_help():
    result = subprocess.run([sys.executable, "-m", "rapydli", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for command in ("batch", "bench", "cluster", "runs", "tune"):
        assert command in result.stdout
    bench = subprocess.run(
        [sys.executable, "-m", "rapydli", "bench", "--help"], capture_output=True, text=True, timeout=120
    )
    for name in ("allreduce", "conv", "loader", "magics", "trainer"):
        assert name in bench.stdout


def test_exit_codes_of_commands_are_kept():
    @cli.command("exit-three")
    def exit_three() -> None:
        raise click.exceptions.Exit(3)

    try:
        assert main(["exit-three"]) == 3
    finally:
        cli.commands.pop("exit-three")


def test_user_errors_are_one_line_with_status_two(capsys):
    assert main(["cluster", "start", "-n", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["rapydli: error: n=0 is invalid: the number of engines must be an integer >= 1"]


@pytest.mark.parametrize("bad", [["nope"], ["cluster", "--bogus"]])
def test_usage_errors_exit_two(bad):
    assert main(bad) == 2
