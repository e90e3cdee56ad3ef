"""The restart policy, checked before anything starts: how many restarts, on how few engines, from which checkpoints
(the restarts themselves, on real clusters, are in tests/test_train_restarts.py)."""

from __future__ import annotations

import pytest

from rapydli.errors import ConfigError
from rapydli.experiments.restarts import RestartPolicy, last_checkpoint_text
from rapydli.trainer.config import TrainConfig


@pytest.mark.parametrize("restarts", [-1, 1.5, True, "2"])
def test_a_restart_count_that_is_not_a_count_is_refused(restarts) -> None:
    with pytest.raises(ConfigError, match=r"restarts=.* is invalid: an integer >= 0"):
        RestartPolicy.of(TrainConfig(), restarts=restarts)


def test_a_run_that_may_restart_gets_a_scratch_checkpoint_directory_removed_when_it_is_done() -> None:
    policy, config = RestartPolicy.of(TrainConfig(max_restarts=2), min_workers=1)
    assert policy.restarts == 2 and policy.min_workers == 1 and config.min_workers == 1
    assert policy.scratch is not None and config.checkpoint_dir == str(policy.scratch)
    policy.scratch.mkdir(parents=True)
    policy.clean_up()
    assert not policy.scratch.exists()


def test_a_run_with_its_own_checkpoints_or_no_restarts_gets_no_scratch(tmp_path) -> None:
    policy, config = RestartPolicy.of(TrainConfig(checkpoint_dir=str(tmp_path)), restarts=1)
    assert policy.scratch is None and config.checkpoint_dir == str(tmp_path)
    policy, config = RestartPolicy.of(TrainConfig(), restarts=0)
    assert policy.scratch is None and config.checkpoint_dir is None
    assert last_checkpoint_text(config) == "the run kept no checkpoint (TrainConfig.checkpoint_dir was not set)"
    assert last_checkpoint_text(TrainConfig(checkpoint_dir=str(tmp_path))).startswith("no checkpoint was complete in ")


def test_more_min_workers_than_engines_is_refused() -> None:
    policy, _ = RestartPolicy.of(TrainConfig(), restarts=1, min_workers=3)
    policy.check(3)
    with pytest.raises(ConfigError, match=r"min_workers=3 is invalid: the cluster has 2 engines, allowed 1\.\.2"):
        policy.check(2)
