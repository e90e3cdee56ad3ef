"""The generated CPU candidate: ``kernels/conv2d_direct.c`` compiled per parameter set.

The template's domains come from ``kernels/conv2d_direct.json`` (a preset); the
constraints are here: hard ones from the device query (vector width, registers), soft
ones from the problem (no block wider than the layer or its group; the Winograd forward,
``algo`` 1, only for NHWC 3x3 stride-1 layers without dilation; grouped layers on the NCHW
kernels) and from parameters a layout or algorithm does not read (so the NCHW variant is
not compiled once per unused value).
"""

from __future__ import annotations

import ctypes
import json
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch

from rapydli.autotune import cbuild
from rapydli.autotune.candidates import Candidate, Instance, register
from rapydli.autotune.device import DeviceInfo
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.space import Space
from rapydli.errors import ConfigError
from rapydli.native import find_compiler

TEMPLATE = "conv2d_direct.c"
_ARGS = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 14 + [ctypes.c_int]


@cache
def presets() -> dict[str, dict[str, list[int]]]:
    """The parameter domains of the template, by preset name."""
    return json.loads(cbuild.template_path("conv2d_direct.json").read_text())["presets"]


def _ptr(t: torch.Tensor) -> int:
    return t.data_ptr()


class _CInstance(Instance):
    def __init__(self, shape: ConvShape, params: Mapping[str, Any]) -> None:
        super().__init__(shape, params)
        self.layout = "nhwc" if int(params["layout"]) == 1 else "nchw"
        lib = cbuild.load(TEMPLATE, params)
        self._fwd, self._bwd_data, self._bwd_weight = lib.conv_fwd, lib.conv_bwd_data, lib.conv_bwd_weight
        for fn in (self._fwd, self._bwd_data, self._bwd_weight):
            fn.argtypes = _ARGS
            fn.restype = ctypes.c_int

    def _dims(self, x: torch.Tensor) -> tuple[int, ...]:
        s = self.shape
        n, c, h, w = x.shape
        return (
            n,
            c,
            h,
            w,
            s.k,
            s.r,
            s.s,
            s.stride,
            s.stride,
            s.pad,
            s.pad,
            s.groups,
            s.dilation,
            s.dilation,
            torch.get_num_threads(),
        )

    def _run(self, fn: Any, *args: Any) -> None:
        if fn(*args):
            raise ConfigError(
                f"c_direct({self.layout}) does not compute groups={self.shape.groups} "
                "(its NHWC kernels take groups=1 only)"
            )

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != torch.float32 or t.device.type != "cpu":
                raise ConfigError(f"generated C kernels take float32 CPU tensors, got {t.dtype} on {t.device}")

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        x, w = self.to_layout(x), self.to_layout(w)
        self._check(x, w)
        s = self.shape
        n, _, h, wd = x.shape
        oh, ow = (h + 2 * s.pad - s.span_r) // s.stride + 1, (wd + 2 * s.pad - s.span_s) // s.stride + 1
        y = torch.empty((n, s.k, oh, ow), dtype=x.dtype, memory_format=self._format)
        self._run(self._fwd, _ptr(x), _ptr(w), _ptr(y), *self._dims(x))
        return y

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        x, w, gy = self.to_layout(x), self.to_layout(w), self.to_layout(gy)
        self._check(x, w, gy)
        gx = torch.empty(x.shape, dtype=x.dtype, memory_format=self._format)
        self._run(self._bwd_data, _ptr(gy), _ptr(w), _ptr(gx), *self._dims(x))
        return gx

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        x, w, gy = self.to_layout(x), self.to_layout(w), self.to_layout(gy)
        self._check(x, w, gy)
        gw = torch.empty(w.shape, dtype=w.dtype, memory_format=self._format)
        self._run(self._bwd_weight, _ptr(x), _ptr(gy), _ptr(gw), *self._dims(x))
        return gw

    @property
    def _format(self) -> torch.memory_format:
        return torch.channels_last if self.layout == "nhwc" else torch.contiguous_format


