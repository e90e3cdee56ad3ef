"""rapydli.comm.Communicator: every algorithm against MPI.Allreduce on real ranks.

Many checks run in one ``mpiexec`` launch per world size, to keep the file fast.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rapydli.comm.base import algorithm_names, check_algorithm
from rapydli.comm.tensors import check_op, flat_view
from rapydli.errors import ConfigError


def test_bad_input_is_a_config_error_naming_the_argument() -> None:
    with pytest.raises(ConfigError, match="not contiguous"):
        flat_view(torch.zeros(4, 6).t())
    with pytest.raises(ConfigError, match="dtype"):
        flat_view(torch.zeros(3, dtype=torch.complex64))
    with pytest.raises(ConfigError, match="op='prod'.*sum, avg, max, min"):
        check_op("prod")
    with pytest.raises(ConfigError, match="algorithm='fastest'"):
        check_algorithm("fastest")
    assert {"mpi", "ring", "gloo", "nccl", "auto", "shm"} <= set(algorithm_names())


def test_flat_view_shares_memory() -> None:
    tensor = torch.zeros(3, 4)
    flat_view(tensor)[5] = 7.0
    assert tensor[1, 1] == 7.0


CORRECTNESS = r"""
import json, os, sys
import numpy as np
import torch
from mpi4py import MPI
from rapydli.comm import Communicator
from rapydli.errors import ConfigError

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
SIZES = [0, 1, 2, 3, 7, 13, 97, 10007] + ([1000003] if n == 2 else [])
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
NP = {torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}

comm = Communicator(algorithm="ring")
# auto decides from a (small, quick) measurement cached under $RAPYDLI_HOME; shm's compiled
# path is offered only up to its size limit (lowered here to see that)
from rapydli.comm import auto as auto_module
auto_module.COMPILED_MAX_BYTES = 1024
table = comm.tune(max_bytes=1 << 16)
auto_module.COMPILED_MAX_BYTES = 1 << 20
assert table.path and os.path.exists(table.path), table.path
assert set(table.choices) <= {"mpi", "ring", "shm"} and len(table.choices) == len(table.sizes)
assert set(table.times) == {"mpi", "ring", "shm"}  # every rank shares this node: shm is measured too
for nbytes, shm_time, choice in zip(table.sizes, table.times["shm"], table.choices):
    assert (shm_time is None) == (nbytes > 1024) and (choice != "shm" or nbytes <= 1024), (nbytes, shm_time, choice)
cached = json.load(open(table.path))
assert cached["key"]["world_size"] == n and cached["choices"] == table.choices

def reference(x, op):
    # MPI.Allreduce on the same input (half types have no MPI type: reduce them as float64)
    if x.dtype in (torch.float16, torch.bfloat16):
        wide = x.double().numpy().copy()
    else:
        wide = x.numpy().copy()
    out = np.empty_like(wide)
    world.Allreduce(wide, out, op=MPI_OP[op])
    out = torch.from_numpy(out)
    if op == "avg":
        out = out / n if x.is_floating_point() else torch.div(out, n, rounding_mode="floor")
    return out

def check(got, want, x, what):
    if x.is_floating_point():
        tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(x.dtype, 1e-6)
        ok = torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
        if x.dtype in (torch.float16, torch.bfloat16):
            # same result as reducing in wide precision and rounding once, within one ulp per add
            ok = ok and got.dtype == x.dtype
    else:
        ok = torch.equal(got, want.to(x.dtype))
    assert ok, (what, (got.double() - want.double()).abs().max())

checks = 0
for algorithm in ["mpi", "ring", "shm", "auto", "gloo"]:
    for dtype in DTYPES:
        for size in SIZES:
            g = torch.Generator().manual_seed(1000 * rank + size)
            if dtype.is_floating_point:
                x = torch.randn(size, generator=g).to(dtype)
            else:
                x = torch.randint(-1000, 1000, (size,), generator=g, dtype=dtype)
            for op in ["sum", "avg", "max", "min"]:
                want = reference(x, op)
                blocking = x.clone()
                assert comm.allreduce_(blocking, op=op, algorithm=algorithm) is blocking
                check(blocking, want, x, (algorithm, dtype, size, op, "allreduce_"))
                checks += 1
        # several outstanding iallreduce_ at once, waited in order; shapes are kept
        inputs = [torch.arange(s, dtype=torch.float64).to(dtype).reshape(-1, 1) + rank for s in (5, 0, 10007)]
        outs = [t.clone() for t in inputs]
        handles = [comm.iallreduce_(t, op="sum", algorithm=algorithm) for t in outs]
        for handle, t, x in zip(handles, outs, inputs):
            assert handle.wait() is t and handle.test()
            check(t.view(-1), reference(x.view(-1).contiguous(), "sum"), x, (algorithm, dtype, "iallreduce_"))
            checks += 1

