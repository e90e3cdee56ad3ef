"""Implicit-GEMM 2-D convolution in Triton: forward, data gradient and weight gradient.

Tensors are float32 NHWC (channels-last); the weight is (K, R, S, C). Each kernel is a
GEMM whose operand tiles are gathered from the tensors on the fly (no im2col buffer):

* forward:       Y[(n,oh,ow), k]  = sum_{(r,s,c)} X[n, oh*SH-PH+r, ow*SW-PW+s, c] W[k,(r,s,c)]
* data gradient: GX[(n,ih,iw), c] = sum_{(r,s,k)} GY[n, (ih+PH-r)/SH, (iw+PW-s)/SW, k] W[k,r,s,c]
* weight grad:   GW[k, (r,s,c)]   = sum_{(n,oh,ow)} GY[(n,oh,ow), k] X[n, oh*SH-PH+r, ow*SW-PW+s, c]

Tuning parameters: BLOCK_M, BLOCK_N, BLOCK_K (tile sizes), PRECISION (``tl.dot``'s input
precision: ``"ieee"`` float32, or ``"tf32"`` on tensor cores, offered where torch lets cuDNN
compute float32 convolutions in TF32), and ``num_warps`` / ``num_stages`` given at launch.
Loaded from this file by ``rapydli/autotune/triton_conv.py``; it runs on a GPU, or on the
CPU under ``TRITON_INTERPRET=1`` for correctness tests.
"""

import triton
import triton.language as tl


@triton.jit
def conv_fwd_kernel(
    x,
    w,
    y,
    N,
    C,
    H,
    W,
    K,
    R,
    S,
    SH,
    SW,
    PH,
    PW,
    OH,
    OW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    M = N * OH * OW
    RSC = R * S * C
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n = offs_m // (OH * OW)
    rem = offs_m % (OH * OW)
    oh = rem // OW
    ow = rem % OW
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, RSC, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        r = offs_k // (S * C)
        t = offs_k % (S * C)
        s = t // C
        c = t % C
        ih = oh[:, None] * SH - PH + r[None, :]
        iw = ow[:, None] * SW - PW + s[None, :]
        mask_a = (offs_m[:, None] < M) & (offs_k[None, :] < RSC) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        a = tl.load(x + ((n[:, None] * H + ih) * W + iw) * C + c[None, :], mask=mask_a, other=0.0)
        mask_b = (offs_k[:, None] < RSC) & (offs_n[None, :] < K)
        b = tl.load(w + offs_n[None, :] * RSC + offs_k[:, None], mask=mask_b, other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    mask_y = (offs_m[:, None] < M) & (offs_n[None, :] < K)
    tl.store(y + offs_m[:, None] * K + offs_n[None, :], acc, mask=mask_y)


@triton.jit
def conv_bwd_data_kernel(
    gy,
    w,
    gx,
    N,
    C,
    H,
    W,
    K,
    R,
    S,
    SH,
    SW,
    PH,
    PW,
    OH,
    OW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    M = N * H * W
    RSK = R * S * K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # input pixels (n, ih, iw)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # input channels c
    n = offs_m // (H * W)
    rem = offs_m % (H * W)
    ih = rem // W
    iw = rem % W
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, RSK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)  # (r, s, k)
        r = offs_k // (S * K)
        t = offs_k % (S * K)
        s = t // K
        k = t % K
        th = ih[:, None] + PH - r[None, :]
        tw = iw[:, None] + PW - s[None, :]
        oh = th // SH
        ow = tw // SW
        mask_a = (
            (offs_m[:, None] < M)
            & (offs_k[None, :] < RSK)
            & (th >= 0)
            & (tw >= 0)
            & (th % SH == 0)
            & (tw % SW == 0)
            & (oh < OH)
            & (ow < OW)
        )
        a = tl.load(gy + ((n[:, None] * OH + oh) * OW + ow) * K + k[None, :], mask=mask_a, other=0.0)
        mask_b = (offs_k[:, None] < RSK) & (offs_n[None, :] < C)
        b = tl.load(w + ((k[:, None] * R + r[:, None]) * S + s[:, None]) * C + offs_n[None, :], mask=mask_b, other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < C)
    tl.store(gx + offs_m[:, None] * C + offs_n[None, :], acc, mask=mask)


@triton.jit
def conv_bwd_weight_kernel(
    x,
    gy,
    gw,
    N,
    C,
    H,
    W,
    K,
    R,
    S,
    SH,
    SW,
    PH,
    PW,
    OH,
    OW,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr = "ieee",
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    M = N * OH * OW
    RSC = R * S * C
    offs_k = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # output channels k
    offs_j = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (r, s, c)
    r = offs_j // (S * C)
    t = offs_j % (S * C)
    s = t // C
    c = t % C
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(0, M, BLOCK_K):
        offs_m = m0 + tl.arange(0, BLOCK_K)  # output pixels (n, oh, ow)
        n = offs_m // (OH * OW)
        rem = offs_m % (OH * OW)
        oh = rem // OW
        ow = rem % OW
        mask_a = (offs_k[:, None] < K) & (offs_m[None, :] < M)
        a = tl.load(gy + offs_m[None, :] * K + offs_k[:, None], mask=mask_a, other=0.0)
        ih = oh[:, None] * SH - PH + r[None, :]
        iw = ow[:, None] * SW - PW + s[None, :]
        mask_b = (offs_m[:, None] < M) & (offs_j[None, :] < RSC) & (ih >= 0) & (ih < H) & (iw >= 0) & (iw < W)
        b = tl.load(x + ((n[:, None] * H + ih) * W + iw) * C + c[None, :], mask=mask_b, other=0.0)
        acc += tl.dot(a, b, input_precision=PRECISION)
    mask = (offs_k[:, None] < K) & (offs_j[None, :] < RSC)
    tl.store(gw + offs_k[:, None] * RSC + offs_j[None, :], acc, mask=mask)
