"""Compiling kernel templates from ``kernels/`` into shared libraries, cached on disk.

Each instance of a template (one set of ``-D`` parameters) becomes one ``.so`` under
``$RAPYDLI_HOME/kernels/``, named by a hash of the template text, the parameters, the
flags and the compiler version, so a second tuning (or another rank on the same
machine) loads it instead of compiling. Writes are atomic (compile to a temporary name,
then rename), so engines compiling the same instance at once do not clash.
"""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Mapping
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from rapydli.errors import ConfigError
from rapydli.native import compile_library, compiler_version
from rapydli.paths import subdir

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")


def kernels_dir() -> Path:
    """The directory of kernel templates: package data ``rapydli/kernels`` or the repo's ``kernels/``."""
    try:  # installed wheel: rapydli/kernels (force-include; a namespace package, no __init__)
        marker = resources.files("rapydli.kernels").joinpath("conv2d_direct.c")
        if marker.is_file():
            return Path(str(marker)).parent
    except (ModuleNotFoundError, TypeError, AttributeError):
        pass
    repo = Path(__file__).resolve().parents[2] / "kernels"
    if repo.is_dir():
        return repo
    raise ConfigError(
        "kernel templates not found: neither package data 'rapydli.kernels' nor the repo's kernels/ exists"
    )


def template_path(name: str) -> Path:
    """Path of the template file ``name`` in :func:`kernels_dir`."""
    path = kernels_dir() / name
    if not path.is_file():
        raise ConfigError(f"kernel template {name!r} not found in {kernels_dir()}")
    return path


def templates_digest() -> str:
    """A short hash of every kernel template and its domains: measurements of an edited kernel are new ones."""
    digest = hashlib.sha256()
    for path in sorted(kernels_dir().iterdir()):
        if path.is_file() and path.suffix in (".c", ".py", ".json"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    """Where compiled instances live: ``$RAPYDLI_HOME/kernels`` (default ``~/.rapydli/kernels``)."""
    return subdir("kernels")


def _defines(params: Mapping[str, Any]) -> list[str]:
    return [f"-D{name.upper()}={int(value)}" for name, value in sorted(params.items())]


def library_path(template: str, params: Mapping[str, Any]) -> Path:
    """Where the instance of ``template`` with ``params`` is (or will be) cached."""
    text = template_path(template).read_bytes()
    key = hashlib.sha256(text + repr((_defines(params), FLAGS, compiler_version())).encode()).hexdigest()[:20]
    return cache_dir() / f"{Path(template).stem}-{key}.so"


def build(template: str, params: Mapping[str, Any]) -> Path:
    """Compile ``template`` with ``params`` as ``-D`` constants (once); return the ``.so`` path."""
    return compile_library(template_path(template), library_path(template, params), [*FLAGS, *_defines(params)])


@cache
def _load(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def load(template: str, params: Mapping[str, Any]) -> ctypes.CDLL:
    """Compile if needed and load the instance; loaded libraries are kept per process."""
    import torch  # noqa: F401  - load torch's libgomp first so the kernel shares its OpenMP runtime

    return _load(str(build(template, params)))
