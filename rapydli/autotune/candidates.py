"""Convolution candidates, registered by name: library variants and generated kernels.

A candidate is a way to compute a convolution. It has a parameter :class:`Space` (empty
for library variants), and an instance (one point of the space) computes the forward
pass and both gradients. Library candidates live here; generated ones in
:mod:`rapydli.autotune.generated` (C) and :mod:`rapydli.autotune.triton_conv` (Triton)
register themselves when those modules are imported by :func:`registry`. Other packages
add candidates in the ``rapydli.candidates`` entry-point group (naming a
:class:`Candidate` instance); the tuner measures every registered one that suits the
problem, and ``candidates=[...]`` selects by name.

Example
-------
>>> from rapydli.autotune.candidates import registry
>>> sorted(registry())[:3]
['c_direct', 'gemm_1x1', 'im2col_gemm']
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from rapydli.autotune.device import DeviceInfo
from rapydli.autotune.problem import ConvShape
from rapydli.autotune.space import Space, empty_space
from rapydli.errors import ConfigError
from rapydli.registry import Registry

MEMORY_FORMAT = {"nchw": torch.contiguous_format, "nhwc": torch.channels_last}


PASSES = ("forward", "data_grad", "weight_grad")


def library_backward(
    shape: ConvShape, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, mask: list[bool], pad: int | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The gradients ``mask`` asks for (input, weight) from the library's convolution backward (one call for both).

    ``pad`` overrides ``shape.pad`` (a candidate that pads the input itself passes 0).
    """
    p = shape.pad if pad is None else pad
    gx, gw, _ = torch.ops.aten.convolution_backward(
        gy, x, w, None, [shape.stride] * 2, [p] * 2, [shape.dilation] * 2, False, [0, 0], shape.groups, [*mask, False]
    )
    return gx, gw


