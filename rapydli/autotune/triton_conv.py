"""The Triton candidate: ``kernels/conv2d_igemm_triton.py`` (implicit GEMM, forward + both gradients).

Triton is optional (the ``triton`` extra) and imported only when an instance is built.
The candidate is tuned on a GPU; on the CPU its kernels run under Triton's interpreter
(``TRITON_INTERPRET=1``) for correctness only, so CPU tuning skips it. ``triton.autotune``
needs a GPU driver, so configurations are enumerated by this package's own tuner.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Mapping
from functools import cache
from types import ModuleType
from typing import Any

import torch

from rapydli.autotune import cbuild
from rapydli.autotune.candidates import Candidate, Instance, register
from rapydli.autotune.device import DeviceInfo
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.space import Space
from rapydli.errors import ConfigError

SOURCE = "conv2d_igemm_triton.py"


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1`` (kernels run on the CPU through numpy)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _check_mode() -> None:
    """Refuse a ``TRITON_INTERPRET`` that differs from the mode triton was imported in.

    ``triton.jit`` picks compiled or interpreted functions when it decorates them, and
    triton's own library (``tl.zeros`` and the like) is decorated when triton is first
    imported: kernels interpreted after a compiled-mode import fail deep inside Triton
    ("Cannot call @triton.jit'd outside of the scope of a kernel").
    """
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    imported = isinstance(tl.zeros, InterpretedFunction)
    if imported != interpreting():
        now, then = ("set", "unset") if interpreting() else ("unset", "set")
        raise ConfigError(
            f"TRITON_INTERPRET is {now} now but was {then} when triton was first imported in this process, "
            "and Triton fixes the mode at that import: set TRITON_INTERPRET before anything imports triton "
            "(torch.compile does), e.g. in the environment of a fresh process"
        )


@cache
def _load_kernels() -> ModuleType:
    path = cbuild.template_path(SOURCE)
    spec = importlib.util.spec_from_file_location("rapydli_kernels_conv2d_igemm", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot load Triton kernels from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels() -> ModuleType:
    """The Triton kernel module (loaded from ``kernels/`` on first use)."""
    if not triton_available():
        raise ConfigError("the Triton candidate needs triton: pip install 'rapydli[triton]'")
    _check_mode()
    return _load_kernels()


@cache
def presets() -> dict[str, dict[str, list[int]]]:
    """The parameter domains by preset name (``kernels/conv2d_igemm_triton.json``)."""
    return json.loads(cbuild.template_path("conv2d_igemm_triton.json").read_text())["presets"]


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class _TritonInstance(Instance):
    layout = "nhwc"

    def _launch(self, kernel: Any, grid: tuple[int, int], *tensors: torch.Tensor, dims: tuple[int, ...]) -> None:
        p = self.params
        extra = {} if interpreting() else {"num_warps": p["num_warps"], "num_stages": p["num_stages"]}
        kernel[grid](
            *tensors,
            *dims,
            BLOCK_M=p["block_m"],
            BLOCK_N=p["block_n"],
            BLOCK_K=p["block_k"],
            PRECISION=p.get("precision", "ieee"),
            **extra,
        )

    def _dims(self, x: torch.Tensor) -> tuple[int, ...]:
        s = self.shape
        n, c, h, w = x.shape
        oh, ow = (h + 2 * s.pad - s.r) // s.stride + 1, (w + 2 * s.pad - s.s) // s.stride + 1
        return (n, c, h, w, s.k, s.r, s.s, s.stride, s.stride, s.pad, s.pad, oh, ow)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x, w = self.to_layout(x), self.to_layout(w)
        d = self._dims(x)
        n, _, _, _, k, _, _, _, _, _, _, oh, ow = d
        y = torch.empty((n, k, oh, ow), dtype=x.dtype, device=x.device).contiguous(memory_format=torch.channels_last)
        grid = (_cdiv(n * oh * ow, self.params["block_m"]), _cdiv(k, self.params["block_n"]))
        self._launch(_load_kernels().conv_fwd_kernel, grid, x, w, y, dims=d)
        return y

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        x, w, gy = self.to_layout(x), self.to_layout(w), self.to_layout(gy)
        d = self._dims(x)
        n, c, h, wd = d[:4]
        gx = torch.empty_like(x, memory_format=torch.channels_last)
        grid = (_cdiv(n * h * wd, self.params["block_m"]), _cdiv(c, self.params["block_n"]))
        self._launch(_load_kernels().conv_bwd_data_kernel, grid, gy, w, gx, dims=d)
        return gx

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        x, w, gy = self.to_layout(x), self.to_layout(w), self.to_layout(gy)
        d = self._dims(x)
        c, k, r, s = d[1], d[4], d[5], d[6]
        gw = torch.empty_like(w, memory_format=torch.channels_last)
        grid = (_cdiv(k, self.params["block_m"]), _cdiv(r * s * c, self.params["block_n"]))
        self._launch(_load_kernels().conv_bwd_weight_kernel, grid, x, gy, gw, dims=d)
        return gw


class TritonIGemm(Candidate):
    """Implicit-GEMM convolution in Triton (GPU; CPU correctness through the interpreter)."""

    name = "triton_igemm"
    kind = "generated"
    devices = ("cuda",)

    def unavailable(self, device: DeviceInfo) -> str | None:
        if not triton_available():
            return "triton is not installed (pip install 'rapydli[triton]')"
        if device.kind != "cuda":
            return "triton_igemm is tuned on a GPU only (on the CPU it runs under TRITON_INTERPRET=1 for tests)"
        return None

    def unsuited(self, shape: ConvShape) -> str | None:
        if shape.groups != 1 or shape.dilation != 1:
            return f"{self.name} computes convolutions without groups or dilation only"
        return None

    def layout(self, params: Mapping[str, Any]) -> str:
        return "nhwc"

    def space(self, shape: ConvShape, device: DeviceInfo, preset: str = "default") -> Space:
        table = presets()
        if preset not in table:
            raise ConfigError(f"preset must be one of {sorted(table)}, got {preset!r}")
        space = Space(dict(table[preset]))
        smem = int(device.extra.get("shared_memory_per_block", 48 * 1024))
        max_threads = int(device.extra.get("max_threads_per_block", 1024))
        space.hard(
            lambda block_m, block_n, block_k, num_stages: (
                (block_m * block_k + block_k * block_n) * 4 * num_stages <= smem
            ),
            f"tiles fit {smem} B shared memory",
        )
        space.hard(lambda num_warps: num_warps * 32 <= max_threads, f"threads <= {max_threads}")
        # TF32 tiles only where the library they replace computes in TF32 too (torch's cuDNN flag; the tolerance follows it)
        tf32 = device.kind == "cuda" and torch.backends.cudnn.allow_tf32
        space.hard(lambda precision: precision == "ieee" or tf32, "tf32 only where torch.backends.cudnn.allow_tf32")
        space.soft(lambda block_n: block_n <= max(16, shape.k, shape.c), "block_n <= channels")
        return space

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        kernels()  # fail early: triton absent, or TRITON_INTERPRET unlike its import (launches skip the check)
        reason = self.unsuited(shape)
        if reason is not None:
            raise ConfigError(reason)
        return _TritonInstance(shape, params)


register(TritonIGemm())
