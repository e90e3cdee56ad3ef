"""The settings object: every RAPYDLI_* variable read and validated in one place."""

from pathlib import Path

import pytest

from rapydli.errors import ConfigError
from rapydli.settings import Settings


def test_defaults_when_nothing_is_set() -> None:
    s = Settings.from_environ({})
    assert s.home == Path.home() / ".rapydli"
    assert (s.store, s.comm_autotune, s.comm_wait, s.heartbeat_timeout_s) == (True, True, "polite", 900.0)
    assert (s.batch_item, s.parent_run, s.notebook_dir, s.store_path) == (None, None, None, None)


def test_values_are_read() -> None:
    s = Settings.from_environ({
        "RAPYDLI_HOME": "/tmp/rd-home", "RAPYDLI_STORE": "off", "RAPYDLI_COMM_AUTOTUNE": "0",
        "RAPYDLI_COMM_WAIT": "spin", "RAPYDLI_HEARTBEAT_TIMEOUT": "30", "RAPYDLI_BATCH_ITEM": "abc",
    })  # fmt: skip
    assert s.home == Path("/tmp/rd-home") and not s.store and not s.comm_autotune
    assert (s.comm_wait, s.heartbeat_timeout_s, s.batch_item) == ("spin", 30.0, "abc")


@pytest.mark.parametrize(
    ("name", "value", "allowed"),
    [
        ("RAPYDLI_COMM_WAIT", "spinn", "'polite' or 'spin'"),
        ("RAPYDLI_STORE", "maybe", "one of 0, 1, false, no, off, on, true, yes"),
        ("RAPYDLI_HEARTBEAT_TIMEOUT", "soon", "a number of seconds > 0"),
        ("RAPYDLI_HEARTBEAT_TIMEOUT", "-5", "a number of seconds > 0"),
    ],
)
def test_a_bad_value_names_the_variable_and_what_is_allowed(name: str, value: str, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_environ({name: value})
    assert name in str(info.value) and allowed in str(info.value)


def test_the_environment_is_read_on_every_call(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from rapydli.paths import home

    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path))
    assert home() == tmp_path
