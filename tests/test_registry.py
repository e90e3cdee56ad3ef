"""Registries by name, open to entry points: a part another package registers is selectable everywhere.

The plugin is a real installed distribution as far as ``importlib.metadata`` is concerned:
a ``*.dist-info`` directory with ``entry_points.txt`` on ``sys.path`` (in a fresh
interpreter, so every registry reads it), registering a search strategy, a launcher, a
kernel candidate and a pipeline schedule.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rapydli.errors import ConfigError
from rapydli.registry import Registry

PLUGIN = '''
"""A third-party package adding RaPyDLI parts (written by tests/test_registry.py)."""
from pathlib import Path

from rapydli.autotune.candidates import TorchNCHW
from rapydli.autotune.strategies import exhaustive
from rapydli.cluster.launchers import LAUNCHERS, LauncherSpec
from rapydli.parallel.schedules import gpipe

CALLED = Path(__file__).with_name("called")


def tune_first(space, runner, options=None):
    """Measures the first configuration only (and says it ran)."""
    CALLED.write_text("strategy")
    first = [*space.always, *space.configs][:1]
    return exhaustive.tune(type(space)(space.problem, first), runner, options)


class Mirror(TorchNCHW):
    name = "mirror_conv"


MIRROR = Mirror()
HERE = LauncherSpec("here", engines="mpi", controller="local", description="mpiexec here, by another name",
                    options=LAUNCHERS.load("local").options)


def reversed_gpipe(stages, microbatches):
    return gpipe(stages, microbatches)
'''

ENTRY_POINTS = """
[rapydli.strategies]
first = rapydli_plugin:tune_first

[rapydli.launchers]
here = rapydli_plugin:HERE

[rapydli.candidates]
mirror_conv = rapydli_plugin:MIRROR

[rapydli.pipeline_schedules]
gpipe_too = rapydli_plugin:reversed_gpipe
"""

CHECK = """
import json

from click.testing import CliRunner

import rapydli_plugin
from rapydli.autotune import ConvShape, tune_conv2d
from rapydli.autotune.candidates import registry
from rapydli.cli import cli
from rapydli.cluster import Cluster
from rapydli.parallel.schedules import build, gpipe
from rapydli.trainer.config import TrainConfig, fields_spec

shape = ConvShape.parse("1,2,6,6,2,3,3,1,1")
out = {}
tuned = tune_conv2d(shape, "cpu", "inference", strategy="first", candidates=["mirror_conv"], repetitions=1, cache=False)
out["strategy_ran"] = rapydli_plugin.CALLED.read_text()
out["candidate"] = tuned.best.config.candidate
out["candidate_registered"] = "mirror_conv" in registry()
out["launcher"] = Cluster(n=2, launcher="here").launcher.name  # validated, nothing started
out["schedule"] = build("gpipe_too", 2, 2) == gpipe(2, 2)
out["config"] = TrainConfig(pipeline_schedule="gpipe_too").pipeline_schedule
out["config_choices"] = "gpipe_too" in {s.name: s for s in fields_spec()}["pipeline_schedule"].choices
runner = CliRunner()
out["tune_help"] = "first" in runner.invoke(cli, ["tune", "conv2d", "--help"]).output
out["cluster_help"] = "here" in runner.invoke(cli, ["cluster", "start", "--help"]).output
print(json.dumps(out))
"""


@pytest.fixture
def plugin(tmp_path: Path) -> Path:
    """A directory holding the plugin module and its ``dist-info`` (put it on ``PYTHONPATH``)."""
    (tmp_path / "rapydli_plugin.py").write_text(textwrap.dedent(PLUGIN))
    info = tmp_path / "rapydli_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rapydli-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return tmp_path


def test_parts_registered_by_another_package_are_selectable(plugin: Path, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH")) if p)}
    done = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found == {
        "strategy_ran": "strategy",
        "candidate": "mirror_conv",
        "candidate_registered": True,
        "launcher": "here",
        "schedule": True,
        "config": "gpipe_too",
        "config_choices": True,
        "tune_help": True,
        "cluster_help": True,
    }


def test_a_registry_reads_its_entry_points_and_names_what_is_allowed(
    plugin: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(plugin))
    parts = Registry("launcher", {"local": "rapydli.cluster.launchers:get_launcher"}, group="rapydli.launchers")
    assert list(parts) == ["here", "local"] and "here" in parts
    assert parts.load("here").description == "mpiexec here, by another name"
    parts.register("mine", "rapydli.cluster.launchers:validate_options")
    assert parts.names() == ["here", "local", "mine"]
    parts.unregister("here")
    with pytest.raises(ConfigError, match="'here' is not a launcher: allowed are 'local', 'mine'"):
        parts.load("here")
