"""Private on a shared machine: another user cannot read the run store, a checkpoint or a cluster's
connection files (whose key lets one run code on the engines), nor run code on a running cluster's
engines. Run as root, the tests act as another user (``nobody``, and a user created for the test)
from a directory everyone may enter, as a shared /scratch would be."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
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


def _become(uid: int, gid: int):
    def become() -> None:
        os.setgid(gid)
        os.setuid(uid)

    return become


def readable_by_nobody(path: Path) -> bool:
    done = subprocess.run(
        ["head", "-c", "1", str(path)], preexec_fn=_become(NOBODY, NOBODY), capture_output=True, text=True, timeout=60
    )
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
        assert (
            stat.S_IMODE(checkpoint.parent.stat().st_mode) == 0o700 and stat.S_IMODE(checkpoint.stat().st_mode) == 0o600
        )
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


OTHER_USER = "rapydli-other"

#: Run by the other user: a client that knows the controller's ports (any user sees listening sockets) but not its key.
#: It starts as root only to load this Python and ipyparallel (which live under root's home here), and becomes the other
#: user before it reads or connects to anything.
INTRUDER = """
import os, sys
import ipyparallel as ipp
import ipyparallel.client.client, jupyter_client.session, zmq.asyncio  # noqa: F401 - loaded while root may
os.setgid(int(sys.argv[4]))
os.setuid(int(sys.argv[3]))
try:
    client = ipp.Client(sys.argv[1], timeout=10)
except Exception as exc:
    print("refused:", type(exc).__name__, exc)
    sys.exit(3)
print("connected to", client.ids)
print(client[:].apply_sync(os.makedirs, sys.argv[2], exist_ok=True))
"""


@pytest.fixture
def other_user(shared: Path) -> Iterator[pwd.struct_passwd]:
    """A Unix user created for the test (no login, its home under ``shared``), removed afterwards."""
    subprocess.run(["userdel", OTHER_USER], capture_output=True, check=False)  # a leftover of a killed run
    home = shared / OTHER_USER
    subprocess.run(
        ["useradd", "--home-dir", str(home), "--create-home", "--shell", "/usr/sbin/nologin", OTHER_USER],
        check=True,
        capture_output=True,
    )
    try:
        yield pwd.getpwnam(OTHER_USER)
    finally:
        subprocess.run(["userdel", "--remove", OTHER_USER], capture_output=True, check=False)


@pytest.mark.engines
def test_another_user_cannot_run_code_on_the_engines(shared: Path, other_user: pwd.struct_passwd) -> None:
    from rapydli.cluster import Cluster

    with home_at(shared / "rapydli-home") as home, Cluster(n=2) as cluster:
        (client_file,) = (home / "ipython" / "security").glob("ipcontroller-*-client.json")
        info = json.loads(client_file.read_text())
        assert info["key"] and info["interface"] == "tcp://127.0.0.1"  # a local cluster: loopback, messages signed
        guess = shared / "guess.json"  # every port the controller listens on, without the key
        guess.write_text(json.dumps({**info, "key": ""}))
        guess.chmod(0o644)
        marker = shared / "ran-as-the-owner"
        become = _become(other_user.pw_uid, other_user.pw_gid)
        env = {"PATH": os.environ["PATH"], "HOME": other_user.pw_dir}
        read = subprocess.run(
            ["head", "-c", "1", str(client_file)],
            preexec_fn=become,
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert read.returncode != 0 and "Permission denied" in read.stderr, read  # the key's file
        who = [str(other_user.pw_uid), str(other_user.pw_gid)]
        intruder = subprocess.run([sys.executable, "-c", INTRUDER, str(guess), str(marker), *who], capture_output=True, text=True,
                                  timeout=120, env={**env, "IPYTHONDIR": f"{other_user.pw_dir}/.ipython"}, cwd=other_user.pw_dir)  # fmt: skip
        # the controller drops what is not signed with its key: the client's registration is never answered
        assert intruder.returncode == 3 and "refused: TimeoutError" in intruder.stdout, (
            intruder.stdout,
            intruder.stderr,
        )
        assert not marker.exists()
        assert cluster.run(lambda: 7) == [7, 7]  # the owner's cluster goes on


def test_a_home_in_a_folder_another_user_shares_still_keeps_the_store_and_its_folders_private(shared: Path) -> None:
    """RAPYDLI_HOME pointing at a project folder everyone may write (owned by someone else, so left as it is): the store,
    its -wal and -shm files are 0600 and the folders RaPyDLI makes there 0700 (the store was 0644, the folders 0755)."""
    from rapydli.experiments.store.runstore import RunStore
    from rapydli.paths import subdir

    project = shared / "project"
    project.mkdir()
    os.chown(project, NOBODY, NOBODY)
    project.chmod(0o777)
    with home_at(project):
        store = RunStore(project / "runs.db")
        store.create_run("train", "secret", {"lr": 0.1})
        files = [project / name for name in ("runs.db", "runs.db-wal", "runs.db-shm")]
        assert all(stat.S_IMODE(f.stat().st_mode) == 0o600 for f in files), [oct(f.stat().st_mode) for f in files]
        assert not readable_by_nobody(project / "runs.db")
        store.close()
        assert stat.S_IMODE(subdir("checkpoints").stat().st_mode) == 0o700
        assert stat.S_IMODE(project.stat().st_mode) == 0o777  # the shared folder itself is its owner's to set
