"""Code the collective-trace tests run on real MPI ranks (imported by the ranks' scripts)."""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from mpi4py import MPI

from rapydli.cluster import trace
from rapydli.comm import Communicator
from rapydli.parallel import wire


def record_some(directory: str) -> None:
    """Every traced kind once or twice on 2 ranks; rank 0 prints each rank's trace file path, a line
    each (two ranks printing at once could share a line of mpiexec's output)."""
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    path = trace.open_trace(directory, rank)
    comm = Communicator(algorithm="mpi")
    t = torch.ones(1024, dtype=torch.float64)
    comm.allreduce_(t)
    comm.allreduce_(t)  # the fast path (a repeated allreduce on the same buffer)
    comm.iallreduce_(torch.ones(16)).wait()
    comm.broadcast_(torch.zeros(8, dtype=torch.int64), root=0)
    comm.barrier()
    comm.ireduce_scatter_(torch.ones(8), torch.empty(4)).wait()
    alone = Communicator(world.Split(rank, 0), algorithm="mpi")
    alone.barrier()
    if rank == 0:
        requests = wire.isend(world, torch.ones(3, 5), 1, "activation", 0)
        wire.wait_all([r for r, _ in requests])
    else:
        wire.recv(world, 0, "activation", 0, torch.device("cpu"))
    comm.close()
    paths = world.gather(path, root=0)  # raw mpi4py: not traced
    if rank == 0:
        for each, written in enumerate(paths):
            print(json.dumps({"rank": each, "path": written}), flush=True)


def overhead(repeats: int = 7, calls: int = 2000) -> None:
    """Median and spread of one small allreduce_ (fast path) with and without the trace, and of begin+end alone."""
    world = MPI.COMM_WORLD
    comm = Communicator(algorithm="mpi")
    t = torch.ones(256)
    results: dict[str, list[float]] = {"allreduce_us_off": [], "allreduce_us_on": [], "begin_end_us": []}
    for repeat in range(2 * repeats):
        on = repeat % 2 == 1
        if on and not trace.recording():
            trace.open_trace(sys.argv[1], world.Get_rank())
        saved = list(trace._recorder)
        if not on:
            trace._recorder.clear()  # recording off for this round
        world.Barrier()
        start = time.perf_counter()
        for _ in range(calls):
            comm.allreduce_(t)
        elapsed = (time.perf_counter() - start) / calls * 1e6
        trace._recorder[:] = saved
        results["allreduce_us_on" if on else "allreduce_us_off"].append(elapsed)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            trace.end(trace.begin("allreduce", "world", 1024, "float32"))
        results["begin_end_us"].append((time.perf_counter() - start) / calls * 1e6)
    comm.close()
    if world.Get_rank() == 0:
        summary = {
            key: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
            for key, v in results.items()
        }
        print("OVERHEAD " + json.dumps(summary), flush=True)
