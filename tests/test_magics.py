"""%rapydli and %%distributed in a real IPython shell against real MPI engines."""

from __future__ import annotations

import _thread
import re
import threading
import time

import pytest
from IPython.core.error import UsageError
from IPython.utils.capture import capture_output
from processes import wait_until_gone

from rapydli.errors import RankFailure

pytestmark = pytest.mark.engines


@pytest.fixture(scope="module")
def ip(ipython_shell):
    shell = ipython_shell
    with capture_output():
        shell.run_line_magic("rapydli", "start -n 2")
    yield shell
    shell.run_line_magic("rapydli", "stop")
    assert not wait_until_gone(), "cluster stop left processes behind"


def cell(ip, code: str, line: str = ""):
    with capture_output() as captured:
        value = ip.run_cell_magic("distributed", line, code)
    return value, captured


def test_rank_and_world_size(ip):
    value, _ = cell(ip, "(rank, world_size, comm.Get_size(), str(device))", "--gather")
    assert value == [(0, 2, 2, "cpu"), (1, 2, 2, "cpu")]


def test_value_is_first_ranks_last_expression(ip):
    value, _ = cell(ip, "x = rank * 10\nx + 1")
    assert value == 1


def test_output_streamed_with_rank_prefix(ip):
    _, captured = cell(ip, "print('hello', rank)\nimport sys; print('warn', rank, file=sys.stderr)")
    assert "[rank 0] hello 0" in captured.stdout
    assert "[rank 1] hello 1" in captured.stdout
    assert "[rank 1] warn 1" in captured.stderr


def test_output_arrives_while_cell_runs(ip):
    """The first line must reach the notebook long before the cell ends."""
    from rapydli.cluster.job import Job

    seen: list[float] = []
    original = Job._emit_line

    def spy(self, rank, stream, line):
        if line.startswith("early"):
            seen.append(time.monotonic())
        original(self, rank, stream, line)

    Job._emit_line = spy
    try:
        start = time.monotonic()
        cell(ip, "import time\nprint('early', rank, flush=True)\ntime.sleep(3)")
        end = time.monotonic()
    finally:
        Job._emit_line = original
    assert len(seen) == 2
    assert max(seen) - start < end - start - 1.5


def test_no_stream_prints_at_the_end_grouped(ip):
    _, captured = cell(ip, "print('a', rank)\nprint('b', rank)", "--no-stream")
    assert "[rank 0] a 0\nb 0" in captured.stdout
    assert "[rank 1] a 1\nb 1" in captured.stdout


def test_rich_output_only_from_first_rank(ip):
    _, captured = cell(ip, "from IPython.display import HTML, display\ndisplay(HTML(f'<b>rank {rank}</b>'))")
    html = [o.data.get("text/html") for o in captured.outputs]
    assert html == ["<b>rank 0</b>"]


def test_targets_select_ranks_and_their_communicator(ip):
    value, captured = cell(
        ip, "print('on', rank)\n(rank, world_size, world_rank, comm.Get_size())", "--targets 1 --gather"
    )
    assert value == [(0, 1, 1, 1)]  # rank within the selected group; world_rank in the cluster
    assert "[rank 1] on 0" in captured.stdout and "[rank 0]" not in captured.stdout
    value, _ = cell(ip, "(rank, world_rank)", "--gather")
    assert value == [(0, 0), (1, 1)]


def test_rd_train_reuses_the_cluster_started_by_the_magic(ip):
    """``rd.train`` after ``%rapydli start -n 2`` trains on those engines: no second cluster
    (controller, engines) is started while it runs, and the magic's cluster stays up."""
    import os

    import psutil

    import rapydli as rd
    from rapydli.cluster.processes import CLUSTER_MARKER, marked
    from rapydli.settings import HOME

    before = ip.run_line_magic("rapydli", "status")
    seen: set[str] = set()

    def clusters_now(row: dict) -> None:  # while training: the clusters whose processes run
        for proc in marked(also={HOME: os.environ[HOME]}):
            try:
                seen.add(proc.environ()[CLUSTER_MARKER])
            except psutil.Error:  # it ended meanwhile
                continue

    with capture_output() as captured:
        result = rd.train(
            "rapydli.zoo.models:mlp",
            "rapydli.zoo.datasets:digits",
            {"max_steps": 3, "batch_size": 16},
            callbacks=[clusters_now],
            progress=False,
            live=False,
        )
    assert len(result.history.query("kind == 'train'")) == 3
    assert seen == {before["cluster_id"]}, f"rd.train ran beside another cluster: {seen}"
    after = ip.run_line_magic("rapydli", "status")
    assert after["cluster_id"] == before["cluster_id"] and after["state"] == "running"
    assert "starting" not in captured.stdout


def test_distributed_uses_the_cluster_running_in_the_kernel(ip):
    """With the magics' own cluster stopped (cluster.stop(), not %rapydli stop), a cluster
    started in the kernel by rd.Cluster is the one the cell runs on: no second cluster."""
    import rapydli as rd

    magics = ip.magics_manager.registry["RapydliMagics"]
    magics._cluster.stop()
    other = rd.Cluster(n=2).start()
    value, captured = cell(ip, "world_size")
    assert value == 2 and "starting" not in captured.stdout
    assert magics.cluster is other


def test_push_sends_variables_and_functions(ip):
    ip.user_ns["scale"] = 3
    ip.user_ns["f"] = lambda v: v * 2
    value, _ = cell(ip, "f(scale) + rank", "--push scale,f --gather")
    assert value == [6, 7]


