"""The per-rank half of ``rapydli bench allreduce``: run under ``mpiexec -n N``.

First measures ``mpi`` against ``ring`` for ``auto`` and caches it (the measurement
``auto`` then uses), then times, per message size, interleaved rep by rep (in a fresh
random order every rep, the same on every rank) so every algorithm sees the same machine noise: ``ring``, ``mpi``, ``shm``
(left out where the ranks do not share a node), ``auto`` (through
:class:`~rapydli.comm.Communicator`, on torch float32 tensors), mpi4py's own
``Allreduce`` on a numpy array (``mpi4py``: the MPI library with no RaPyDLI code in the
way) and torch.distributed ``gloo`` (in a block of its own after the others: its TCP
threads slow down whichever MPI call follows it). Every call gets the same harness work:
refill the buffer, barrier, timed call. Every algorithm reduces the same memory: one
numpy-allocated buffer per size (:func:`rapydli.comm.tensors.host_zeros`, as the gradient
buckets are), which mpi4py sees as a numpy array and the others as a torch tensor, so no
column gets other pages (or a warmer cache) than another.
A rep's time is the slowest rank's; the row holds
the median over reps, the minimum (the algorithm when its ranks had their cores) and every
rep's time (the bench pairs algorithms rep by rep). Rank 0 writes the rows as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
from mpi4py import MPI

from rapydli.comm import Communicator
from rapydli.comm.auto import message_sizes
from rapydli.comm.tensors import host_zeros

ALGORITHMS = ("ring", "mpi", "shm", "auto", "mpi4py", "gloo")


#: Fewest timed reps at any size. With 3 (as before) a 16 MiB row was the median of 3 calls
#: on a 2-core machine, and the same MPI call measured 30-45 % apart in two columns of one run.
MIN_REPS = 10


def repetitions(nbytes: int, max_reps: int = 200) -> int:
    """Timed reps per size: more for latency-bound sizes (at least ``MIN_REPS`` unless ``max_reps`` is lower)."""
    return min(max_reps, max(MIN_REPS, int(64e6 / max(nbytes, 1))))


def _time_one(call: Callable[[], object], tensor: torch.Tensor, times: np.ndarray, rep: int, world: MPI.Comm) -> None:
    """Time one ``call`` into ``times[rep]``, the same harness work for every algorithm."""
    tensor.fill_(1.0)  # every call finds the buffer equally warm
    world.Barrier()
    started = time.perf_counter()
    call()
    times[rep] = time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--min-bytes", type=int, default=4)
    parser.add_argument("--max-bytes", type=int, default=256 << 20)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--max-reps", type=int, default=200)
    args = parser.parse_args()
    names = [name for name in args.algorithms.split(",") if name]
    world = MPI.COMM_WORLD
    n = world.Get_size()

    comm = Communicator(algorithm="mpi")
    tune_started = time.perf_counter()
    table = comm.tune(max_bytes=args.max_bytes, force=True)  # the measurement auto decides by
    tune_seconds = time.perf_counter() - tune_started
    if "gloo" in names:
        comm._get("gloo")  # process group set up before timing
    if "shm" in names and not comm._get("shm")[0].usable:
        names.remove("shm")  # ranks on several nodes (or no compiler): every rank alike

    rows = []
    for nbytes in [size for size in message_sizes(args.max_bytes) if size >= args.min_bytes]:
        count = max(1, nbytes // 4)
        tensor = host_zeros(count, torch.float32)  # numpy-allocated, as gradient buckets are
        array = tensor.numpy()  # the same memory, for mpi4py
        calls: dict[str, Callable[[], object]] = {
            "mpi4py": partial(world.Allreduce, MPI.IN_PLACE, array, op=MPI.SUM),
        }
        for name in names:
            if name != "mpi4py":
                calls[name] = partial(comm.allreduce_, tensor, algorithm=name)
        reps = repetitions(nbytes, args.max_reps)
        local = np.zeros((len(names), reps))
        interleaved = [i for i, name in enumerate(names) if name != "gloo"]
        for i in interleaved:  # warm-up
            calls[names[i]]()
            calls[names[i]]()
        order = np.random.default_rng(nbytes)  # the same seed on every rank: the same order everywhere
        for rep in range(reps):
            # a fresh order each rep, so every algorithm runs after every other one alike (a
            # rotation kept each one's predecessor: mpi ran right after ring's many messages)
            for i in order.permutation(interleaved):
                _time_one(calls[names[i]], tensor, local[i], rep, world)
        if "gloo" in names:
            # gloo's own TCP threads keep running after a call and slow the next MPI calls down
            # (measured: 2-4x at <= 1 KiB), so gloo gets a block of its own after the others
            i = names.index("gloo")
            calls["gloo"]()  # warm-up
            for rep in range(reps):
                _time_one(calls["gloo"], tensor, local[i], rep, world)
        slowest = np.empty_like(local)
        world.Allreduce(local, slowest, op=MPI.MAX)
        for i, name in enumerate(names):
            seconds, best = float(np.median(slowest[i])), float(np.min(slowest[i]))
            algbw = count * 4 / seconds / 1e9
            row = {
                "bytes": count * 4,
                "algorithm": name,
                "time_us": seconds * 1e6,
                "algbw_GBps": algbw,
                "busbw_GBps": algbw * 2 * (n - 1) / n,
                "min_time_us": best * 1e6,
                "min_busbw_GBps": count * 4 / best / 1e9 * 2 * (n - 1) / n,
                "reps": reps,
                "rep_times_us": [float(t) * 1e6 for t in slowest[i]],  # for ratios within each rep
            }
            if name == "auto":
                row["auto_picked"] = comm._get("auto")[0].choose(tensor)
            rows.append(row)
    if world.Get_rank() == 0:
        payload = {
            "ranks": n,
            "hosts": sorted(set(table.key["hosts"])),
            "rows": rows,
            "auto_table": {"path": table.path, "sizes": table.sizes, "choices": table.choices, "times": table.times},
            "tune_seconds": tune_seconds,
            "mpi_library": MPI.Get_library_version().strip().splitlines()[0],
            "thread_level": MPI.Query_thread(),
        }
        with open(args.out, "w") as handle:
            json.dump(payload, handle)
    comm.close()


if __name__ == "__main__":
    main()