class CDirect(Candidate):
    """Convolution generated from ``kernels/conv2d_direct.c`` (forward + both gradients).

    Direct loops, or (``algo`` 1, NHWC 3x3 stride 1, no dilation) Winograd F(2x2,3x3) for all
    three passes. Dilated layers run in either layout, grouped (and depthwise) ones in NCHW.
    """

    name = "c_direct"
    kind = "generated"
    devices = ("cpu",)

    def unavailable(self, device: DeviceInfo) -> str | None:
        if device.kind != "cpu":
            return f"{self.name} runs on the CPU only"
        if find_compiler() is None:
            return "no C compiler ($CC or cc) on this machine: generated C kernels are skipped"
        return None

    def layout(self, params: Mapping[str, Any]) -> str:
        return "nhwc" if int(params["layout"]) == 1 else "nchw"

    def space(self, shape: ConvShape, device: DeviceInfo, preset: str = "default") -> Space:
        table = presets()
        if preset not in table:
            raise ConfigError(f"preset must be one of {sorted(table)}, got {preset!r}")
        space = Space(dict(table[preset]))
        first = {name: domain[0] for name, domain in table[preset].items()}
        lanes, regs = device.vector_lanes, device.vector_registers
        # hard: what the device allows
        space.hard(lambda vec: vec <= max(4, lanes), f"vector lanes <= {lanes} ({device.isa})")
        # the forward holds kb x wb accumulators and wb (packed, Winograd: kb) operands; the weight
        # gradient kb x wb accumulators and wb operands
        space.hard(
            lambda kb, wb, pack, algo: kb * wb + (max(kb, wb) if pack or algo else wb) + 1 <= regs,
            f"accumulators + operands <= {regs} vector registers",
        )
        # soft: Winograd F(2x2,3x3) is an NHWC forward of 3x3 stride-1 layers
        space.soft(lambda layout, algo: not algo or layout == 1, "Winograd (algo 1) is NHWC only")
        winograd = (shape.r, shape.s, shape.stride, shape.dilation) == (3, 3, 1, 1)
        space.soft(lambda algo: not algo or winograd, "Winograd (algo 1) needs a 3x3 stride-1 layer without dilation")
        grouped = shape.groups != 1
        space.soft(lambda layout: not grouped or layout == 0, "groups: the NCHW kernels only")
        # soft: parameters a layout or algorithm ignores are pinned to their first value (no duplicate instances)
        space.soft(lambda layout, wb: layout == 1 or wb == first["wb"], "NCHW ignores wb")
        space.soft(lambda layout, cb: layout == 1 or cb == first["cb"], "NCHW ignores cb")
        space.soft(lambda layout, vec: layout == 1 or vec == first["vec"], "NCHW ignores vec")
        space.soft(lambda layout, order: layout == 1 or order == first["order"], "NCHW ignores order")
        space.soft(lambda layout, pack: layout == 1 or pack == first["pack"], "NCHW ignores pack")
        space.soft(lambda pack, cb: not pack or cb == first["cb"], "the packed forward ignores cb")
        pinned = (first["cb"], first["order"], first["pack"])
        space.soft(
            lambda algo, cb, order, pack: not algo or (cb, order, pack) == pinned, "Winograd ignores cb, order and pack"
        )
        space.soft(lambda algo, tb: algo or tb == first["tb"], "the direct forward ignores tb")
        # soft: no block much wider than the problem (packed: kb counts vectors of vec output channels; the
        # Winograd forward too, but its weight gradient counts kernels, and a split plan takes each pass from
        # its own configuration, so Winograd is bounded as the direct kernels are)
        space.soft(lambda kb, pack, vec: kb <= max(first["kb"], -(-shape.k // vec) if pack else shape.k), "kb <= K")
        space.soft(
            lambda kb: kb <= max(first["kb"], shape.k // shape.groups), "kb <= K / groups (a block is one group)"
        )
        ow = shape.out_hw[1]
        space.soft(lambda algo, wb: algo or wb <= max(first["wb"], ow), "wb <= OW")
        tiles = shape.n * -(-shape.out_hw[0] // 2) * -(-ow // 2)
        space.soft(lambda algo, wb, tb: not algo or wb <= tb, "Winograd: wb <= tb")
        smallest_tb = min((tb for tb in table[preset]["tb"] if tb >= tiles), default=max(table[preset]["tb"]))
        space.soft(lambda algo, tb: not algo or tb <= smallest_tb, "Winograd: tb <= the smallest block of all tiles")
        smallest_cb = min((cb for cb in table[preset]["cb"] if cb >= shape.c), default=max(table[preset]["cb"]))
        space.soft(lambda cb: cb <= smallest_cb, "cb <= the smallest block covering C")
        space.soft(
            lambda vec, pack, algo: vec <= max(first["vec"], shape.k if pack or algo else shape.c),
            "vec <= C (packed, Winograd: K)",
        )
        return space

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        if shape.groups != 1 and int(params["layout"]) == 1:
            raise ConfigError(f"{self.name}: groups={shape.groups} runs on the NCHW kernels (layout 0) only")
        return _CInstance(shape, params)


register(CDirect())
