"""The compiled half of the ``shm`` algorithm: ``shm_reduce.c``, built once per machine.

The library is compiled on first use into ``$RAPYDLI_HOME/comm/`` under a hash of the
source, the flags and the compiler, and loaded with ctypes (which releases the GIL for the
call, so a rank's communication thread and its caller never wait on each other here).
A call is described by a :class:`ReducePlan`, filled once per (tensor, op) and passed by
pointer: one foreign call with one argument is the whole per-call cost on the Python side.
"""

from __future__ import annotations

import ctypes
import hashlib
from functools import cache
from pathlib import Path
from typing import Any

import torch

from rapydli.native import compile_library, compiler_version
from rapydli.paths import home

SOURCE = Path(__file__).with_name("shm_reduce.c")
FLAGS = ("-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11")

#: Operation codes of ``shm_reduce.c``.
OP_CODES = {"sum": 0, "avg": 1, "max": 2, "min": 3}
#: dtype codes of ``shm_reduce.c`` (every dtype the communicator supports).
DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.int32: 4,
    torch.int64: 5,
    torch.int16: 6,
    torch.int8: 7,
    torch.uint8: 8,
}


class ReducePlan(ctypes.Structure):
    """One prepared allreduce: the ``plan_t`` of ``shm_reduce.c``."""

    _fields_ = [
        ("bases", ctypes.POINTER(ctypes.c_void_p)),
        ("seq", ctypes.POINTER(ctypes.c_uint64)),
        ("buf", ctypes.c_void_p),
        ("count", ctypes.c_int64),
        ("slot_bytes", ctypes.c_int64),
        ("size", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("dtype", ctypes.c_int32),
        ("op", ctypes.c_int32),
        ("polite", ctypes.c_int32),
    ]


def library_path() -> Path:
    """Where the compiled library is (or will be) cached."""
    key = hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, compiler_version())).encode()).hexdigest()[:20]
    return home() / "comm" / f"shm_reduce-{key}.so"


@cache
def allreduce_function() -> Any:
    """``rd_shm_allreduce(plan_t *)``, compiled if needed (raises :class:`rapydli.native.CompileError`)."""
    library = ctypes.CDLL(str(compile_library(SOURCE, library_path(), FLAGS)))
    function = library.rd_shm_allreduce
    function.argtypes = [ctypes.POINTER(ReducePlan)]
    function.restype = ctypes.c_int
    return function
