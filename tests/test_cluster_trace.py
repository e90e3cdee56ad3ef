"""The collective trace on real MPI ranks: what each rank records, and reading it from outside."""

from __future__ import annotations

import json
from pathlib import Path

from rapydli.cluster import trace

TESTS = Path(__file__).parent


def test_each_operation_is_recorded_in_order_with_group_bytes_and_dtype(run_mpi, tmp_path):
    code = f"import sys; sys.path.insert(0, {str(TESTS)!r}); import trace_cases; trace_cases.record_some({str(tmp_path)!r})"
    result = run_mpi(code, n=2)
    paths = {line["rank"]: line["path"] for line in map(json.loads, result.stdout.splitlines())}
    traces = {rank: trace.read_file(path) for rank, path in paths.items()}
    for rank, t in traces.items():
        assert t.rank == rank and t.waiting is None  # every operation ended
        kinds = [(r.kind, r.group, r.seq) for r in t.records]
        p2p = ("send", "world", 0) if rank == 0 else ("recv", "world", 0)
        assert kinds == [
            ("allreduce", "world", 0),
            ("allreduce", "world", 1),
            ("allreduce", "world", 2),
            ("broadcast", "world", 3),
            ("barrier", "world", 4),
            ("reduce_scatter", "world", 5),
            ("barrier", f"ranks {rank}", 0),
            p2p,
        ]
        first = t.records[0]
        assert (first.nbytes, first.dtype, first.peer) == (8192, "float64", -1)
        assert first.start <= first.end and all(r.end >= r.start > 0 for r in t.records)
        assert t.records[-1].peer == 1 - rank
    assert traces[0].records[-1].nbytes == 60  # 15 float32 sent
    assert traces[0].records[0].describe() == "allreduce #0 on world, 8 KiB float64"


def test_the_ring_keeps_the_last_operations(tmp_path, monkeypatch):
    monkeypatch.setattr(trace, "_recorder", [])
    trace.open_trace(tmp_path, 0)
    for _ in range(trace.CAPACITY + 5):
        trace.end(trace.begin("barrier", "world"))
    running = trace.begin("allreduce", "world", 4 << 20, "float32")
    t = trace.read_file(next(tmp_path.glob("*.trace")))
    assert t.count == trace.CAPACITY + 6 and len(t.records) == trace.CAPACITY
    assert t.waiting is not None and t.waiting.index == running
    assert t.waiting.describe() == f"allreduce #{trace.CAPACITY + 5} on world, 4 MiB float32"
    assert not trace.recording() or trace._recorder[0].map.close() is None


def test_overhead_is_measured(run_mpi, tmp_path, capsys):
    """Not an assertion on speed: the figures go to the report (pytest -s shows them)."""
    code = f"import sys; sys.argv.append({str(tmp_path)!r}); sys.path.insert(0, {str(TESTS)!r}); import trace_cases; trace_cases.overhead()"
    result = run_mpi(code, n=2, timeout=240)
    line = next(line for line in result.stdout.splitlines() if line.startswith("OVERHEAD "))
    figures = json.loads(line.removeprefix("OVERHEAD "))
    with capsys.disabled():
        print("\n" + line)
    assert set(figures) == {"allreduce_us_off", "allreduce_us_on", "begin_end_us"}