@pytest.mark.parametrize(
    "line, message",
    [
        ("--targets 0;import os", "--targets"),
        ("--targets 5", "out of range"),
        ("--bogus", "unrecognized"),
        ("--timeout -1", "--timeout"),
        ("--push nothere", "nothere"),
    ],
)
def test_bad_arguments_run_nothing(ip, line, message):
    cell(ip, "ran = 0")
    with pytest.raises(UsageError, match=message):
        ip.run_cell_magic("distributed", line, "ran = 1")
    value, _ = cell(ip, "ran", "--gather")
    assert value == [0, 0]


def test_exception_interrupts_other_ranks(ip):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        cell(ip, "import time\nif rank == 1:\n    raise ValueError('bad batch')\ntime.sleep(60)")
    assert time.monotonic() - start < 10
    assert info.value.ranks == [1]
    assert "ValueError: bad batch" in str(info.value)
    assert "rank 1 raised an exception" in str(info.value)
    value, _ = cell(ip, "rank", "--gather")  # interrupted, not aborted: the engines live on
    assert value == [0, 1]


def test_exception_while_others_block_in_a_collective(ip):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        cell(ip, "if rank == 0:\n    raise RuntimeError('rank 0 broke')\ncomm.barrier()")
    assert time.monotonic() - start < 10
    assert info.value.ranks == [0]
    assert "aborted" in str(info.value)
    # the abort stops the whole cluster: no engine, nanny (re-parented to init once its
    # engine is killed) or controller is left until the next cell
    assert not wait_until_gone(), "the abort left processes of the cluster behind"
    _, captured = cell(ip, "rank")  # the next cell brings fresh engines back
    assert "restarting" in captured.stdout


def test_dead_engine_fails_fast_and_restart_recovers(ip):
    start = time.monotonic()
    with pytest.raises(RankFailure) as info:
        cell(ip, "import os, time\nif rank == 1:\n    os._exit(3)\ntime.sleep(60)")
    assert time.monotonic() - start < 10
    assert info.value.ranks == [1]
    assert "died" in str(info.value)
    with capture_output():
        status = ip.run_line_magic("rapydli", "restart")
    assert status["engines_alive"] == 2 and status["state"] == "running"


def test_timeout_bounds_the_cell(ip):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="timed out after 1.5 s"):
        cell(ip, "import time\ntime.sleep(60)", "--timeout 1.5")
    assert time.monotonic() - start < 8


def test_keyboard_interrupt_reaches_engines(ip):
    threading.Timer(1.0, _thread.interrupt_main).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        cell(ip, "import time\ntime.sleep(60)")
    assert time.monotonic() - start < 6
    value, _ = cell(ip, "rank", "--gather")
    assert value == [0, 1]


def test_ctrl_c_ends_with_one_line_naming_the_ranks(ip):
    """What a user sees after Ctrl-C: no engine or library frames, no stray per-rank
    ``KeyboardInterrupt`` lines, and a last line saying which ranks were interrupted."""
    threading.Timer(1.0, _thread.interrupt_main).start()
    with capture_output() as captured:
        ip.run_cell("%%distributed\nimport time\ntime.sleep(60)")
    shown = captured.stdout + captured.stderr
    last = shown.rstrip().splitlines()[-1]
    # "ranks 0, 1 interrupted" (or, where a rank took over FOLLOW_S longer, "rank 1 blocked ... aborted")
    assert re.fullmatch(r"KeyboardInterrupt: Ctrl-C: ranks? [01](, 1)? \w.*", last), shown
    assert "0" in last and "1" in last
    for internal in (
        "ipyparallel",
        "concurrent/futures",
        "threading.py",
        "rapydli/magics.py",
        "rapydli/cluster/cluster.py",
    ):
        assert internal not in shown
    assert not [line for line in shown.splitlines() if line.startswith("[rank") and "KeyboardInterrupt" in line]
    value, _ = cell(ip, "rank", "--gather")
    assert value == [0, 1]


def test_status_and_second_start(ip):
    status = ip.run_line_magic("rapydli", "status")
    assert status["state"] == "running" and status["ranks"] == [0, 1] and status["launcher"] == "local"
    with capture_output() as captured:
        ip.run_line_magic("rapydli", "start -n 2")
    assert "reusing" in captured.stdout
    with pytest.raises(UsageError, match="already running"):
        ip.run_line_magic("rapydli", "start -n 3")


def test_bad_launcher_starts_nothing(ip):
    with pytest.raises(UsageError, match="allowed are"):
        ip.run_line_magic("rapydli", "stop") or ip.run_line_magic("rapydli", "start -n 2 --launcher nope")
    assert not wait_until_gone()  # the old cluster is gone and nothing new was started
    with capture_output():
        ip.run_line_magic("rapydli", "start -n 2")


@pytest.mark.parametrize("n", [0, -3])
def test_start_with_no_engines_is_refused_and_starts_nothing(n):
    from IPython.core.interactiveshell import InteractiveShell

    from rapydli.magics import RapydliMagics

    magics = RapydliMagics(InteractiveShell.instance())
    with pytest.raises(UsageError, match=f"-n {n} is invalid: must be >= 1"):
        magics.rapydli(f"start -n {n}")
    assert magics._cluster is None


def test_a_trailing_comment_is_not_an_argument():
    """The README writes `%rapydli start -n 2   # 2 MPI engines ...`; the comment is Python's, not the magic's."""
    from rapydli.magics import _strip_comment

    assert _strip_comment("start -n 2                  # 2 MPI engines (one MPI rank each)") == "start -n 2"
    assert _strip_comment("# only a comment") == ""
    assert (
        _strip_comment("start -n 2 --launcher ssh hosts=a#1 note='x # y'")
        == "start -n 2 --launcher ssh hosts=a#1 note='x # y'"
    )
