"""Compiling a C source into a shared library once, atomically, for every process of a machine.

Used by the autotuner (kernel instances from ``kernels/``) and by the communicator
(:mod:`rapydli.comm.native`). A library is written under a temporary name and renamed into
place, so ranks or engines compiling the same library at once do not clash, and a second
process loads what the first compiled.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from rapydli.errors import RapydliError


class CompileError(RapydliError):
    """A C source failed to compile (the compiler's message is attached)."""


def find_compiler() -> str | None:
    """The C compiler (``$CC`` or ``cc``), or None when the machine has none."""
    return shutil.which(os.environ.get("CC", "cc"))


def compiler_version(cc: str | None = None) -> str:
    """First line of ``cc --version`` (the compiler from ``$CC`` or ``cc``), "" if absent."""
    path = shutil.which(cc or os.environ.get("CC", "cc"))
    if not path:
        return ""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.splitlines()[0] if out.stdout else ""


def compile_library(source: Path, target: Path, args: Sequence[str]) -> Path:
    """Compile ``source`` with ``args`` into ``target`` unless it exists; return ``target``."""
    if target.exists():
        return target
    cc = find_compiler()
    if cc is None:
        raise CompileError("no C compiler found ($CC or cc)")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cc, *args, str(source), "-o", tmp]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise CompileError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
