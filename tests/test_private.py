"""Private on a shared machine: another user cannot read the run store, a checkpoint or a cluster's
connection files (whose key lets one run code on the engines). Run as root, the test reads them
as the user ``nobody`` from a directory everyone may enter, as a shared /scratch would be."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rapydli.paths import private_dir
from rapydli.settings import home_at
from rapydli.trainer.checkpoint import save_atomic

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.getuid() != 0, reason="reading as another user needs root (to become nobody)")


@pytest.fixture
def shared() -> Iterator[Path]:
    """A directory everyone may enter (pytest's own tmp_path is 0700, which would hide everything anyway)."""
    base = Path(tempfile.mkdtemp(prefix="rapydli-shared-", dir="/tmp"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def readable_by_nobody(path: Path) -> bool:
    def become_nobody() -> None:
        os.setgid(NOBODY)
        os.setuid(NOBODY)

    done = subprocess.run(["head", "-c", "1", str(path)], preexec_fn=become_nobody, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 or "Permission denied" in done.stderr, done.stderr
    return done.returncode == 0


def test_another_user_cannot_read_the_store_a_checkpoint_or_connection_files(shared: Path) -> None:
    from rapydli.experiments.store.runstore import open_store

    (shared / "public.txt").write_text("anyone")
    assert readable_by_nobody(shared / "public.txt")  # the probe can read what is not private
    with home_at(shared / "rapydli-home") as home:
        store = open_store()
        assert store is not None
        store.create_run("train", "secret", {"lr": 0.1})
        security = home / "ipython" / "security"
        security.mkdir(parents=True)
        (security / "ipcontroller-x-client.json").write_text('{"key": "secret"}')  # as ipyparallel writes it
        checkpoint = save_atomic({"w": torch.zeros(2)}, shared / "run" / "checkpoints" / "last.pt")
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE(checkpoint.parent.stat().st_mode) == 0o700 and stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
        for secret in (home / "runs.db", security / "ipcontroller-x-client.json", checkpoint):
            assert secret.exists() and not readable_by_nobody(secret), secret
        store.close()


def test_a_home_others_may_enter_is_made_private_and_a_users_own_output_dir_is_left_alone(shared: Path) -> None:
    loose = shared / "loose-home"
    loose.mkdir(mode=0o755)
    loose.chmod(0o755)
    with home_at(loose) as home:
        from rapydli.paths import home as rapydli_home

        assert rapydli_home() == home and stat.S_IMODE(home.stat().st_mode) == 0o700
    mine = shared / "my-outputs"
    mine.mkdir()
    mine.chmod(0o755)  # the user's choice for a directory of theirs: kept
    private_dir(mine)
    assert stat.S_IMODE(mine.stat().st_mode) == 0o755