# repeated allreduce_ of one buffer takes the cached fast path; it must notice changed memory
from rapydli.comm.ring import RingAlgorithm
for algorithm in ("mpi", "auto", "ring", "shm"):
    t = torch.zeros(2, 50)
    for i in range(3):
        t.fill_(rank + i)
        assert comm.allreduce_(t, op="avg", algorithm=algorithm) is t
        assert torch.all(t == (n - 1) / 2 + i), (algorithm, i)
        checks += 1
    t.set_(torch.full((7,), float(rank + 1)))  # same tensor object, new memory and size
    comm.allreduce_(t, op="sum", algorithm=algorithm)
    assert torch.all(t == n * (n + 1) / 2), algorithm
    t.resize_(3)
    t.fill_(1.0)
    comm.allreduce_(t, op="sum", algorithm=algorithm)
    assert t.shape == (3,) and torch.all(t == n), algorithm
    # same memory and size, transposed in place: refused, not reduced through the old plan
    square = torch.zeros(2, 3)
    comm.allreduce_(square, op="sum", algorithm=algorithm)
    square.t_()
    try:
        comm.allreduce_(square, op="sum", algorithm=algorithm)
    except ConfigError as error:
        assert "contiguous" in str(error)
    else:
        raise AssertionError("a tensor made non-contiguous in place was reduced")
    checks += 3

# the ring's prepared plan (views over the tensor's address, laid out once): every dtype, op
# and awkward size, reduced again and again in the same tensor
for dtype in DTYPES:
    for size in (1, 2, 7, 10007):
        g = torch.Generator().manual_seed(31 * rank + size)
        x = torch.randn(size, generator=g).mul(1 if dtype.is_floating_point else 100).to(dtype)
        for op in ("sum", "avg", "max", "min"):
            again = x.clone()
            for repeat in range(3):  # the first call plans, the next ones run the plan
                again.copy_(x)
                comm.allreduce_(again, op=op, algorithm="ring")
                check(again, reference(x, op), x, ("ring prepared", dtype, size, op, repeat))
            assert (id(again), op, "ring") in comm._plans, (dtype, size, op)
            checks += 1

# the ring's pipeline with many chunks per segment (tiny chunks), every op
tiny_ring = RingAlgorithm(world, chunk_bytes=12)
for dtype in (torch.float32, torch.bfloat16, torch.int64):
    for size in (1, 13, 1001):
        g = torch.Generator().manual_seed(7 * rank + size)
        x = torch.randn(size, generator=g).mul(1 if dtype.is_floating_point else 100).to(dtype)
        for op in ("sum", "max", "min"):
            got = x.clone()
            tiny_ring.allreduce_(got, op)
            check(got, reference(x, op), x, ("ring chunk_bytes=12", dtype, size, op))
            checks += 1

# broadcast_: from a non-zero root, every dtype, tensor shapes kept
for dtype in DTYPES:
    t = (torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) * (rank + 1)).to(dtype)
    comm.broadcast_(t, root=n - 1)
    assert torch.equal(t, (torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) * n).to(dtype)), dtype
    checks += 1

# non-contiguous input: a clear ConfigError, nothing sent (all ranks raise alike)
for call in (comm.allreduce_, comm.iallreduce_, comm.broadcast_):
    try:
        call(torch.zeros(4, 6).t())
    except ConfigError as error:
        assert "contiguous" in str(error)
    else:
        raise AssertionError("non-contiguous input accepted")
try:
    comm.allreduce_(torch.zeros(3), op="prod")
except ConfigError as error:
    assert "op='prod'" in str(error)

