"""rapydli.parallel.schedules: GPipe and 1F1B checked as data."""

from __future__ import annotations

import itertools

import pytest

from rapydli.errors import ConfigError
from rapydli.parallel import schedules
from rapydli.parallel.schedules import (
    Action,
    bubble_fraction,
    build,
    peak_live,
    simulate,
)

GRID = list(itertools.product(schedules.SCHEDULES, (1, 2, 3, 4), (1, 2, 3, 4, 8)))


@pytest.mark.parametrize(("name", "p", "m"), GRID)
def test_every_stage_runs_each_microbatch_once_and_every_message_is_matched(name: str, p: int, m: int) -> None:
    schedule = build(name, p, m)
    assert len(schedule) == p
    for s, actions in enumerate(schedule):
        kinds = [a.kind for a in actions]
        assert sorted(a.microbatch for a in actions if a.kind == "forward") == list(range(m))
        assert sorted(a.microbatch for a in actions if a.kind == "backward") == list(range(m))
        assert kinds.count("recv_activation") == (m if s > 0 else 0)
        assert kinds.count("send_gradient") == (m if s > 0 else 0)
        assert kinds.count("send_activation") == (m if s < p - 1 else 0)
        assert kinds.count("recv_gradient") == (m if s < p - 1 else 0)
    # every send has its receive on the neighbour, in the same order (MPI matches in order per tag)
    for s in range(p - 1):
        sent = [a.microbatch for a in schedule[s] if a.kind == "send_activation"]
        assert sent == [a.microbatch for a in schedule[s + 1] if a.kind == "recv_activation"]
        sent_back = [a.microbatch for a in schedule[s + 1] if a.kind == "send_gradient"]
        assert sent_back == [a.microbatch for a in schedule[s] if a.kind == "recv_gradient"]


@pytest.mark.parametrize(("name", "p", "m"), GRID)
def test_dependencies_are_respected_and_nothing_deadlocks(name: str, p: int, m: int) -> None:
    simulate(build(name, p, m), 1.0, 2.0)  # raises on a dependency broken or a deadlock


def test_simulation_catches_a_broken_schedule() -> None:
    broken = build("gpipe", 2, 2)
    broken[1] = [Action("forward", 0)] + broken[1]  # forward before the activation arrived
    with pytest.raises(ConfigError, match="before recv_activation"):
        simulate(broken, 1.0, 1.0)
    swapped = build("1f1b", 2, 2)
    swapped[0] = [a for a in swapped[0] if a.kind != "send_activation"]  # stage 1 waits forever
    with pytest.raises(ConfigError, match=r"deadlocks: stage 0 at recv_gradient\(0\); stage 1 at recv_activation\(0\)"):
        simulate(swapped, 1.0, 1.0)


@pytest.mark.parametrize(("p", "m"), list(itertools.product((1, 2, 3, 4), (1, 2, 4, 8))))
def test_1f1b_keeps_at_most_stages_minus_index_microbatches_alive_gpipe_keeps_all(p: int, m: int) -> None:
    for s, actions in enumerate(build("1f1b", p, m)):
        assert peak_live(actions) == min(p - s, m)
    for actions in build("gpipe", p, m):
        assert peak_live(actions) == m


@pytest.mark.parametrize(("name", "p", "m"), GRID)
@pytest.mark.parametrize(("t_f", "t_b"), [(1.0, 1.0), (1.0, 2.0), (0.5, 3.0)])
def test_unit_cost_pipeline_takes_m_plus_p_minus_1_steps(name: str, p: int, m: int, t_f: float, t_b: float) -> None:
    sim = simulate(build(name, p, m), t_f, t_b)
    assert sim.makespan == pytest.approx((m + p - 1) * (t_f + t_b))
    for s in range(p):
        assert sim.idle_fraction(s) == pytest.approx(bubble_fraction(p, m))


def test_bad_names_and_sizes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="pipeline_schedule='zb'.*1f1b, gpipe"):
        build("zb", 2, 2)
    with pytest.raises(ConfigError, match="microbatches=0"):
        build("gpipe", 2, 0)
