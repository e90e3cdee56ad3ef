"""Parameter spaces: enumeration, pruning counts, and constraints checked as early as possible."""

from __future__ import annotations

import pytest

from rapydli.autotune.space import Space
from rapydli.errors import ConfigError


def known_space() -> Space:
    space = Space({"a": [1, 2, 3, 4], "b": [1, 2, 4, 8], "c": ["x", "y"]})
    space.hard(lambda a, b: a * b <= 8, "registers")  # removes (2,8) (3,4) (3,8) (4,4) (4,8)
    space.soft(lambda c, a: c == "x" or a == 1, "y only with a == 1")
    return space


def test_counts_on_a_known_space() -> None:
    space = known_space()
    assert space.total() == 32
    # 16 (a, b) pairs, 5 fail a*b <= 8 -> 11 pairs x 2 values of c
    counts = space.counts()
    assert counts == {"total": 32, "after_hard": 22, "after_soft": 11 + 4}
    configs = space.configs()
    assert len(configs) == 15
    assert all(cfg["a"] * cfg["b"] <= 8 for cfg in configs)
    assert {(cfg["a"], cfg["c"]) for cfg in configs if cfg["c"] == "y"} == {(1, "y")}
    assert configs[0] == {"a": 1, "b": 1, "c": "x"}  # domain order


def test_constraint_records_the_parameters_it_reads() -> None:
    space = known_space()
    assert [c.reads for c in space.constraints] == [("a", "b"), ("c", "a")]
    assert [c.kind for c in space.constraints] == ["hard", "soft"]


def test_constraints_are_checked_as_soon_as_their_parameters_are_bound() -> None:
    calls: list[tuple] = []
    space = Space({"a": list(range(10)), "b": list(range(10)), "c": list(range(10))})

    def only_small_a(a: int) -> bool:
        calls.append((a,))
        return a < 2

    space.hard(only_small_a)
    assert len(space.configs()) == 2 * 10 * 10
    # checked once per value of a (10 calls), not once per point of the product (1000)
    assert len(calls) == 10
    assert space.evaluations == 10


def test_pruned_prefix_is_never_extended() -> None:
    seen_b: list[int] = []
    space = Space({"a": [0, 1], "b": [0, 1, 2]})
    space.hard(lambda a: a == 1)

    def record(b: int) -> bool:
        seen_b.append(b)
        return True

    space.soft(record)
    space.configs()
    assert seen_b == [0, 1, 2]  # only under a == 1


def test_bad_spaces_and_constraints_fail_with_config_error() -> None:
    with pytest.raises(ConfigError, match="empty domain"):
        Space({"a": []})
    space = Space({"a": [1]})
    with pytest.raises(ConfigError, match="unknown parameters"):
        space.hard(lambda z: True)


def test_generated_kernel_space_is_pruned_by_device_and_problem() -> None:
    from dataclasses import replace

    from rapydli.autotune.device import query
    from rapydli.autotune.generated import CDirect
    from rapydli.autotune.problem import ConvShape

    device = query()
    avx2 = replace(device, isa="avx2", vector_lanes=8, vector_registers=16)
    shape = ConvShape(1, 64, 8, 8, 64, 3, 3, pad=1)
    full = CDirect().space(shape, avx2, "full")
    counts = full.counts()
    assert counts["total"] == 2 * 2 * 5 * 4 * 3 * 3 * 3 * 2 * 2 * 4
    assert counts["after_soft"] < counts["after_hard"] < counts["total"]
    configs = full.configs()
    assert all(c["vec"] <= 8 for c in configs)  # AVX2: 8 lanes
    assert all(
        c["kb"] * c["wb"] + (max(c["kb"], c["wb"]) if c["pack"] or c["algo"] else c["wb"]) + 1 <= 16 for c in configs
    )  # 16 registers
    assert {c["pack"] for c in configs if c["layout"] == 1} == {0, 1}  # NHWC: vectors over C or over K
    assert all(c["wb"] == 1 for c in configs if c["layout"] == 0)  # NCHW ignores wb
    winograd = [c for c in configs if c["algo"]]
    assert winograd and all(c["layout"] == 1 and c["pack"] == 0 and c["wb"] <= c["tb"] for c in winograd)
    assert {c["tb"] for c in configs if not c["algo"]} == {8}  # the direct forward ignores tb
    stride2 = CDirect().space(ConvShape(1, 64, 8, 8, 64, 3, 3, stride=2, pad=1), avx2, "full")
    assert not any(c["algo"] for c in stride2.configs())  # Winograd F(2x2,3x3): 3x3 stride 1 only
    assert not any(c["algo"] for c in CDirect().space(ConvShape(1, 64, 8, 8, 64, 1, 1), avx2, "full").configs())
    small = CDirect().space(ConvShape(1, 3, 8, 8, 2, 3, 3), avx2, "full")
    assert all(c["kb"] <= 2 for c in small.configs() if not c["pack"])  # kb <= K
    assert all(c["kb"] == 1 for c in small.configs() if c["pack"])  # packed: one vector covers K = 2