# auto follows its table: force every size to ring, to shm, then to mpi
auto = comm._get("auto")
for forced in ("ring", "shm", "mpi"):
    table.choices = [forced] * len(table.sizes)
    comm._plans.clear()
    t = torch.full((1000,), float(rank))
    handle = comm.iallreduce_(t, op="avg", algorithm="auto")
    handle.wait()
    assert handle.algorithm == forced and auto[0].choose(torch.ones(10)) == forced
    assert torch.all(t == (n - 1) / 2), forced  # divided once, whoever divides
    for repeat in range(2):  # the fast path divides only when the chosen algorithm did not
        t.fill_(float(rank))
        comm.allreduce_(t, op="avg", algorithm="auto")
        assert torch.all(t == (n - 1) / 2), (forced, repeat)
    if forced == "shm":  # above its limit the compiled path is not used, whatever the table says
        assert auto[0].choose(torch.empty(auto_module.COMPILED_MAX_BYTES // 4 + 1)) == "mpi"
    # half precision goes to ring where the table says mpi (MPI has no type for it)
    assert auto[0].choose(torch.ones(10, dtype=torch.bfloat16)) == ("ring" if forced == "mpi" else forced)

comm.barrier()
comm.close()
print(f"OK rank {rank} checks {checks}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_every_algorithm_equals_mpi_allreduce(run_mpi, n: int) -> None:
    result = run_mpi(CORRECTNESS, n=n, timeout=240)
    for rank in range(n):
        assert f"OK rank {rank} checks" in result.stdout, result.stdout + result.stderr


SHARED = r"""
import glob, hashlib, os
import numpy as np
import torch
from mpi4py import MPI
from rapydli.comm import Communicator
from rapydli.comm import shm
from rapydli.errors import ConfigError

world = MPI.COMM_WORLD
rank, n = world.Get_rank(), world.Get_size()
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
MPI_OP = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
before = set(glob.glob(os.path.join(shm.SHM_DIR, "rapydli-*")))

def reference(x, op):
    wide = x.double().numpy().copy() if x.dtype in (torch.float16, torch.bfloat16) else x.numpy().copy()
    out = np.empty_like(wide)
    world.Allreduce(wide, out, op=MPI_OP[op])
    out = torch.from_numpy(out)
    if op == "avg":
        out = out / n if x.is_floating_point() else torch.div(out, n, rounding_mode="floor")
    return out.to(x.dtype)

def same_everywhere(t):
    digest = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return len(set(world.allgather(hashlib.sha1(digest).hexdigest()))) == 1

comm = Communicator(algorithm="auto")
checks = 0
for dtype in DTYPES:
    for size in (0, 1, 2, 3, 7, 13, 10007):
        buf = comm.host_buffer(size, dtype)
        assert buf.shape == (size,) and buf.dtype == dtype and not buf.any()
        assert comm._shared.available and (comm._shared.views(buf) is not None) == (size > 0)
        for op in ("sum", "avg", "max", "min"):
            for repeat in range(2):  # the same buffer again, as gradient buckets are
                g = torch.Generator().manual_seed(1000 * rank + 10 * size + repeat)
                x = torch.randn(size, generator=g).mul(1 if dtype.is_floating_point else 100).to(dtype)
                buf.copy_(x)
                assert comm.allreduce_(buf, op=op) is buf
                want = reference(x, op)
                tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6) if dtype.is_floating_point else 0
                assert torch.allclose(buf.double(), want.double(), rtol=tol, atol=tol), (dtype, size, op)
                assert same_everywhere(buf), (dtype, size, op)   # each element reduced once, by its owner
                checks += 1

# auto sends whole shared buffers to shm, on the communication thread too; several at once
bufs = [comm.host_buffer(s) for s in (5, 100003, 64)]
for b, buf in enumerate(bufs):
    buf.fill_(rank + b)
handles = [comm.iallreduce_(buf, op="sum") for buf in bufs]
for b, (handle, buf) in enumerate(zip(handles, bufs)):
    assert handle.wait() is buf and handle.algorithm == "shm"
    assert torch.all(buf == sum(r + b for r in range(n))), b
    checks += 1
# a slice of a shared buffer, or another algorithm by name: reduced as any tensor
big = bufs[1]
big.fill_(1.0)
part = big[10:20]
comm.allreduce_(part, op="sum")
assert torch.all(big[10:20] == n) and torch.all(big[:10] == 1) and torch.all(big[20:] == 1)
for algorithm in ("mpi", "ring"):
    big.fill_(rank)
    handle = comm.iallreduce_(big, op="sum", algorithm=algorithm)
    assert handle.wait() is big and handle.algorithm == algorithm and torch.all(big == n * (n - 1) / 2)
    checks += 1

# any other tensor goes through the compiled slots, in chunks of SLOT_BYTES: every rank ends
# with the same bits, on the caller's thread and on the (polite) communication thread
for dtype in DTYPES:
    for size in (1, 5, shm.SLOT_BYTES // 2 + 3, 2 * shm.SLOT_BYTES + 1):  # 1-9 chunks
        g = torch.Generator().manual_seed(77 * rank + size)
        x = torch.randn(size, generator=g).mul(1 if dtype.is_floating_point else 100).to(dtype)
        for op in ("sum", "avg", "max", "min"):
            got = x.clone()
            comm.allreduce_(got, op=op, algorithm="shm")
            tol = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}.get(dtype, 1e-6) if dtype.is_floating_point else 0
            assert torch.allclose(got.double(), reference(x, op).double(), rtol=tol, atol=tol), (dtype, size, op)
            assert same_everywhere(got), (dtype, size, op)
            checks += 1
outs = [torch.full((s,), float(rank + 1)) for s in (3, 70001, 9)]
handles = [comm.iallreduce_(t, op="sum", algorithm="shm") for t in outs]
assert all(h.wait() is t and h.algorithm == "shm" and torch.all(t == n * (n + 1) / 2) for h, t in zip(handles, outs))

# buffers must match on every rank
try:
    comm.host_buffer(10 + rank)
except ConfigError as error:
    assert "same numel" in str(error)
else:
    raise AssertionError("different sizes accepted")

# nothing is left in /dev/shm: rank 0 unlinks each file once every rank has mapped it
world.Barrier()
assert set(glob.glob(os.path.join(shm.SHM_DIR, "rapydli-*"))) <= before
comm.close()
# the mapping outlives the communicator: the tensors stay readable
assert torch.all(bufs[0] == sum(r for r in range(n)))

# one rank cannot map rank 0's file (a /dev/shm of its own): every rank falls back alike
comm = Communicator(algorithm="auto")
if rank == 1:
    real_mmap = shm.mmap.mmap
    def refuse(*args, **kwargs):
        raise OSError("no such file")
    shm.mmap.mmap = refuse
buf = comm.host_buffer(1001)
if rank == 1:
    shm.mmap.mmap = real_mmap
assert not comm._shared.available and comm._shared.views(buf) is None
buf.fill_(rank + 1)
assert comm.allreduce_(buf, op="sum") is buf and torch.all(buf == n * (n + 1) / 2)
assert comm._shared.views(comm.host_buffer(64)) is None   # later buffers too
comm.close()
world.Barrier()
assert set(glob.glob(os.path.join(shm.SHM_DIR, "rapydli-*"))) <= before

# no shared memory (e.g. ranks on several nodes): ordinary memory, same results
shm.SHM_DIR = "/nonexistent-rapydli-shm"
comm = Communicator(algorithm="auto")
buf = comm.host_buffer(1001)
assert not comm._shared.available and comm._shared.views(buf) is None
buf.fill_(rank + 1)
handle = comm.iallreduce_(buf, op="avg")
assert handle.wait() is buf and handle.algorithm != "shm" and torch.all(buf == (n + 1) / 2)
assert "shm" not in comm._get("auto")[0].candidates  # auto does not offer it, whatever its table says
try:
    comm.allreduce_(torch.ones(3), algorithm="shm")
except ConfigError as error:
    assert "one node" in str(error) and "'mpi'" in str(error)
else:
    raise AssertionError("shm ran without shared memory")
comm.close()

# one rank (COMM_SELF): nothing to exchange, the tensor stays as it is
solo = Communicator(MPI.COMM_SELF, algorithm="shm")
t = torch.arange(5.0)
for op in ("sum", "avg", "max"):
    assert torch.equal(solo.allreduce_(t, op=op), torch.arange(5.0)), op
solo.close()
print(f"SHARED OK rank {rank} checks {checks}", flush=True)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 3])
def test_shared_host_buffers_reduce_through_shared_memory(run_mpi, n: int) -> None:
    result = run_mpi(SHARED, n=n, timeout=240)
    assert result.stdout.count("SHARED OK rank") == n, result.stdout + result.stderr


PROGRESS = r"""
import time
import torch
from mpi4py import MPI
from rapydli.comm import Communicator

import os
import tempfile

for wait_mode in ("polite", "spin"):   # how the communication thread waits (RAPYDLI_COMM_WAIT)
    os.environ["RAPYDLI_COMM_WAIT"] = wait_mode
    comm = Communicator(algorithm="mpi")
    assert comm.progress == "thread", comm.progress   # mpi4py initialises THREAD_MULTIPLE
    assert comm.polite == (wait_mode == "polite")
    for algorithm in ("mpi", "ring", "shm"):
        t = torch.full((4 << 20,), float(comm.rank + 1))
        handle = comm.iallreduce_(t, op="avg", algorithm=algorithm)
        # no MPI call on this thread: only the communication thread can complete the collective
        deadline = time.monotonic() + 60
        while not handle.test():
            assert time.monotonic() < deadline, "iallreduce_ made no progress without wait()"
            time.sleep(0.01)
        assert handle.finished is not None and handle.duration > 0
        assert torch.all(t == (comm.world_size + 1) / 2)
    comm.close()

# a polite thread spins once the caller blocks on the result
from rapydli.comm.waiting import Pace
pace = Pace(polite=True)
assert not pace.urgent
with pace.waiting():
    assert pace.urgent
assert not pace.urgent and Pace(polite=False).urgent

# with measuring switched off and no cache, auto falls back to MPI's own allreduce
os.environ["RAPYDLI_COMM_AUTOTUNE"] = "0"
os.environ["RAPYDLI_HOME"] = MPI.COMM_WORLD.bcast(tempfile.mkdtemp() if MPI.COMM_WORLD.rank == 0 else None)
comm = Communicator(algorithm="auto")
assert comm.auto_table.source == "fallback" and comm.auto_table.sizes == []
t = torch.ones(1 << 20)
assert comm.iallreduce_(t).wait() is t and torch.all(t == comm.world_size)
assert comm._get("auto")[0].choose(t) == "mpi"
comm.close()
print(f"PROGRESS rank {comm.rank}", flush=True)
"""


@pytest.mark.mpi
def test_iallreduce_progresses_without_wait(run_mpi) -> None:
    result = run_mpi(PROGRESS, n=2, timeout=120)
    assert result.stdout.count("PROGRESS rank") == 2


def test_auto_table_picks_nearest_measured_size(tmp_path, monkeypatch) -> None:
    from rapydli.comm import auto

    table = auto.AutoTable(key={"world_size": 2}, sizes=[4, 1024, 1 << 20], choices=["mpi", "mpi", "ring"])
    assert table.pick(1) == "mpi" and table.pick(900) == "mpi"
    assert table.pick(600 << 10) == "ring" and table.pick(1 << 30) == "ring"
    assert auto.AutoTable(key={}).pick(1 << 20) == "mpi"  # fallback before any measurement
    # ring replaces the default only when clearly faster (noise does not flip ties)
    assert auto._fastest(("mpi", "ring"), np.array([1.0, 0.99])) == "mpi"
    assert auto._fastest(("mpi", "ring"), np.array([1.0, 0.96])) == "mpi"  # within the 5 % margin: a tie
    assert auto._fastest(("mpi", "ring"), np.array([1.0, 0.93])) == "ring"
    assert auto._fastest(("mpi", "ring"), np.array([1.0, 0.8])) == "ring"
    monkeypatch.setenv("RAPYDLI_HOME", str(tmp_path))
    path = auto.save(table)
    assert path.parent == tmp_path / "comm"
    assert auto.load(table.key).choices == table.choices
    assert auto.load({"world_size": 3}) is None
    assert json.loads(path.read_text())["sizes"] == [4, 1024, 1 << 20]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none on this machine)")
def test_gpu_tensors_use_nccl_or_host_staging(run_mpi) -> None:
    code = r"""
import torch
from rapydli.comm import Communicator
comm = Communicator(algorithm="ring")
t = torch.full((1001,), float(comm.rank + 1), device="cuda")
comm.allreduce_(t, op="sum")                        # ring: staged through host memory
assert t.is_cuda and torch.all(t == 3)
if torch.distributed.is_nccl_available() and torch.cuda.device_count() >= comm.world_size:
    comm.allreduce_(t, op="avg", algorithm="auto")  # auto picks nccl for CUDA tensors
    assert torch.all(t == 3)
print("GPU OK", flush=True)
"""
    result = run_mpi(code, n=2)
    assert result.stdout.count("GPU OK") == 2