class Instance:
    """One runnable point of a candidate's space.

    Subclasses implement :meth:`forward`, :meth:`data_grad` and :meth:`weight_grad` (the
    three passes a training step runs, see :data:`PASSES`); tensors arrive in
    :attr:`layout` (``to_layout`` does that without a copy when they already are).
    ``native_autograd`` is True when :meth:`forward` is differentiable by torch itself.
    """

    layout: str = "nchw"
    native_autograd: bool = False

    def __init__(self, shape: ConvShape, params: Mapping[str, Any]) -> None:
        self.shape = shape
        self.params = dict(params)

    def to_layout(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` in this instance's memory layout (no copy when it already is)."""
        return t.contiguous(memory_format=MEMORY_FORMAT[self.layout])

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The convolution of ``x`` with ``w`` (no bias)."""
        raise NotImplementedError

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        """The gradient of the input for the output gradient ``gy``."""
        raise NotImplementedError

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        """The gradient of the weight for the output gradient ``gy``."""
        raise NotImplementedError

    def backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(grad_input, grad_weight)`` for the output gradient ``gy``."""
        return self.data_grad(x, w, gy), self.weight_grad(x, w, gy)


class SplitInstance(Instance):
    """One layer whose three passes run on different instances of the same memory layout.

    Train-mode tuning times each pass of every configuration, so a layer can take the
    fastest forward, the fastest data gradient and the fastest weight gradient separately.
    Autograd goes through :class:`ConvFunction`, which runs only the gradients needed.
    """

    def __init__(self, forward: Instance, data_grad: Instance, weight_grad: Instance) -> None:
        layouts = {forward.layout, data_grad.layout, weight_grad.layout}
        if len(layouts) != 1:
            raise ConfigError(f"the passes of one layer must share a memory layout, got {sorted(layouts)}")
        super().__init__(forward.shape, {})
        self.layout = forward.layout
        self.passes = {"forward": forward, "data_grad": data_grad, "weight_grad": weight_grad}

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.passes["forward"].forward(x, w)

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        return self.passes["data_grad"].data_grad(x, w, gy)

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        return self.passes["weight_grad"].weight_grad(x, w, gy)

    def backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.passes["data_grad"] is self.passes["weight_grad"]:  # one call (oneDNN computes both at once)
            return self.passes["data_grad"].backward(x, w, gy)
        return super().backward(x, w, gy)


class Candidate:
    """A family of convolution implementations with a (possibly empty) parameter space."""

    name: str = ""
    kind: str = "library"  # or "generated"
    devices: tuple[str, ...] = ("cpu",)
    has_backward: bool = True

    def unavailable(self, device: DeviceInfo) -> str | None:
        """Why this candidate cannot run on ``device`` (None when it can)."""
        return None if device.kind in self.devices else f"{self.name} runs on {self.devices}, not {device.kind}"

    def unsuited(self, shape: ConvShape) -> str | None:
        """Why this candidate does not compute convolutions of ``shape`` (None when it does)."""
        return None

    def space(self, shape: ConvShape, device: DeviceInfo, preset: str = "default") -> Space:
        """The parameter space for ``shape`` on ``device`` (constraints included)."""
        return empty_space()

    def layout(self, params: Mapping[str, Any]) -> str:
        """Memory layout (``"nchw"`` or ``"nhwc"``) the instance with ``params`` works in."""
        return "nchw"

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        """Build (compile, load) the instance with ``params``."""
        raise NotImplementedError


# ------------------------------------------------------------------ library variants


class _TorchInstance(Instance):
    native_autograd = True

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = self.shape
        return F.conv2d(self.to_layout(x), self.to_layout(w), None, s.stride, s.pad, s.dilation, s.groups)

    def _backward(
        self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, mask: list[bool]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return library_backward(self.shape, self.to_layout(x), self.to_layout(w), self.to_layout(gy), mask)

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        gx, _ = self._backward(x, w, gy, [True, False])
        assert gx is not None  # asked for by the mask
        return gx

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        _, gw = self._backward(x, w, gy, [False, True])
        assert gw is not None  # asked for by the mask
        return gw

    def backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gx, gw = self._backward(x, w, gy, [True, True])  # one oneDNN call for both
        assert gx is not None and gw is not None  # asked for by the mask
        return gx, gw


class _TorchNCHW(_TorchInstance):
    layout = "nchw"


class _TorchNHWC(_TorchInstance):
    layout = "nhwc"


class TorchNCHW(Candidate):
    """``F.conv2d`` on NCHW tensors (oneDNN on CPU; cuDNN with ``benchmark=True`` on GPU)."""

    name = "torch_nchw"
    devices = ("cpu", "cuda")

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        if torch.cuda.is_available():
            torch.backends.cudnn.benchmark = True
        return _TorchNCHW(shape, params)


class TorchChannelsLast(Candidate):
    """``F.conv2d`` on channels-last (NHWC) tensors."""

    name = "torch_channels_last"
    devices = ("cpu", "cuda")

    def layout(self, params: Mapping[str, Any]) -> str:
        return "nhwc"

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        return _TorchNHWC(shape, params)


class _Im2colInstance(Instance):
    """``F.unfold`` to columns ``(N, G, C/G*R*S, L)``, then one batched GEMM per image and group."""

    native_autograd = True  # unfold and matmul are differentiable

    def _cols(self, x: torch.Tensor) -> torch.Tensor:
        s = self.shape
        cols = F.unfold(x, (s.r, s.s), dilation=s.dilation, padding=s.pad, stride=s.stride)  # N, C*R*S, L
        return cols.view(x.shape[0], s.groups, -1, cols.shape[-1])

    def _w(self, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(self.shape.groups, self.shape.k // self.shape.groups, -1)  # G, K/G, C/G*R*S

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n, _, h, wd = x.shape
        oh = (h + 2 * s.pad - s.span_r) // s.stride + 1
        ow = (wd + 2 * s.pad - s.span_s) // s.stride + 1
        return (self._w(w) @ self._cols(x)).view(n, s.k, oh, ow)

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        s = self.shape
        n, _, h, wd = x.shape
        gcols = self._w(w).transpose(1, 2) @ gy.reshape(n, s.groups, s.k // s.groups, -1)
        return F.fold(
            gcols.reshape(n, -1, gcols.shape[-1]),
            (h, wd),
            (s.r, s.s),
            dilation=s.dilation,
            padding=s.pad,
            stride=s.stride,
        )

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        s = self.shape
        gy = gy.reshape(x.shape[0], s.groups, s.k // s.groups, -1)
        return torch.matmul(gy, self._cols(x).transpose(2, 3)).sum(0).view_as(w)


class Im2colGemm(Candidate):
    """im2col (``F.unfold``) followed by one GEMM per image and group (dilation in the unfold)."""

    name = "im2col_gemm"
    devices = ("cpu", "cuda")

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        return _Im2colInstance(shape, params)


class _Gemm1x1Instance(Instance):
    """A 1x1 convolution on channels-last tensors is a matrix product over pixels: ``(N*H*W, C) @ (C, K)``."""

    layout = "nhwc"
    native_autograd = True  # slicing, permutes and mm are differentiable

    def _pixels(self, x: torch.Tensor) -> torch.Tensor:
        s = self.to_layout(x)[:, :, :: self.shape.stride, :: self.shape.stride]
        return s.permute(0, 2, 3, 1).reshape(-1, s.shape[1])  # a view when the stride is 1

    def _out(self, gy: torch.Tensor) -> torch.Tensor:
        return self.to_layout(gy).permute(0, 2, 3, 1).reshape(-1, gy.shape[1])

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        n, _, h, wd = x.shape
        oh, ow = (h - 1) // self.shape.stride + 1, (wd - 1) // self.shape.stride + 1
        y = self._pixels(x) @ w.reshape(w.shape[0], -1).t()
        return y.view(n, oh, ow, -1).permute(0, 3, 1, 2)

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        n, c, h, wd = x.shape
        g = (self._out(gy) @ w.reshape(w.shape[0], -1)).view(n, *gy.shape[2:], c).permute(0, 3, 1, 2)
        if self.shape.stride == 1:
            return g
        gx = torch.zeros((n, c, h, wd), dtype=g.dtype).contiguous(
            memory_format=torch.channels_last
        )  # zeros() takes no memory_format
        gx[:, :, :: self.shape.stride, :: self.shape.stride] = g
        return gx

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        return (self._out(gy).t() @ self._pixels(x)).view(w.shape)


class Gemm1x1(Candidate):
    """A 1x1 convolution (any stride, no padding, no groups) as one GEMM over the pixels of channels-last tensors.

    A 1x1 filter has one tap: its dilation changes nothing.
    """

    name = "gemm_1x1"
    devices = ("cpu", "cuda")

    def unsuited(self, shape: ConvShape) -> str | None:
        if shape.r != 1 or shape.s != 1 or shape.pad != 0 or shape.groups != 1:
            return f"{self.name} computes 1x1 convolutions without padding or groups only"
        return None

    def layout(self, params: Mapping[str, Any]) -> str:
        return "nhwc"

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        return _Gemm1x1Instance(shape, params)


def used_taps(size: int, taps: int, stride: int, pad: int, dilation: int = 1) -> tuple[int, int]:
    """First and last filter tap (along one dimension) that ever reads the input rather than padding.

    Taps outside that range read padding only; taps inside it may too (with a stride or a
    dilation larger than the input), and are kept.

    Example
    -------
    >>> used_taps(1, 3, 1, 1)  # a 3x3 filter over a 1x1 input padded by 1: only the centre
    (1, 1)
    >>> used_taps(8, 3, 1, 1)
    (0, 2)
    >>> used_taps(2, 3, 1, 2, dilation=2)  # taps 2 apart over a 2-wide input padded by 2
    (1, 1)
    """
    out = (size + 2 * pad - dilation * (taps - 1) - 1) // stride + 1
    first = max(0, -(-(pad - (out - 1) * stride) // dilation))
    return first, min(taps - 1, (size - 1 + pad) // dilation)


class _CroppedInstance(Instance):
    """The convolution with the filter cut to the taps that read the input (the rest only ever read padding).

    Autograd goes through :class:`ConvFunction` (its own backward), not through the slicing:
    slicing's backward writes the weight gradient into new NCHW zeros, which a channels-last
    weight then copies again (on ResNet-18's 512x512x3x3 layers, 2.4 ms a layer and step, the
    time :meth:`weight_grad` was timed without).
    """

    def __init__(self, shape: ConvShape, params: Mapping[str, Any]) -> None:
        super().__init__(shape, params)
        self.layout = "nhwc" if int(params.get("layout", 0)) == 1 else "nchw"
        s, d = shape, shape.dilation
        (self.r0, self.r1), (self.s0, self.s1) = (
            used_taps(s.h, s.r, s.stride, s.pad, d),
            used_taps(s.w, s.s, s.stride, s.pad, d),
        )
        oh, ow = s.out_hw
        top, left = s.pad - self.r0 * d, s.pad - self.s0 * d
        bottom = (oh - 1) * s.stride + d * (self.r1 - self.r0) + 1 - s.h - top
        right = (ow - 1) * s.stride + d * (self.s1 - self.s0) + 1 - s.w - left
        self.pads = (left, right, top, bottom)  # F.pad order; a negative one crops

    def _crop(self, w: torch.Tensor) -> torch.Tensor:
        return self.to_layout(w[:, :, self.r0 : self.r1 + 1, self.s0 : self.s1 + 1])

    def _fits(self, x: torch.Tensor) -> bool:
        return tuple(x.shape[2:]) == (self.shape.h, self.shape.w)  # the cut depends on the input's size

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        s = self.shape
        if not self._fits(x):
            return F.conv2d(self.to_layout(x), self.to_layout(w), None, s.stride, s.pad, s.dilation, s.groups)
        return F.conv2d(self.to_layout(F.pad(x, self.pads)), self._crop(w), None, s.stride, 0, s.dilation, s.groups)

    def _backward(
        self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor, mask: list[bool]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        s = self.shape
        if not self._fits(x):
            return library_backward(s, self.to_layout(x), self.to_layout(w), self.to_layout(gy), mask)
        gx, gw = library_backward(
            s, self.to_layout(F.pad(x, self.pads)), self._crop(w), self.to_layout(gy), mask, pad=0
        )
        if gx is not None:
            gx = self.to_layout(F.pad(gx, tuple(-p for p in self.pads)))
        if gw is not None:
            full = torch.zeros_like(w, dtype=gw.dtype, memory_format=MEMORY_FORMAT[self.layout])
            full[:, :, self.r0 : self.r1 + 1, self.s0 : self.s1 + 1] = gw
            gw = full
        return gx, gw

    def data_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        gx, _ = self._backward(x, w, gy, [True, False])
        assert gx is not None  # asked for by the mask
        return gx

    def weight_grad(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
        _, gw = self._backward(x, w, gy, [False, True])
        assert gw is not None  # asked for by the mask
        return gw

    def backward(self, x: torch.Tensor, w: torch.Tensor, gy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gx, gw = self._backward(x, w, gy, [True, True])
        assert gx is not None and gw is not None  # asked for by the mask
        return gx, gw


class TorchCropped(Candidate):
    """``F.conv2d`` with the filter cut to the taps that read the input: layers whose padding exceeds their input.

    In ResNet-18's last stage at 32x32 a 3x3 filter slides over a 1x1 (or a 2x2, stride 2)
    input padded by 1: only the centre (2x2) taps ever meet data, so the convolution is a
    1x1 (2x2) one and its weight gradient is zero elsewhere.
    """

    name = "torch_cropped"
    devices = ("cpu", "cuda")

    def unsuited(self, shape: ConvShape) -> str | None:
        rows = used_taps(shape.h, shape.r, shape.stride, shape.pad, shape.dilation)
        cols = used_taps(shape.w, shape.s, shape.stride, shape.pad, shape.dilation)
        if rows == (0, shape.r - 1) and cols == (0, shape.s - 1):
            return f"{self.name}: every filter tap reads the input (nothing to cut)"
        return None

    def space(self, shape: ConvShape, device: DeviceInfo, preset: str = "default") -> Space:
        return Space({"layout": [0, 1]})

    def layout(self, params: Mapping[str, Any]) -> str:
        return "nhwc" if int(params.get("layout", 0)) == 1 else "nchw"

    def instance(self, shape: ConvShape, params: Mapping[str, Any]) -> Instance:
        return _CroppedInstance(shape, params)


# ------------------------------------------------------------------ the registry

#: Every candidate by name (entry points included); :func:`registry` gives them loaded.
CANDIDATES = Registry("kernel candidate", {}, group="rapydli.candidates")


def register(candidate: Candidate) -> Candidate:
    """Add ``candidate`` to the registry under its name (replacing one of the same name)."""
    CANDIDATES.register(candidate.name, candidate)
    return candidate


for _cls in (TorchNCHW, TorchChannelsLast, Im2colGemm, Gemm1x1, TorchCropped):
    register(_cls())


def registry() -> dict[str, Candidate]:
    """All registered candidates by name (generated ones included)."""
    import rapydli.autotune.generated
    import rapydli.autotune.triton_conv  # noqa: F401  - registers triton_igemm (lazy triton import)

    return {name: CANDIDATES.load(name) for name in CANDIDATES}


def get(name: str) -> Candidate:
    """The candidate called ``name`` (ConfigError listing the known ones otherwise)."""
    candidates = registry()
    if name not in candidates:
        raise ConfigError(f"unknown candidate {name!r}; known: {sorted(candidates)}")
    return candidates[name]


class ConvFunction(torch.autograd.Function):
    """Autograd for an :class:`Instance` whose forward torch cannot differentiate (generated kernels)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, inst: Instance) -> torch.Tensor:
        x = inst.to_layout(x)
        w = inst.to_layout(w)
        ctx.save_for_backward(x, w)
        ctx.inst = inst
        return inst.forward(x, w)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w = ctx.saved_tensors
        inst, gy = ctx.inst, ctx.inst.to_layout(gy)
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:
            return (*inst.backward(x, w, gy), None)
        gx = inst.data_grad(x, w, gy) if ctx.needs_input_grad[0] else None  # only the gradient asked for
        gw = inst.weight_grad(x, w, gy) if ctx.needs_input_grad[1] else None
        return gx, gw, None


def conv_apply(inst: Instance, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Run ``inst`` on ``x`` and ``w`` with autograd (native or through :class:`ConvFunction`)."""
    if inst.native_autograd:
        return inst.forward(x, w)
    return ConvFunction.apply(x, w, inst)
