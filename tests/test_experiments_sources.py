"""rapydli.experiments.store.sources: a recorded run's code, read for display without importing it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rapydli.experiments.store.sources import module_source, run_sources

MODULE = '''"""A module that must not be imported to show its code."""
raise RuntimeError("imported")


def helper(x):
    return x


class Net:
    """A model."""

    @staticmethod
    def build(width=8):
        layers = [width]
        return layers
'''


@pytest.fixture
def code_dir(tmp_path: Path) -> Path:
    (tmp_path / "labcode_pkg").mkdir()
    (tmp_path / "labcode_pkg" / "__init__.py").write_text("")
    (tmp_path / "labcode_pkg" / "models.py").write_text(MODULE)
    return tmp_path


def test_a_function_or_method_is_read_from_its_file_without_importing_it(code_dir: Path) -> None:
    found = module_source("labcode_pkg.models:Net.build", str(code_dir))
    assert found is not None and found["file"] == str(code_dir / "labcode_pkg" / "models.py") and found["line"] == 12
    assert found["source"] == "@staticmethod\ndef build(width=8):\n    layers = [width]\n    return layers\n"
    assert module_source("labcode_pkg.models:helper", str(code_dir))["source"] == "def helper(x):\n    return x\n"
    assert "labcode_pkg" not in sys.modules and "labcode_pkg.models" not in sys.modules  # nothing ran
    for missing in (
        "labcode_pkg.models:nothing",
        "labcode_pkg.nomodule:f",
        "no_such_top_level_pkg:f",
        "labcode_pkg:helper",
    ):
        assert module_source(missing, str(code_dir)) is None, missing
    assert module_source("labcode_pkg.models:helper") is None  # not on the path, and no cwd given


def test_run_sources_lists_the_notebooks_code_then_the_modules(code_dir: Path) -> None:
    params = {
        "model_fn": "labcode_pkg.models:Net.build",
        "data_fn": "rapydli.zoo.datasets:digits",
        "loss_fn": "<notebook> my_loss",  # a description, not a reference
        "optimizer_fn": "gone_pkg:opt",  # can no longer be found: left out
        "sources": {"my_loss": "def my_loss(out, y):\n    return (out - y).abs().mean()\n"},
        "config": {"lr": 0.1},
    }
    found = run_sources(params, str(code_dir))
    assert [(s["origin"], s["name"], s.get("role")) for s in found] == [
        ("notebook", "my_loss", None),
        ("module", "Net.build", "model_fn"),
        ("module", "digits", "data_fn"),
    ]
    assert found[0]["source"] == params["sources"]["my_loss"]
    assert found[2]["ref"] == "rapydli.zoo.datasets:digits" and found[2]["source"].startswith("def digits(")
    assert run_sources({"config": {}}) == []
