"""Every candidate matches F.conv2d (float64 reference) forward and backward on awkward shapes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rapydli.autotune.candidates import Instance, SplitInstance, conv_apply, registry
from rapydli.autotune.device import query
from rapydli.autotune.problem import ConvShape
from rapydli.errors import ConfigError

SHAPES = {
    "3x3-pad": ConvShape(2, 5, 9, 10, 7, 3, 3, stride=1, pad=1),
    "3x3-stride2": ConvShape(2, 4, 11, 9, 6, 3, 3, stride=2, pad=1),
    "1x1": ConvShape(2, 8, 7, 7, 5, 1, 1),
    "1x1-stride2": ConvShape(1, 6, 8, 8, 4, 1, 1, stride=2),
    "5x5-pad2": ConvShape(1, 3, 12, 13, 5, 5, 5, stride=1, pad=2),
    "11x11-stride4": ConvShape(1, 3, 27, 27, 4, 11, 11, stride=4, pad=2),
    "odd-nopad": ConvShape(3, 17, 7, 5, 19, 3, 3),
    "odd-pad1": ConvShape(2, 20, 7, 9, 18, 3, 3, stride=1, pad=1),  # Winograd: partial tiles, tails of C and K
    "3x3-pad2": ConvShape(1, 6, 5, 3, 9, 3, 3, stride=1, pad=2),
    # groups: register blocks of output channels straddle groups (3 filters per group)
    "grouped": ConvShape(2, 8, 9, 10, 12, 3, 3, stride=1, pad=1, groups=4),
    "depthwise": ConvShape(2, 6, 9, 8, 6, 3, 3, stride=1, pad=1, groups=6),
    "depthwise-x2-5x5-stride2": ConvShape(2, 6, 9, 9, 12, 5, 5, stride=2, pad=2, groups=6),
    "dilated": ConvShape(2, 5, 11, 10, 7, 3, 3, stride=1, pad=2, dilation=2),
    "dilated-grouped-stride2": ConvShape(1, 6, 13, 12, 4, 3, 3, stride=2, pad=1, groups=2, dilation=3),
    "grouped-1x1": ConvShape(2, 8, 5, 5, 8, 1, 1, groups=2),
}
CPU_CANDIDATES = ["torch_nchw", "torch_channels_last", "im2col_gemm", "gemm_1x1", "c_direct"]
KINDS = ["grouped", "depthwise", "depthwise-x2-5x5-stride2", "dilated", "dilated-grouped-stride2", "grouped-1x1"]


def reference(shape: ConvShape):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(shape.n, shape.c, shape.h, shape.w, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape.weight_shape, generator=gen, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(x, w, None, shape.stride, shape.pad, shape.dilation, shape.groups)
    gy = torch.randn(y.shape, generator=gen, dtype=torch.float64)
    y.backward(gy)
    return x.detach(), w.detach(), gy, y.detach(), x.grad, w.grad


def check(inst, shape: ConvShape) -> None:
    x, w, gy, y_ref, gx_ref, gw_ref = reference(shape)
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    y = conv_apply(inst, x32, w32)
    y.backward(gy.float())
    for name, got, ref in (("output", y, y_ref), ("grad_input", x32.grad, gx_ref), ("grad_weight", w32.grad, gw_ref)):
        assert got.shape == ref.shape, name
        err = float((got.detach().double() - ref).norm() / ref.norm())
        assert err < 1e-5, f"{name}: relative error {err:.3g} for {inst.params}"


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("name", CPU_CANDIDATES)
def test_cpu_candidates_match_conv2d_forward_and_backward(name: str, shape: ConvShape) -> None:
    cand = registry()[name]
    if cand.unsuited(shape) is not None:  # only gemm_1x1 declines shapes: those not 1x1 without padding or groups
        assert name == "gemm_1x1" and (shape.r, shape.s, shape.pad, shape.groups) != (1, 1, 0, 1)
        return
    configs = cand.space(shape, query(), "tiny").configs()
    assert configs, f"{name} has no configuration for {shape}"
    for params in configs:
        check(cand.instance(shape, params), shape)


WINOGRAD = {"layout": 1, "algo": 1, "kb": 2, "wb": 2, "tb": 4, "cb": 64, "vec": 4, "unroll": 1, "order": 0, "pack": 0}


@pytest.mark.parametrize("key", KINDS)
def test_grouped_and_dilated_layers_get_generated_configurations(key: str) -> None:
    shape = SHAPES[key]
    configs = registry()["c_direct"].space(shape, query(), "tiny").configs()
    assert configs  # checked against F.conv2d above
    if shape.groups != 1:  # the NCHW kernels compute groups, the NHWC ones do not (and refuse them)
        assert {c["layout"] for c in configs} == {0}
        nhwc = {**WINOGRAD, "algo": 0}
        with pytest.raises(ConfigError, match="groups"):
            registry()["c_direct"].instance(shape, nhwc)
    else:
        assert {c["layout"] for c in configs} == {0, 1} and not any(c["algo"] for c in configs)


@pytest.mark.parametrize("key", ["3x3-pad", "odd-nopad", "odd-pad1", "3x3-pad2"])
def test_winograd_instances_are_among_the_checked_configurations_of_3x3_stride1_layers(key: str) -> None:
    configs = registry()["c_direct"].space(SHAPES[key], query(), "tiny").configs()
    assert any(c["algo"] == 1 for c in configs)  # so the test above checks them against F.conv2d


@pytest.mark.parametrize("key", ["3x3-stride2", "5x5-pad2", "1x1", "dilated"])
def test_a_winograd_instance_runs_other_shapes_with_the_direct_kernels(key: str) -> None:
    shape = SHAPES[key]  # the shape is a run-time argument: one compiled instance serves every layer
    check(registry()["c_direct"].instance(shape, WINOGRAD), shape)


def test_unsuited_candidates_are_skipped_with_their_reason() -> None:
    from rapydli.autotune.conv import build_space
    from rapydli.autotune.search import Problem

    space = build_space(Problem(SHAPES["3x3-pad"]), query(), ["torch_nchw", "gemm_1x1"])
    assert "1x1" in space.skipped["gemm_1x1"] and {c.candidate for c in space.always} == {"torch_nchw"}
    space = build_space(Problem(SHAPES["1x1-stride2"]), query(), ["torch_nchw", "gemm_1x1"])
    assert not space.skipped and {c.candidate for c in space.always} == {"torch_nchw", "gemm_1x1"}


class _Counting(Instance):
    """Counts the gradient passes autograd asks for (computes them with F.conv2d's backward)."""

    def __init__(self, shape: ConvShape) -> None:
        super().__init__(shape, {})
        self.calls: list[str] = []
        self.torch = registry()["torch_nchw"].instance(shape, {})

    def forward(self, x, w):
        return self.torch.forward(x, w)

    def data_grad(self, x, w, gy):
        self.calls.append("data_grad")
        return self.torch.data_grad(x, w, gy)

    def weight_grad(self, x, w, gy):
        self.calls.append("weight_grad")
        return self.torch.weight_grad(x, w, gy)

    def backward(self, x, w, gy):
        self.calls.append("backward")
        return self.torch.backward(x, w, gy)


def test_autograd_runs_only_the_gradients_needed() -> None:
    shape = SHAPES["3x3-pad"]
    inst = _Counting(shape)
    x, w = torch.randn(shape.n, shape.c, shape.h, shape.w), torch.randn(shape.k, shape.c, 3, 3, requires_grad=True)
    conv_apply(inst, x, w).sum().backward()  # a first layer: its input needs no gradient
    assert inst.calls == ["weight_grad"]
    inst.calls.clear()
    conv_apply(inst, x.requires_grad_(), w.detach()).sum().backward()
    assert inst.calls == ["data_grad"]
    inst.calls.clear()
    conv_apply(inst, x, w).sum().backward()  # both: one backward call (oneDNN computes them together)
    assert inst.calls == ["backward"]
    # a split layer makes one call when both gradients come from the same instance, else one each
    torch_inst = registry()["torch_nchw"].instance(shape, {})  # the layout of _Counting
    for split, calls in (
        (SplitInstance(torch_inst, inst, inst), ["backward"]),
        (SplitInstance(torch_inst, inst, torch_inst), ["data_grad"]),
    ):
        inst.calls.clear()
        conv_apply(split, x, w).sum().backward()
        assert inst.calls == calls


def test_split_instance_takes_each_pass_from_another_instance() -> None:
    shape = SHAPES["1x1"]
    cands = registry()
    c_nhwc = {"layout": 1, "kb": 2, "wb": 2, "cb": 64, "vec": 4, "unroll": 1, "order": 0, "pack": 1}
    split = SplitInstance(
        cands["c_direct"].instance(shape, c_nhwc),
        cands["torch_channels_last"].instance(shape, {}),
        cands["gemm_1x1"].instance(shape, {}),
    )
    assert split.layout == "nhwc" and not split.native_autograd
    check(split, shape)
    with pytest.raises(ConfigError, match="share a memory layout"):
        SplitInstance(cands["torch_nchw"].instance(shape, {}), split, split)


def test_c_kernel_runs_on_tensor_memory_without_copies() -> None:
    cand = registry()["c_direct"]
    shape = SHAPES["3x3-pad"]
    inst = cand.instance(shape, {"layout": 1, "kb": 2, "wb": 2, "cb": 64, "vec": 4, "unroll": 1, "order": 0})
    x = torch.randn(shape.n, shape.c, shape.h, shape.w).contiguous(memory_format=torch.channels_last)
    assert inst.to_layout(x).data_ptr() == x.data_ptr()  # already NHWC: handed over as is
    y = inst.forward(x, torch.randn(shape.k, shape.c, 3, 3))
    assert y.is_contiguous(memory_format=torch.channels_last)


def test_c_kernel_instances_are_cached_on_disk() -> None:
    from rapydli.autotune import cbuild

    params = {"layout": 0, "kb": 2, "wb": 2, "cb": 64, "vec": 4, "unroll": 1, "order": 0}
    path = cbuild.build("conv2d_direct.c", params)
    mtime = path.stat().st_mtime_ns
    assert cbuild.build("conv2d_direct.c", params) == path and path.stat().st_mtime_ns == mtime
    assert path.parent == cbuild.cache_dir()


TRITON = importlib.util.find_spec("triton") is not None
TRITON_SHAPES = ["3x3-pad", "3x3-stride2", "1x1-stride2", "5x5-pad2", "11x11-stride4", "odd-nopad"]
TRITON_BLOCKS = {"block_m": 64, "block_n": 16, "block_k": 64, "num_warps": 4, "num_stages": 2}


def _in_fresh_python(code: str, interpret: bool) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a new interpreter: Triton fixes its interpret mode when it is first imported."""
    env = {**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"}
    tests = str(Path(__file__).parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [tests, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def triton_interpreted_errors() -> dict[str, str]:
    """Each Triton shape checked against F.conv2d under the interpreter: '' or the failure, by shape."""
    code = f"""
import json
from test_autotune_candidates import SHAPES, ConvShape, check, registry
errors = {{}}
for key in {TRITON_SHAPES!r}:
    shape = SHAPES[key]
    small = ConvShape(1, min(shape.c, 4), shape.h, shape.w, min(shape.k, 4), shape.r, shape.s, shape.stride, shape.pad)
    try:
        check(registry()["triton_igemm"].instance(small, {TRITON_BLOCKS!r}), small)
        errors[key] = ""
    except Exception as error:
        errors[key] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(errors))
"""
    result = _in_fresh_python(code, interpret=True)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not TRITON, reason="triton is not installed (the 'triton' extra)")
@pytest.mark.parametrize("key", TRITON_SHAPES)
def test_triton_kernel_matches_conv2d_under_the_interpreter(
    key: str, triton_interpreted_errors: dict[str, str]
) -> None:
    assert triton_interpreted_errors[key] == ""


@pytest.mark.skipif(not TRITON, reason="triton is not installed (the 'triton' extra)")
def test_triton_interpret_set_after_import_is_refused_clearly() -> None:
    code = f"""
import os
import triton  # imported in compiled mode, as torch.compile would
os.environ["TRITON_INTERPRET"] = "1"
from rapydli.autotune.candidates import registry
from rapydli.autotune.problem import ConvShape
from rapydli.errors import ConfigError
try:
    registry()["triton_igemm"].instance(ConvShape(1, 2, 5, 5, 2, 3, 3), {TRITON_BLOCKS!r})
except ConfigError as error:
    print("refused:", error)
"""
    result = _in_fresh_python(code, interpret=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused: TRITON_INTERPRET is set now but was unset when triton was first imported" in result.stdout


@pytest.mark.skipif(not TRITON, reason="triton is not installed (the 'triton' extra)")
def test_triton_space_is_pruned_by_gpu_limits() -> None:
    from dataclasses import replace

    gpu = replace(query(), kind="cuda", extra={"shared_memory_per_block": 32 * 1024, "max_threads_per_block": 128})
    space = registry()["triton_igemm"].space(SHAPES["3x3-pad"], gpu, "full")
    counts = space.counts()
    assert counts["after_hard"] < counts["total"]
    for c in space.configs():
        assert (c["block_m"] * c["block_k"] + c["block_k"] * c["block_n"]) * 4 * c["num_stages"] <= 32 * 1024
        assert c["num_warps"] <= 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_triton_kernel_on_gpu() -> None:
    shape = SHAPES["3x3-pad"]
    inst = registry()["triton_igemm"].instance(
        shape, {"block_m": 64, "block_n": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}
    )
    x = torch.randn(shape.n, shape.c, shape.h, shape.w, device="cuda")
    w = torch.randn(shape.k, shape.c, 3, 3, device="cuda")
    want = F.conv2d(
        x.double().cpu(), w.double().cpu(), None, 1, 1
    )  # cuDNN's float32 may be TF32: float64 is the reference
    torch.testing.assert_close(inst.forward(x, w).double().cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "shape",
    [
        ConvShape(2, 16, 1, 1, 8, 3, 3, 1, 1),
        ConvShape(2, 16, 2, 2, 8, 3, 3, 2, 1),
        ConvShape(2, 3, 3, 3, 4, 7, 7, 2, 3),
        ConvShape(2, 4, 2, 2, 4, 3, 3, 1, 2, groups=2, dilation=2),
    ],
)
def test_cropped_filters_compute_the_convolution_and_both_gradients(shape: ConvShape) -> None:
    from rapydli.autotune.candidates import get as candidate
    from rapydli.autotune.runner import check
    from rapydli.autotune.search import Config, Problem

    assert candidate("torch_cropped").unsuited(shape) is None
    for layout in (0, 1):
        assert check(Problem(shape, "train"), Config.of("torch_cropped", {"layout": layout})).status == "validated"
    # another input size than the tuned one: the full filter (the cut depends on the size)
    inst = candidate("torch_cropped").instance(shape, {"layout": 0})
    x, w = torch.randn(1, shape.c, 6, 6), torch.randn(shape.weight_shape)
    torch.testing.assert_close(
        inst.forward(x, w),
        torch.nn.functional.conv2d(x, w, None, shape.stride, shape.pad, shape.dilation, shape.groups),
    )
    assert candidate("torch_cropped").unsuited(ConvShape(2, 16, 8, 8, 8, 3, 3, 1, 1)) is not None
