"""The amxopt custom ops against independent float64 oracles, for every usable provider.

Oracles here are written from the math (not from ``amxopt.ops.reference``), so the reference
provider is tested too; a native provider registering in ``amxopt.ops.providers`` is picked up
by the same tests.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from torch._subclasses.fake_tensor import FakeTensorMode

from amxopt.ops import ACTIVATIONS, AmxOpError, native, providers
from amxopt.ops.library import MAX_SCALE
from tests.strategies import (
    assert_close_dtype,
    linear_cases,
    norm_cases,
    patch_cases,
    varlen_cases,
)

ops = torch.ops.amxopt


# --- oracles: plain math in float64 ------------------------------------------------------------

_ORACLE_ACT = {
    "none": lambda y: y,
    "gelu": lambda y: 0.5 * y * (1.0 + torch.erf(y / math.sqrt(2.0))),
    "gelu_tanh": lambda y: 0.5 * y * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (y + 0.044715 * y**3))),
    "silu": lambda y: y / (1.0 + torch.exp(-y)),
}
assert set(_ORACLE_ACT) == set(ACTIVATIONS)


def linear_oracle(x, weight, bias, activation):
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return _ORACLE_ACT[activation](y)


def attention_oracle(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, causal):
    """Per-segment softmax(q k^T * scale [+ bottom-right causal mask]) v; rows seeing no key are 0."""
    group = q.shape[1] // k.shape[1]
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    bq, bk = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for q0, q1, k0, k1 in zip(bq, bq[1:], bk, bk[1:]):
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        qs = q[q0:q1].double().transpose(0, 1)  # [H, lq, D]
        ks = k[k0:k1].double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, lk, D]
        vs = v[k0:k1].double().repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale  # [H, lq, lk]
        visible = torch.ones(lq, lk, dtype=torch.bool)
        if causal:  # query i (of lq) sees key j (of lk) iff j <= i + lk - lq
            visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        scores = scores.masked_fill(~visible, -math.inf)
        row_max = scores.amax(-1, keepdim=True) if lk else torch.zeros(*scores.shape[:2], 1, dtype=torch.float64)
        row_max = torch.where(torch.isfinite(row_max), row_max, 0.0)
        e = torch.exp(scores - row_max)
        probs = e / e.sum(-1, keepdim=True).clamp_min(1e-300)
        out[q0:q1] = (probs @ vs).transpose(0, 1)
    return out


def patch_oracle(x, weight, bias, kernel_size):
    o = weight.shape[0]
    w = weight.double().reshape(o, x.shape[1], *kernel_size)
    return F.conv3d(x.double(), w, None if bias is None else bias.double(), stride=kernel_size)


def layer_norm_oracle(x, weight, bias, eps):
    w = None if weight is None else weight.double()
    b = None if bias is None else bias.double()
    return F.layer_norm(x.double(), (x.shape[-1],), w, b, eps)


def rms_norm_oracle(x, weight, eps):
    xd = x.double()
    y = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight.double()


def assert_matches_fake(op, args, out):
    """The real output has the shape, dtype and strides the op's fake impl promises."""
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
    with mode:
        fake = op(*fake_args)
    assert (out.shape, out.dtype) == (fake.shape, fake.dtype)
    if out.numel() > 1:
        assert out.stride() == fake.stride(), f"real strides {out.stride()}, fake impl says {fake.stride()}"


def pack(weight, provider):
    return ops.pack_linear_weight(weight, provider)


# --- 1. opcheck on representative inputs -------------------------------------------------------


def _varlen_args(p, lens_q, lens_k, hq, hk, d, causal, dtype):
    g = torch.Generator().manual_seed(0)
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    q = torch.randn(sum(lens_q), hq, d, generator=g).to(dtype)
    k = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    v = torch.randn(sum(lens_k), hk, d, generator=g).to(dtype)
    return (q, k, v, cu(lens_q), cu(lens_k), max(lens_q), max(lens_k), d**-0.5, causal, p)


_bf = torch.bfloat16
OPCHECK_CASES = {
    "pack-fp32": lambda p: (ops.pack_linear_weight, (torch.randn(8, 5), p)),
    "pack-bf16-noncontig": lambda p: (ops.pack_linear_weight, (torch.randn(7, 3, dtype=_bf).t(), p)),
    "linear-fp32-bias-gelu-3d": lambda p: (
        ops.linear,
        (torch.randn(2, 3, 5), pack(torch.randn(4, 5), p), torch.randn(4), "gelu", 4, p),
    ),
    "linear-bf16-nobias-silu": lambda p: (
        ops.linear,
        (torch.randn(3, 7, dtype=_bf), pack(torch.randn(9, 7, dtype=_bf), p), None, "silu", 9, p),
    ),
    "linear-vector-x": lambda p: (ops.linear, (torch.randn(5), pack(torch.randn(3, 5), p), None, "gelu_tanh", 3, p)),
    "varlen-gqa-causal-cross": lambda p: (
        ops.varlen_attention,
        _varlen_args(p, [3, 1], [5, 2], 4, 2, 16, True, torch.float32),
    ),
    "varlen-bf16-mha": lambda p: (ops.varlen_attention, _varlen_args(p, [4, 2, 1], [4, 2, 1], 2, 2, 40, False, _bf)),
    "patch-fp32-bias": lambda p: (
        ops.patch_embed,
        (torch.randn(1, 3, 2, 4, 6), pack(torch.randn(5, 12), p), torch.randn(5), [1, 2, 2], 5, p),
    ),
    "patch-fp32-kernel-not-square": lambda p: (
        ops.patch_embed,
        (torch.randn(1, 3, 2, 4, 8), pack(torch.randn(5, 24), p), None, [1, 2, 4], 5, p),
    ),
    "patch-bf16-channels-last": lambda p: (
        ops.patch_embed,
        (
            torch.randn(2, 2, 4, 8, 4, dtype=_bf).to(memory_format=torch.channels_last_3d),
            pack(torch.randn(6, 64, dtype=_bf), p),
            None,
            [2, 4, 4],
            6,
            p,
        ),
    ),
    "conv2d-fp32-bias-stride2": lambda p: (
        ops.conv2d,
        (torch.randn(2, 3, 9, 8), torch.randn(4, 3, 3, 3), torch.randn(4), [2, 2], [1, 1], [1, 1], 1, "gelu", p),
    ),
    "conv2d-bf16-groups-channels-last": lambda p: (
        ops.conv2d,
        (
            torch.randn(1, 4, 6, 6, dtype=_bf).to(memory_format=torch.channels_last),
            torch.randn(6, 2, 3, 3, dtype=_bf),
            None,
            [1, 1],
            [0, 0],
            [1, 1],
            2,
            "none",
            p,
        ),
    ),
    "layer_norm-fp32": lambda p: (ops.layer_norm, (torch.randn(4, 10), torch.randn(10), torch.randn(10), 1e-5, p)),
    "layer_norm-bf16-fp32-params": lambda p: (
        ops.layer_norm,
        (torch.randn(2, 3, 8, dtype=_bf), torch.randn(8), torch.randn(8), 1e-6, p),
    ),
    "layer_norm-no-params": lambda p: (ops.layer_norm, (torch.randn(3, 7), None, None, 1e-5, p)),
    "rms_norm-fp32": lambda p: (ops.rms_norm, (torch.randn(4, 10), torch.randn(10), 1e-6, p)),
    "rms_norm-bf16": lambda p: (ops.rms_norm, (torch.randn(5, 6, dtype=_bf), torch.randn(6, dtype=_bf), 1e-6, p)),
    "rms_norm-no-weight": lambda p: (ops.rms_norm, (torch.randn(3, 7), None, 1e-6, p)),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(provider, case):
    op, args = OPCHECK_CASES[case](provider)
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_a_gradient_through_an_op_raises(provider, case):
    # No op has a backward: without its own Autograd kernel PyTorch's fallback let the ATen calls
    # inside a kernel record a partial graph (a linear's gradient without its fused bias and gelu).
    op, args = OPCHECK_CASES[case](provider)
    first = next(i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point())
    args = list(args)
    args[first] = args[first].clone().requires_grad_()
    out = op(*args)  # a forward (a trace of parameters that require grad) runs
    with pytest.raises(RuntimeError, match=r"amxopt(::|\.)\w+"):
        out.float().sum().backward()


def test_opcheck_linear_residual(provider):
    x, w = torch.randn(2, 3, 6, dtype=_bf), torch.randn(5, 6, dtype=_bf)
    residual = torch.randn(5, 3, 2, dtype=_bf).permute(2, 1, 0)  # a non-contiguous residual
    torch.library.opcheck(
        ops.linear, (x, pack(w, provider), torch.randn(5), "gelu", 5, provider), {"residual": residual}
    )


def test_opcheck_rms_norm_noncontiguous_x(provider):
    torch.library.opcheck(ops.rms_norm, (torch.randn(8, 6).t(), None, 1e-6, provider))


def test_opcheck_layer_norm_noncontiguous_x(provider):
    torch.library.opcheck(ops.layer_norm, (torch.randn(8, 6).t(), torch.randn(8), None, 1e-6, provider))


# --- 2. properties against the oracles ---------------------------------------------------------


@given(case=linear_cases())
def test_linear_matches_oracle(provider, case):
    _check_linear(provider, case)


@given(case=linear_cases(dtypes=(torch.bfloat16,), even_k=True))
def test_bf16_linear_on_the_packed_kernel_matches_oracle(provider, case):
    # (most of the mixed draws are fp32, and a bf16 one of odd K runs ATen's GEMM: these reach the
    # packed bf16 kernels with every activation, bias and lead shape)
    _check_linear(provider, case)


def _check_linear(provider, case):
    packed = pack(case.weight, provider)
    args = (case.x, packed, case.bias, case.activation, case.weight.shape[0], provider)
    out = ops.linear(*args)
    assert_close_dtype(out, linear_oracle(case.x, case.weight, case.bias, case.activation), case.dtype)
    assert_matches_fake(ops.linear, args, out)


@given(case=varlen_cases())
def test_varlen_attention_matches_oracle(provider, case):
    args = (
        case.q,
        case.k,
        case.v,
        case.cu_seqlens_q,
        case.cu_seqlens_k,
        case.max_seqlen_q,
        case.max_seqlen_k,
        case.scale,
        case.causal,
        provider,
    )
    out = ops.varlen_attention(*args)
    expected = attention_oracle(case.q, case.k, case.v, case.cu_seqlens_q, case.cu_seqlens_k, case.scale, case.causal)
    assert_close_dtype(out, expected, case.dtype)
    assert_matches_fake(ops.varlen_attention, args, out)


@given(case=patch_cases())
def test_patch_embed_matches_conv3d(provider, case):
    packed = pack(case.weight, provider)
    args = (case.x, packed, case.bias, case.kernel_size, case.out_channels, provider)
    out = ops.patch_embed(*args)
    assert_close_dtype(out, patch_oracle(case.x, case.weight, case.bias, case.kernel_size), case.dtype)
    assert_matches_fake(ops.patch_embed, args, out)


@given(case=norm_cases())
def test_layer_norm_matches_oracle(provider, case):
    args = (case.x, case.weight, case.bias, case.eps, provider)
    out = ops.layer_norm(*args)
    assert_close_dtype(out, layer_norm_oracle(case.x, case.weight, case.bias, case.eps), case.dtype)
    assert_matches_fake(ops.layer_norm, args, out)


@given(case=norm_cases())
def test_rms_norm_matches_oracle(provider, case):
    args = (case.x, case.weight, case.eps, provider)
    out = ops.rms_norm(*args)
    assert_close_dtype(out, rms_norm_oracle(case.x, case.weight, case.eps), case.dtype)
    assert_matches_fake(ops.rms_norm, args, out)


# --- 3. bad input: ValueError naming the op and the offending shape/value ------------------------
# (AmxOpError from the Python checks, plain ValueError from the C++ kernels: the same messages.)

_X, _W = torch.randn(3, 5), torch.randn(4, 5)
_Q, _K = torch.randn(6, 2, 8), torch.randn(6, 1, 8)
_CU = torch.tensor([0, 6], dtype=torch.int32)
_PX = torch.randn(1, 2, 2, 4, 4)  # patches of (1, 2, 2): K = 8
_NX = torch.randn(3, 8)


def _lin(p, x=_X, w=_W, bias=None, act="none", out_features=4):
    return ops.linear(x, pack(w, p), bias, act, out_features, p)


def _attn(p, q=_Q, k=_K, v=None, cu_q=_CU, cu_k=_CU):
    return ops.varlen_attention(q, k, k if v is None else v, cu_q, cu_k, 0, 0, 0.35, False, p)


def _patch(p, x=_PX, w=None, bias=None, kernel=(1, 2, 2), out_channels=3):
    w = torch.randn(out_channels, 8, dtype=x.dtype if x.is_floating_point() else torch.float32) if w is None else w
    return ops.patch_embed(x, pack(w, p), bias, list(kernel), out_channels, p)


def _cu(*bounds, dtype=torch.int32):
    return torch.tensor(bounds, dtype=dtype)


_i64 = dict(dtype=torch.int64)
ERROR_CASES = {
    # pack_linear_weight
    "pack-3d": (
        lambda p: pack(torch.randn(2, 3, 4), p),
        r"amxopt\.pack_linear_weight: weight must be \[N, K\], got \(2, 3, 4\)",
    ),
    "pack-fp16": (lambda p: pack(_W.half(), p), r"amxopt\.pack_linear_weight: weight must be .*, got torch\.float16"),
    # linear
    "linear-fp16-x": (lambda p: _lin(p, x=_X.half(), w=_W.half()), r"amxopt\.pack_linear_weight: .*torch\.float16"),
    "linear-fp16-x-fp32-weight": (lambda p: _lin(p, x=_X.half()), r"amxopt\.linear: x must be .*, got torch\.float16"),
    "linear-int-x": (lambda p: _lin(p, x=torch.ones(3, 5, **_i64)), r"amxopt\.linear: x must be .*, got torch\.int64"),
    "linear-fp32-x-bf16-weight": (
        lambda p: _lin(p, w=_W.bfloat16()),
        r"amxopt\.linear: x \(3, 5\) is torch\.float32 but the packed weight is torch\.bfloat16",
    ),
    "linear-last-dim": (
        lambda p: _lin(p, x=torch.randn(3, 6)),
        r"amxopt\.linear: x \(3, 6\) has 6 input features; .* should have shape \(4, 6\), got \(4, 5\)",
    ),
    "linear-0d-x": (
        lambda p: _lin(p, x=torch.tensor(1.0)),
        r"amxopt\.linear: x has shape \(\); it needs at least one dim",
    ),
    "linear-bias-shape": (
        lambda p: _lin(p, bias=torch.randn(3)),
        r"amxopt\.linear: bias has shape \(3,\), expected \(4,\)",
    ),
    "linear-bias-2d": (lambda p: _lin(p, bias=torch.randn(1, 4)), r"amxopt\.linear: bias has shape \(1, 4\)"),
    "linear-activation": (lambda p: _lin(p, act="relu"), r"amxopt\.linear: activation must be one of .*'relu'"),
    "linear-residual-shape": (
        lambda p: ops.linear(_X, pack(_W, p), None, "none", 4, p, residual=torch.randn(1, 4)),
        r"amxopt\.linear: residual has shape \(1, 4\), expected the output's \(3, 4\)",
    ),
    "linear-residual-dtype": (
        lambda p: ops.linear(_X, pack(_W, p), None, "none", 4, p, residual=torch.randn(3, 4, dtype=_bf)),
        r"amxopt\.linear: residual is torch\.bfloat16 but x is torch\.float32",
    ),
    # varlen_attention
    "varlen-fp16": (lambda p: _attn(p, q=_Q.half()), r"amxopt\.varlen_attention: q must be .*, got torch\.float16"),
    "varlen-int-k": (
        lambda p: _attn(p, k=torch.ones(6, 1, 8, **_i64)),
        r"amxopt\.varlen_attention: k must be .*, got torch\.int64",
    ),
    "varlen-2d-q": (lambda p: _attn(p, q=torch.randn(6, 8)), r"amxopt\.varlen_attention: q must be packed .*\(6, 8\)"),
    "varlen-dtypes-differ": (lambda p: _attn(p, q=_Q.bfloat16()), r"amxopt\.varlen_attention: q/k/v dtypes differ"),
    "varlen-kv-shape": (
        lambda p: _attn(p, v=torch.randn(6, 1, 16)),
        r"amxopt\.varlen_attention: k \(6, 1, 8\) and v \(6, 1, 16\) must match",
    ),
    "varlen-head-dim": (
        lambda p: _attn(p, k=torch.randn(6, 1, 16)),
        r"amxopt\.varlen_attention: head dims differ: q 8, k 16",
    ),
    "varlen-heads-not-divisible": (
        lambda p: _attn(p, q=torch.randn(6, 3, 8), k=torch.randn(6, 2, 8)),
        r"amxopt\.varlen_attention: 3 query heads are not a multiple of 2 key/value heads",
    ),
    "varlen-cu-start": (
        lambda p: _attn(p, cu_q=_cu(1, 6)),
        r"amxopt\.varlen_attention: cu_seqlens_q must start at 0, got 1",
    ),
    "varlen-cu-negative-start": (  # a slice q[-1:6] would read nothing, silently
        lambda p: _attn(p, cu_q=_cu(-1, 6)),
        r"amxopt\.varlen_attention: cu_seqlens_q must start at 0, got -1",
    ),
    "varlen-cu-end": (
        lambda p: _attn(p, cu_k=_cu(0, 4)),
        r"amxopt\.varlen_attention: cu_seqlens_k ends at 4 but there are 6 tokens",
    ),
    "varlen-cu-decreasing": (
        lambda p: _attn(p, cu_q=_cu(0, 4, 2, 6), cu_k=_cu(0, 2, 4, 6)),
        r"amxopt\.varlen_attention: cu_seqlens_q must be non-decreasing, got \[0, 4, 2, 6\]",
    ),
    "varlen-cu-float": (
        lambda p: _attn(p, cu_q=_cu(0, 6, dtype=torch.float32)),
        r"amxopt\.varlen_attention: cu_seqlens_q must be a 1-D integer tensor .*torch\.float32",
    ),
    "varlen-cu-bool": (
        lambda p: _attn(p, cu_q=_cu(0, 1, dtype=torch.bool)),
        r"amxopt\.varlen_attention: cu_seqlens_q must be a 1-D integer tensor .*torch\.bool",
    ),
    "varlen-cu-2d": (
        lambda p: _attn(p, cu_k=_CU[None]),
        r"amxopt\.varlen_attention: cu_seqlens_k must be a 1-D integer tensor .*\(1, 2\)",
    ),
    "varlen-cu-one-bound": (  # (zero segments are [0, 0]: a bound alone is no segment list)
        lambda p: _attn(p, q=torch.randn(0, 1, 8), k=torch.randn(0, 1, 8), v=torch.randn(0, 1, 8), cu_q=_cu(0)),
        r"amxopt\.varlen_attention: cu_seqlens_q must be a 1-D integer tensor of at least 2 segment bounds",
    ),
    "varlen-segment-count": (
        lambda p: _attn(p, cu_q=_cu(0, 3, 6)),
        r"amxopt\.varlen_attention: 2 query segments but 1 key segments",
    ),
    # patch_embed
    "patch-not-divisible": (
        lambda p: _patch(p, x=torch.randn(1, 2, 2, 5, 4)),
        r"amxopt\.patch_embed: x \(1, 2, 2, 5, 4\) is not divisible by kernel \(1, 2, 2\)",
    ),
    "patch-4d-x": (lambda p: _patch(p, x=torch.randn(2, 2, 4, 4)), r"amxopt\.patch_embed: x must be \[B, C, T, H, W\]"),
    "patch-kernel-len": (lambda p: _patch(p, kernel=(2, 2)), r"amxopt\.patch_embed: kernel_size must have 3 entries"),
    "patch-fp16-x": (
        lambda p: _patch(p, x=_PX.half(), w=torch.randn(3, 8)),
        r"amxopt\.patch_embed: x must be .*, got torch\.float16",
    ),
    "patch-fp32-x-bf16-weight": (
        lambda p: _patch(p, w=torch.randn(3, 8, dtype=torch.bfloat16)),
        r"amxopt\.patch_embed: x \(1, 2, 2, 4, 4\).* is torch\.float32 but the packed weight is torch\.bfloat16",
    ),
    "patch-channels": (
        lambda p: _patch(p, w=torch.randn(3, 12)),
        r"amxopt\.patch_embed: .*= 8\) has 8 input features; .* got \(3, 12\)",
    ),
    "patch-bias-shape": (
        lambda p: _patch(p, bias=torch.randn(4)),
        r"amxopt\.patch_embed: bias has shape \(4,\), expected \(3,\)",
    ),
    # norms
    "layer_norm-weight-shape": (
        lambda p: ops.layer_norm(_NX, torch.randn(7), None, 1e-5, p),
        r"amxopt\.layer_norm: weight has shape \(7,\), expected \(8,\) for x \(3, 8\)",
    ),
    "layer_norm-bias-shape": (
        lambda p: ops.layer_norm(_NX, None, torch.randn(8, 1), 1e-5, p),
        r"amxopt\.layer_norm: bias has shape \(8, 1\), expected \(8,\)",
    ),
    "layer_norm-int-x": (
        lambda p: ops.layer_norm(torch.ones(3, 8, **_i64), None, None, 1e-5, p),
        r"amxopt\.layer_norm: x must be .*, got torch\.int64",
    ),
    "layer_norm-fp16-weight": (
        lambda p: ops.layer_norm(_NX, torch.randn(8).half(), None, 1e-5, p),
        r"amxopt\.layer_norm: weight must be .*, got torch\.float16",
    ),
    "rms_norm-weight-shape": (
        lambda p: ops.rms_norm(_NX, torch.randn(9), 1e-6, p),
        r"amxopt\.rms_norm: weight has shape \(9,\), expected \(8,\) for x \(3, 8\)",
    ),
    "rms_norm-fp16-x": (
        lambda p: ops.rms_norm(_NX.half(), None, 1e-6, p),
        r"amxopt\.rms_norm: x must be .*, got torch\.float16",
    ),
    "rms_norm-0d-x": (
        lambda p: ops.rms_norm(torch.tensor(1.0), None, 1e-6, p),
        r"amxopt\.rms_norm: x has shape \(\); it needs at least one dim",
    ),
}


# Checks added after the first review of the ops (each was once accepted or crashed).
ERROR_CASES.update(
    {
        "linear-bias-dtype": (
            lambda p: _lin(p, x=_X.bfloat16(), w=_W.bfloat16(), bias=torch.randn(4, dtype=torch.float16)),
            r"amxopt\.linear: bias",
        ),
        "linear-out-features-exceeds-weight": (lambda p: _lin(p, out_features=6), r"amxopt\.linear: .*6"),
        "patch-kernel-zero": (lambda p: _patch(p, kernel=(0, 2, 2)), r"amxopt\.patch_embed: .*kernel"),
        "patch-channels-names-real-x-shape": (
            lambda p: _patch(p, w=torch.randn(3, 12)),
            r"amxopt\.patch_embed: .*\(1, 2, 2, 4, 4\)",
        ),
        "varlen-max-seqlen-too-small": (
            lambda p: ops.varlen_attention(_Q, _K, _K, _CU, _CU, 2, 2, 0.35, False, p),
            r"amxopt\.varlen_attention: .*max_seqlen",
        ),
    }
)


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_raises(provider, case):
    call, match = ERROR_CASES[case]
    with pytest.raises(ValueError, match=match):
        call(provider)


def test_amx_op_error_is_value_error(provider):
    assert issubclass(AmxOpError, ValueError)


# --- 4. edge cases -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_single_row(provider, dtype):
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(19, 37, generator=g) / 6).to(dtype)
    b = torch.randn(19, generator=g).to(dtype)
    packed = pack(w, provider)
    for x in (torch.randn(1, 37, generator=g).to(dtype), torch.randn(37, generator=g).to(dtype)):
        out = ops.linear(x, packed, b, "gelu", 19, provider)
        assert_close_dtype(out, linear_oracle(x, w, b, "gelu"), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_linear_activation_over_the_whole_range(provider, dtype, activation):
    # Outputs from -200 to 200 (an identity weight passes x through exactly) in 48 rows, on the tile
    # engines: the tails where e^(-z^2) or e^(-x) leave fp32's normal range, large values of both signs.
    x = torch.linspace(-200, 200, 48 * 64).reshape(48, 64).to(dtype)
    w = torch.eye(64, dtype=dtype)
    out = ops.linear(x, pack(w, provider), None, activation, 64, provider)
    assert torch.isfinite(out).all()
    assert_close_dtype(out, linear_oracle(x, w, None, activation), dtype)


# Every engine's epilogue: M = 1 (AVX-512-BF16 kernel on AMX), small M, tiles with a padded tail,
# tiles over many work items (each block's epilogue run during the next block's products), K-blocked,
# odd K (plain weight).
@pytest.mark.parametrize(
    "shape",
    # (2100, 4096, 40): 4200 rows, A packed in three waves of 16 MB on the AVX-512-BF16 kernel and
    # converted in two of 64 MB on the fp32 tier (its epilogue read row r's residual for row r + 4096);
    # (2048, 64, 64): 4096 fp32 rows of ATen's product, whose epilogue threads split past one row grain
    [
        (1, 64, 40), (5, 64, 96), (45, 1024, 96), (50, 256, 520), (300, 6200, 300), (13, 33, 70), (2100, 4096, 40),
        (2048, 64, 64),
    ],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_residual_matches_oracle(provider, dtype, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k + n)
    x = torch.randn(2, m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(2, n, m, generator=g).to(dtype).transpose(1, 2)  # strided rows
    out = ops.linear(x, pack(w, provider), b, "gelu", n, provider, residual=residual)
    assert_close_dtype(out, linear_oracle(x, w, b, "gelu") + residual.double(), dtype)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_length_one_segments(provider, causal):
    # Every segment is one query and one key: softmax over a single key is 1, so out == v (per GQA group).
    q, k, v, cu_q, cu_k, *_ = _varlen_args(provider, [1, 1, 1], [1, 1, 1], 4, 2, 16, causal, torch.float32)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, 1, 1, 0.25, causal, provider)
    assert_close_dtype(out, v.repeat_interleave(2, dim=1), torch.float32)


def test_varlen_single_query_sees_all_keys_when_causal(provider):
    args = list(_varlen_args(provider, [1, 3], [9, 3], 2, 1, 16, True, torch.float32))
    causal = ops.varlen_attention(*args)
    args[8] = False
    full = ops.varlen_attention(*args)
    assert_close_dtype(causal[0], full[0], torch.float32)


def test_varlen_causal_bottom_right_when_k_longer(provider):
    q, k, v, cu_q, cu_k, mq, mk, scale, _, p = _varlen_args(provider, [3], [7], 2, 2, 16, True, torch.float32)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, scale, True, p)
    full = ops.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, scale, False, p)
    assert_close_dtype(out, attention_oracle(q, k, v, cu_q, cu_k, scale, True), torch.float32)
    assert_close_dtype(out[-1], full[-1], torch.float32)  # the last query row sees all 7 keys
    assert not torch.allclose(out[0], full[0])
    # Query row i sees keys 0..i+4: changing key 6 affects only the last row, key 5 rows 1 and 2.
    for key, first_affected in ((6, 2), (5, 1)):
        k2, v2 = k.clone(), v.clone()
        k2[key] += 3.0
        v2[key] += 3.0
        out2 = ops.varlen_attention(q, k2, v2, cu_q, cu_k, mq, mk, scale, True, p)
        torch.testing.assert_close(out2[:first_affected], out[:first_affected], atol=0, rtol=0)
        assert not torch.allclose(out2[first_affected:], out[first_affected:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk,d", [(5, 2, 8), (100, 40, 64)])
def test_varlen_causal_q_longer_than_k_rows_without_keys_are_zero(provider, dtype, lq, lk, d):
    # 100 x 40: whole 32-row steps of the AMX tile path see no key, and one step sees some.
    q, k, v, cu_q, cu_k, mq, mk, scale, _, p = _varlen_args(provider, [lq], [lk], 2, 1, d, True, dtype)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, scale, True, p)
    assert_close_dtype(out, attention_oracle(q, k, v, cu_q, cu_k, scale, True), dtype)
    assert not out[: lq - lk].any()
    assert out[lq - lk :].any(dim=-1).all()


def test_varlen_empty_segments(provider):
    # An empty query segment, and a query segment whose key segment is empty (its rows are zero).
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(5, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    v = torch.randn(3, 2, 8, generator=g)
    cu_q, cu_k = _cu(0, 2, 2, 5), _cu(0, 3, 3, 3)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, 0, 0, 0.3, False, provider)
    assert_close_dtype(out, attention_oracle(q, k, v, cu_q, cu_k, 0.3, False), torch.float32)
    assert not out[2:].any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_linear_weight_does_not_mutate_or_alias(provider, dtype):
    # (the third at an odd element offset: its bf16 pairs are 2-byte aligned only, read as 4-byte
    # values by the native packing, undefined behaviour that UBSan reported)
    odd = torch.randn(61).to(dtype)[1:].view(6, 10)
    for weight in (torch.randn(6, 10).to(dtype), torch.randn(10, 6).to(dtype).t(), odd):
        original = weight.clone()
        packed = pack(weight, provider)
        assert torch.equal(packed, pack(original, provider))
        assert torch.equal(weight, original)
        assert packed.dtype == dtype
        assert tuple(packed.shape) == tuple(providers.packed_linear_shape(provider, 6, 10, dtype))
        snapshot = packed.clone()
        weight.add_(1.0)
        assert torch.equal(packed, snapshot)
        x = torch.randn(4, 10).to(dtype)
        assert_close_dtype(
            ops.linear(x, packed, None, "none", 6, provider), linear_oracle(x, original, None, "none"), dtype
        )


def test_patch_embed_is_conv3d_channels_last(provider):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 3, 4, 8, 12, generator=g)
    w = torch.randn(7, 3 * 2 * 4 * 4, generator=g) / 10
    b = torch.randn(7, generator=g)
    args = (x, pack(w, provider), b, [2, 4, 4], 7, provider)
    out = ops.patch_embed(*args)
    expected = F.conv3d(x, w.reshape(7, 3, 2, 4, 4), b, stride=(2, 4, 4))
    assert_close_dtype(out, expected, torch.float32)
    assert out.shape == (2, 7, 2, 2, 3)
    assert out.permute(0, 2, 3, 4, 1).is_contiguous()  # [B, T', H', W', O] in memory
    assert_matches_fake(ops.patch_embed, args, out)


# --- 5. blocking boundaries, layouts and inputs the first review found untested -------------------
# The native engines block their loops (csrc/gemm.cpp: 4-row small-M path, 256-row and 256-column fp32
# tiles, 32-row x 4-block brgemm tiles, and from K = 5120 balanced row chunks of at most 256 x
# 256-column groups x K steps of 512 (on AMX tiles from 17 rows if K % 32 == 0; else brgemm calls of
# 1024); the AVX-512-BF16 kernel: 12-row chunks in 96-row tiles over the whole of K, A swept (and,
# where its rows alias in L1, packed) in waves of 16 MB; the fp32 engine's A converted in waves of
# 64 MB; attention: 256-query x 512-key blocks, 64 x 256 in fp32, 32-row steps over up to 2048 keys
# on AMX tiles); these shapes cross every one of them (at 2 threads; the smaller items of more threads:
# test_results_do_not_depend_on_the_thread_count).

_GEMM_BOUNDARY_SHAPES = [  # (M, K, N)
    (4, 64, 33),  # the last small-M row count off AMX, N one past a 32-column block
    (2, 1024, 40),  # AMX: 2 rows on a zero-padded 16-row tile, 32 K steps (M = 1 stays on AVX-512-BF16)
    (5, 66, 64),  # the first blocked row count
    (13, 1030, 70),  # K > 512 (two K blocks and a tail); 13 rows = a 12-row chunk + 1
    (97, 96, 300),  # M one past a 96-row tile; N past a 256-column group
    (45, 1024, 96),  # AMX tile kernel: 32 K steps, a 13-row tail tile (zero-padded copy)
    (260, 40, 264),  # M past a 256-row sgemm tile, N past 8 blocks
    (40, 4096, 72),  # K-blocked on AMX from K = 4096 at <= 256 rows: a padded 8-row tile, N past 2 blocks
    (300, 6200, 300),  # K-blocked brgemm: 2 row chunks (160 + 140), 6 K steps + a tail of 56, N past a group
    # K-blocked on AMX tiles: chunks of 208 (a 16-row tile at 192) + 182 (a padded last tile), a 32 tail
    (390, 6176, 300),
    (16, 6144, 40),  # K-blocked with too few rows for the tile kernel: brgemm calls
    (2100, 4096, 40),  # AVX-512-BF16: A packed in two waves (21 tiles of 96 rows fill its 16 MB)
    (2100, 4000, 40),  # ... and read in place in two waves (rows 8000 bytes apart)
    (4200, 4096, 40),  # fp32: A converted in two waves (16 chunks of 256 rows fill its 64 MB), 104 rows left
]


@pytest.mark.parametrize("shape", _GEMM_BOUNDARY_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_across_blocking_boundaries(provider, shape, dtype):
    m, k, n = shape
    g = torch.Generator().manual_seed(m * 7 + n)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    out = ops.linear(x, pack(w, provider), b, "gelu_tanh", n, provider)
    assert_close_dtype(out, linear_oracle(x, w, b, "gelu_tanh"), dtype)


# x a column slice of a wider tensor, its rows `width` elements apart. The AVX-512-BF16 kernel reads A
# in place, or packs it where more than 8 rows lie a multiple of 4 KB apart (gemm_avx512_bf16.cpp,
# reads_a_in_place): these cross both, odd strides (4-byte reads at 2-byte offsets) and a packing
# transpose's last, partial group of 16 k pairs.
_ROW_VIEW_SHAPES = [  # (M, K, N, width)
    (40, 1000, 72, 2048),  # packed: 500 k pairs, 4 past the last whole group of 16
    (13, 4094, 40, 4096),  # packed: a 12-row chunk + 1 row
    (8, 4000, 40, 4096),  # in place: 8 rows alias one L1 set, within its 8 ways
    (30, 1536, 70, 1537),  # in place, rows at odd offsets
    (40, 4096, 72, 4160),  # amx: K-blocked, the last 8 rows a padded 16-row tile read with the view's stride
]


@pytest.mark.parametrize("shape", _ROW_VIEW_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_on_row_views(provider, shape, dtype):
    m, k, n, width = shape
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, width, generator=g).to(dtype)[:, :k]
    assert x.stride(0) == width
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    assert_close_dtype(ops.linear(x, pack(w, provider), b, "silu", n, provider), linear_oracle(x, w, b, "silu"), dtype)


# The amx tier's Rows schedule (gemm.cpp, gemm_row_chunks): rows in chunks of 32-row tiles (one per
# thread at least, 1 MB of packed A at most), in waves of 8 chunks (or one per thread), each tile
# packed in K chunks of 256. Chunk counts below at 2 threads.
_ROWS_SCHEDULE_SHAPES = [  # (M, K, N)
    (64, 160, 33),  # the fewest rows it takes at 2 threads; one K chunk; N one past a panel
    (270, 544, 300),  # 9 tiles, the last of 14 rows (the 16-row kernel); a 32-wide K tail; N past a group
    (300, 4000, 200),  # three chunks (1 MB of A each at most); 15 K chunks and a tail of 160
    (1060, 4064, 40),  # 9 chunks of 3-4 tiles: two waves; the last tile 4 rows
    (784, 1024, 96),  # Qwen3-VL's rows
]


@pytest.mark.parametrize("shape", _ROWS_SCHEDULE_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("threads", [1, 2, 3])  # 3: on 2 cores, a thread's share is taken over by another
@pytest.mark.parametrize("provider", ["native-amx"], indirect=True)  # the schedules order the amx tier only
def test_linear_amx_schedules(provider, shape, threads):
    m, k, n = shape
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k + 8, generator=g).to(torch.bfloat16)[:, 8:]  # rows lda = k + 8 apart
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16)
    residual = torch.randn(m, n, generator=g).to(torch.bfloat16)
    packed = pack(w, provider)
    runs = {  # the process's pinned schedule (or none), the call's amx_schedule
        "groups": ("groups", "default"),
        "rows": ("rows", "default"),
        "rows per call": (None, "rows"),  # as autotune leaves it in a graph
        "pinned over the call": ("groups", "rows"),  # the pin wins
    }
    outs, blocks, before_threads = {}, {}, torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for name, (pinned, per_call) in runs.items():
            with native.use_amx_schedule(pinned) if pinned else contextlib.nullcontext():
                assert native.amx_schedule_pinned() == bool(pinned)
                before = native.amx_emulated_blocks() if native.amx_emulated() else 0
                outs[name] = (
                    ops.linear(x, packed, b, "gelu", n, provider, amx_schedule=per_call),
                    ops.linear(x, packed, None, "none", n, provider, residual=residual, amx_schedule=per_call),
                )
                blocks[name] = native.amx_emulated_blocks() - before if native.amx_emulated() else 0
        matters = native.amx_schedule_matters(m, k)  # at this thread count
    finally:
        torch.set_num_threads(before_threads)
    act, plain = outs["rows"]
    assert_close_dtype(act, linear_oracle(x, w, b, "gelu"), torch.bfloat16)
    assert_close_dtype(plain, linear_oracle(x, w, None, "none") + residual.double(), torch.bfloat16)
    # the same fp32 sums in the same order, whatever the schedule
    for name in runs:
        assert all(torch.equal(r, d) for r, d in zip(outs[name], outs["groups"], strict=True)), name
    if native.amx_emulated():
        assert blocks["rows per call"] == blocks["rows"] and blocks["pinned over the call"] == blocks["groups"], blocks
        assert matters == (k > 128 and m >= max(64, 32 * threads))
        if k > 256 and m >= 32 * threads:  # the Rows schedule ran: its blocks are K chunks
            assert blocks["rows"] > blocks["groups"], blocks


def test_amx_schedule_is_checked(provider):
    before = native.amx_schedule(), native.amx_schedule_pinned()
    assert before[1] or before[0] == "groups"  # the default, unless the process pins one
    with pytest.raises(ValueError, match="unknown AMX GEMM schedule 'cols'"):
        with native.use_amx_schedule("cols"):
            pass
    assert (native.amx_schedule(), native.amx_schedule_pinned()) == before
    with native.use_amx_schedule("rows"):
        assert native.amx_schedule() == "rows" and native.amx_schedule_pinned()
    assert (native.amx_schedule(), native.amx_schedule_pinned()) == before  # unpinned again
    native.use_amx_schedule("rows")  # a bare call pins it for good
    try:
        assert native.amx_schedule() == "rows" and native.amx_schedule_pinned()
    finally:
        native._ops().set_amx_schedule("default")
    # linear's own choice, on every provider (the others take no notice of a valid one)
    x, w = torch.randn(3, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="amx_schedule must be one of default, groups, rows, got 'cols'"):
        ops.linear(x, pack(w, provider), None, "none", 4, provider, amx_schedule="cols")
    out = ops.linear(x, pack(w, provider), None, "none", 4, provider, amx_schedule="rows")
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 9])
def test_attention_across_blocking_boundaries(provider, dtype, causal, head_dim):
    # A segment of 2100 queries and keys: more than one key block on every tier (256 keys in fp32, 512
    # in bf16 on brgemm, 2048 on AMX tiles; the last one padded) and 9 to 33 query blocks; one of 97,
    # short ones: 4 heads give far more work items than threads. An odd head dim takes the
    # element-wise packing (bf16 pairs padded with a zero).
    lens = [2100, 97, 1, 50]
    args = _varlen_args(provider, lens, lens, 4, 2, head_dim, causal, dtype)
    out = ops.varlen_attention(*args)
    q, k, v, cu_q, cu_k, _, _, scale, _, _ = args
    expected = attention_oracle(q, k, v, cu_q, cu_k, scale, causal)
    assert_close_dtype(out, expected, dtype)
    # and row by row (bf16's absolute tolerance let 52 keys of the last, partial key block go
    # missing: 0.25 of a row off, against 0.004 of rounding)
    rows, want = out.double().reshape(-1, head_dim), expected.double().reshape(-1, head_dim)
    assert float(((rows - want).norm(dim=1) / want.norm(dim=1).clamp_min(1e-6)).max()) <= 1e-2


def _rotary_factors(tokens, width, seed=1):
    angles = torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed))
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim, interleaved, width", [(64, True, 32), (64, False, 64), (80, False, 40)])
def test_attention_with_rotary_equals_rotary_then_attention(provider, dtype, causal, head_dim, interleaved, width):
    # Bit for bit: q and k rows rotated as they are copied / packed, by the rotary op's own row kernel
    # and rounding. Segments past a key block and a chunk of 32 keys; GQA; q and k strided slices of
    # one qkv tensor (Qwen3-VL's); head dims on the AMX tile kernel (64) and off it (80).
    lens = [600, 37, 1]
    q, _, _, cu, _, m, _, scale, _, _ = _varlen_args(provider, lens, lens, 4, 2, head_dim, causal, dtype)
    kv = torch.randn(q.shape[0], 2, 2, head_dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    k, v = kv.unbind(1)
    cos, sin = _rotary_factors(q.shape[0], width)
    fused = ops.varlen_attention(
        q, k, v, cu, cu, m, m, scale, causal, provider, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved
    )
    qr, kr = (ops.rotary_embedding(t, cos[:, None], sin[:, None], interleaved, provider) for t in (q, k))
    assert torch.equal(fused, ops.varlen_attention(qr, kr, v, cu, cu, m, m, scale, causal, provider))
    # q and k segments of other bounds (the same token count): each token by its own position
    cu_q, cu_k = (
        torch.tensor([0, 2, q.shape[0]], dtype=torch.int32),
        torch.tensor([0, 4, q.shape[0]], dtype=torch.int32),
    )
    fused = ops.varlen_attention(
        q,
        k,
        v,
        cu_q,
        cu_k,
        0,
        0,
        scale,
        causal,
        provider,
        rotary_cos=cos,
        rotary_sin=sin,
        rotary_interleaved=interleaved,
    )
    assert torch.equal(fused, ops.varlen_attention(qr, kr, v, cu_q, cu_k, 0, 0, scale, causal, provider))


def test_opcheck_attention_with_rotary(provider):
    args = _varlen_args(provider, [5, 3], [5, 3], 4, 2, 16, True, torch.bfloat16)
    cos, sin = _rotary_factors(8, 8)
    torch.library.opcheck(
        ops.varlen_attention, args, {"rotary_cos": cos, "rotary_sin": sin, "rotary_interleaved": True}
    )


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(rotary_cos=torch.ones(6, 4)), "rotary_cos and rotary_sin come together"),
        (
            dict(rotary_cos=torch.ones(5, 4), rotary_sin=torch.ones(5, 4)),
            r"rotary_cos must be \[tokens, head_dim / 2\]",
        ),
        (
            dict(rotary_cos=torch.ones(6, 8), rotary_sin=torch.ones(6, 8), rotary_interleaved=True),
            r"i\.e\. \[6, 4\], got \(6, 8\)",
        ),
        (
            dict(rotary_cos=torch.ones(6, 4), rotary_sin=torch.ones(6, 3)),
            r"rotary_cos \(?\[?6, 4\]?\)? and rotary_sin \(?\[?6, 3\]?\)? must have the same shape",
        ),
    ],
)
def test_attention_rotary_is_checked(provider, kwargs, error):
    q = torch.randn(6, 2, 8)
    cu = torch.tensor([0, 6])
    with pytest.raises(ValueError, match=rf"amxopt\.varlen_attention: .*{error}"):
        ops.varlen_attention(q, q, q, cu, cu, 6, 6, 0.3, False, provider, **kwargs)
    odd = torch.randn(6, 2, 5)  # rotated pairs: an odd head dim's last element was left unwritten
    with pytest.raises(ValueError, match=r"amxopt\.varlen_attention: .*even head dim"):
        ops.varlen_attention(
            odd, odd, odd, cu, cu, 6, 6, 0.3, False, provider, rotary_cos=torch.ones(6, 2), rotary_sin=torch.zeros(6, 2)
        )
    with pytest.raises(ValueError, match="same tokens"):  # a cross-attention has no one position per key
        k = torch.randn(4, 2, 8)
        ops.varlen_attention(
            q,
            k,
            k,
            cu,
            torch.tensor([0, 4]),
            6,
            4,
            0.3,
            False,
            provider,
            rotary_cos=torch.ones(6, 4),
            rotary_sin=torch.ones(6, 4),
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_negative_scale_is_correct(provider, dtype, causal):
    q, k, v, cu_q, cu_k, mq, mk, _, _, _ = _varlen_args(provider, [7, 20], [7, 20], 2, 1, 16, causal, dtype)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, -0.4, causal, provider)
    assert_close_dtype(out, attention_oracle(q, k, v, cu_q, cu_k, -0.4, causal), dtype)
    # Across key blocks: the second block's keys give the largest raw products, which a negative scale
    # makes the smallest logits; a running max of the raw products (not a min) took e^100 there: NaN.
    q = torch.ones(1, 1, 8, dtype=dtype)
    k = torch.cat([torch.zeros(256, 1, 8), torch.full((256, 1, 8), 12.5)]).to(dtype)
    v = torch.randn(512, 1, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
    cu_q, cu_k = torch.tensor([0, 1]), torch.tensor([0, 512])
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, 1, 512, -1.0, False, provider)
    assert_close_dtype(out, attention_oracle(q, k, v, cu_q, cu_k, -1.0, False), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_zero_scale_is_the_mean_of_the_visible_values(provider, dtype, causal):
    # (The reference gave NaN rows here, causal: ATen's causal SDPA kernel at scale 0; and, in a
    # segment of more queries than keys, -inf * 0 for the keys a row does not see.)
    q, k, v, cu_q, cu_k, mq, mk, _, _, _ = _varlen_args(provider, [6, 9], [4, 9], 2, 1, 16, causal, dtype)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, mq, mk, 0.0, causal, provider)
    want = torch.zeros(out.shape, dtype=torch.float64)  # (a row that sees no key: zeros)
    for s in range(2):
        q0, q1, k0, k1 = int(cu_q[s]), int(cu_q[s + 1]), int(cu_k[s]), int(cu_k[s + 1])
        for i in range(q0, q1):
            # causal: bottom-right aligned (the last query sees every key)
            seen = v[k0 : (k0 + max(0, i - q0 + 1 + (k1 - k0) - (q1 - q0)) if causal else k1)].double()
            if len(seen):
                want[i] = seen.mean(0).repeat_interleave(q.shape[1] // k.shape[1], 0)
    assert_close_dtype(out, want.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weight_with_wrong_in_features_raises(provider, dtype):
    # Odd K and K + 1 must not share a packed shape: the weight packed for one is refused for the other.
    for k in (5, 6):
        packed = pack(torch.randn(40, k).to(dtype), provider)
        for wrong in (k - 1, k + 1):
            with pytest.raises(ValueError, match=rf"amxopt\.linear: x \(3, {wrong}\) has {wrong} input features"):
                ops.linear(torch.randn(3, wrong).to(dtype), packed, None, "none", 40, provider)
        for wrong_n in (8, 33, 41):
            with pytest.raises(ValueError, match=rf"out_features={wrong_n} the packed weight should have shape"):
                ops.linear(torch.randn(3, k).to(dtype), packed, None, "none", wrong_n, provider)
    # Both wrong at once: a [64, 128] packing is not a [32, 256] one, though it holds as many values.
    packed = pack(torch.randn(64, 128).to(dtype), provider)
    with pytest.raises(ValueError, match=r"x \(3, 256\) has 256 input features; with out_features=32 the packed"):
        ops.linear(torch.randn(3, 256).to(dtype), packed, None, "none", 32, provider)


def test_every_weight_shape_has_its_own_packed_shape(provider):
    shapes = {
        (n, k): providers.packed_linear_shape(provider, n, k, torch.bfloat16)
        for n in range(1, 97)
        for k in range(1, 97)
    }
    assert len(set(shapes.values())) == len(shapes)


ERROR_CASES_NATIVE_ENTRY = {
    "zero-kv-heads": (
        lambda p: ops.varlen_attention(_Q, torch.randn(6, 0, 8), torch.randn(6, 0, 8), _CU, _CU, 0, 0, 0.3, False, p),
        r"amxopt\.varlen_attention: k and v have no heads: \(6, 0, 8\)",
    ),
    "short-bias": (lambda p: _lin(p, bias=torch.randn(2)), r"amxopt\.linear: bias has shape \(2,\), expected \(4,\)"),
    "half-bias": (
        lambda p: _lin(p, bias=torch.randn(4, dtype=torch.float16)),
        r"amxopt\.linear: bias is torch\.float16; it must be torch\.float32$",
    ),
    "short-norm-weight": (
        lambda p: ops.rms_norm(_NX, torch.randn(3), 1e-6, p),
        r"amxopt\.rms_norm: weight has shape \(3,\), expected \(8,\)",
    ),
    "cu-seqlens-beyond-tokens": (
        lambda p: _attn(p, cu_q=_cu(0, 9, 6), cu_k=_cu(0, 3, 6)),
        r"amxopt\.varlen_attention: cu_seqlens_q must be non-decreasing, got \[0, 9, 6\]",
    ),
    "cu-seqlens-negative": (
        lambda p: _attn(p, cu_q=_cu(0, -2, 6), cu_k=_cu(0, 3, 6)),
        r"amxopt\.varlen_attention: cu_seqlens_q must be non-decreasing, got \[0, -2, 6\]",
    ),
    "scale-nan": (
        lambda p: ops.varlen_attention(_Q, _K, _K, _CU, _CU, 0, 0, float("nan"), False, p),
        r"amxopt\.varlen_attention: scale must be finite, at most 1\.70141e\+38 in magnitude, got nan",
    ),
    "scale-past-float": (  # finite as a double, inf as the kernels' float
        lambda p: ops.varlen_attention(_Q, _K, _K, _CU, _CU, 0, 0, -1e39, False, p),
        r"amxopt\.varlen_attention: scale must be finite, at most 1\.70141e\+38 in magnitude, got -1e\+39",
    ),
    "norm-eps-negative": (
        lambda p: ops.layer_norm(_NX, None, None, -1e-6, p),
        r"amxopt\.layer_norm: eps must be finite and not negative, got -1e-06",
    ),
    "norm-eps-nan": (
        lambda p: ops.rms_norm(_NX, None, float("nan"), p),
        r"amxopt\.rms_norm: eps must be finite and not negative, got nan",
    ),
    "norm-eps-minus-one": (
        lambda p: ops.layer_norm(_NX, None, None, -1.0, p),
        r"amxopt\.layer_norm: eps must be finite and not negative, got -1$",
    ),
    "rotary-cos-alone": (
        lambda p: ops.varlen_attention(_Q, _K, _K, _CU, _CU, 0, 0, 0.3, False, p, rotary_cos=torch.ones(6, 4)),
        r"amxopt\.varlen_attention: rotary_cos and rotary_sin come together; got only rotary_cos",
    ),
    "rotary-cross-attention": (
        lambda p: ops.varlen_attention(
            _Q,
            _K[:4],
            _K[:4],
            _CU,
            _cu(0, 4),
            0,
            0,
            0.3,
            False,
            p,
            rotary_cos=torch.ones(6, 4),
            rotary_sin=torch.ones(6, 4),
        ),
        r"amxopt\.varlen_attention: a rotary embedding needs q and k of the same tokens \(self-attention\); q has 6",
    ),
    "zero-out-features": (
        lambda p: _lin(p, out_features=0),
        r"amxopt\.linear: out_features must be in \[1, 2\*\*31\), got 0",
    ),
    "huge-out-features": (  # (the native check printed the packed shape it expected, computed with overflow)
        lambda p: _lin(p, out_features=2**62),
        r"amxopt\.linear: out_features must be in \[1, 2\*\*31\), got 4611686018427387904",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES_NATIVE_ENTRY))
def test_kernel_entry_points_check_their_inputs(provider, case):
    # Called directly (not through a graph): the C++ kernels must refuse these on their own.
    call, match = ERROR_CASES_NATIVE_ENTRY[case]
    with pytest.raises(ValueError, match=match):
        call(provider)


@pytest.mark.parametrize("case", [*ERROR_CASES, *ERROR_CASES_NATIVE_ENTRY])
def test_native_and_reference_refuse_in_the_same_words(case):
    # The C++ kernels check their inputs on their own, in C++: AmxOpError's promise is the same message.
    if not native.available()[0]:
        pytest.skip("the native kernels are not built here")
    call, _ = {**ERROR_CASES, **ERROR_CASES_NATIVE_ENTRY}[case]
    said = {}
    for provider in ("native", "reference"):
        with pytest.raises(ValueError) as e:
            call(provider)
        said[provider] = str(e.value)
    assert said["native"] == said["reference"]


_META = torch.device("meta")
ONE_ON_META = {
    "linear-packed_weight": (lambda p: ops.linear(_X, pack(_W, p).to(_META), None, "none", 4, p),
                             "x on cpu; packed_weight on meta"),
    "linear-bias": (lambda p: _lin(p, bias=torch.randn(4, device=_META)), "x, packed_weight on cpu; bias on meta"),
    "varlen_attention-cu_seqlens": (lambda p: _attn(p, cu_q=_CU.to(_META), cu_k=_CU.to(_META)),
                                    "q, k, v on cpu; cu_seqlens_q, cu_seqlens_k on meta"),
    "patch_embed-x": (lambda p: _patch(p, x=_PX.to(_META)), "x on meta; packed_weight on cpu"),
    "conv2d-weight": (lambda p: ops.conv2d(_PX[:, :, 0], torch.randn(3, 2, 1, 1, device=_META), None, [1, 1], [0, 0],
                                           [1, 1], 1, "none", p), "x on cpu; weight on meta"),
    "layer_norm-weight": (lambda p: ops.layer_norm(_NX, torch.ones(8, device=_META), None, 1e-6, p),
                          "x on cpu; weight on meta"),
    "rms_norm-weight": (lambda p: ops.rms_norm(_NX, torch.ones(8, device=_META), 1e-6, p), "x on cpu; weight on meta"),
    "norm_modulate-scale": (lambda p: ops.norm_modulate(_NX, None, None, torch.zeros(8, device=_META), torch.zeros(8),
                                                        1e-6, True, p), "x, shift on cpu; scale on meta"),
    "gated_residual-gate": (lambda p: ops.gated_residual(_NX, _NX, torch.ones(8, device=_META), p),
                            "x, y on cpu; gate on meta"),
    "rotary_embedding-cos": (lambda p: ops.rotary_embedding(_Q, torch.ones(6, 1, 4, device=_META),
                                                            torch.zeros(6, 1, 4), True, p), "x, sin on cpu; cos on meta"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(ONE_ON_META))
def test_a_tensor_left_on_meta_is_refused(provider, case):
    # Any meta argument sends the call to the op's fake (its Meta kernel), which gave uninitialised CPU
    # memory for output (helper review, stop 61); eager's ops refuse tensors on two devices.
    call, where = ONE_ON_META[case]
    op = case.split("-")[0]
    with pytest.raises(ValueError, match=re.escape(f"amxopt.{op}: its tensors must be on one device, got {where}")):
        call(provider)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_noncontiguous_inputs(provider, dtype):
    g = torch.Generator().manual_seed(5)
    # linear: x a transposed view and a strided slice
    w = (torch.randn(24, 20, generator=g) / 4).to(dtype)
    packed = pack(w, provider)
    for x in (torch.randn(20, 9, generator=g).to(dtype).t(), torch.randn(9, 40, generator=g).to(dtype)[:, ::2]):
        assert not x.is_contiguous()
        assert_close_dtype(ops.linear(x, packed, None, "silu", 24, provider), linear_oracle(x, w, None, "silu"), dtype)
    # attention: q/k/v as head-major views ([H, T, D] transposed) and with a strided head dim
    q, k, v = (torch.randn(2, 30, 16, generator=g).to(dtype).transpose(0, 1) for _ in range(3))
    cu = _cu(0, 12, 30)
    expected = attention_oracle(q, k, v, cu, cu, 0.25, False)
    assert_close_dtype(ops.varlen_attention(q, k, v, cu, cu, 0, 0, 0.25, False, provider), expected, dtype)
    qs, ks, vs = (t.repeat_interleave(2, dim=2)[:, :, ::2] for t in (q, k, v))
    assert qs.stride(2) == 2
    assert_close_dtype(ops.varlen_attention(qs, ks, vs, cu, cu, 0, 0, 0.25, False, provider), expected, dtype)
    # norms: a transposed x and a column slice
    for x in (torch.randn(16, 5, generator=g).to(dtype).t(), torch.randn(5, 32, generator=g).to(dtype)[:, :16]):
        assert_close_dtype(ops.layer_norm(x, None, None, 1e-5, provider), layer_norm_oracle(x, None, None, 1e-5), dtype)
        assert_close_dtype(ops.rms_norm(x, None, 1e-5, provider), rms_norm_oracle(x, None, 1e-5), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "shape,weight,params",
    [
        ((3, 1, 17, 10), (8, 1, 3, 3), dict(stride=[2, 2], padding=[1, 1], dilation=[1, 1], groups=1)),
        ((2, 6, 9, 9), (6, 3, 3, 2), dict(stride=[1, 2], padding=[0, 1], dilation=[2, 1], groups=2)),
        # conv.cpp's direct kernel (Cin x kh x kw <= 64): the Omni audio conv's form with rows of 50
        # outputs (two vectors and a masked tail), asymmetric stride / padding / dilation, K = 63 (the
        # largest direct K), and K = 72 (ATen's convolution again)
        ((2, 1, 24, 100), (16, 1, 3, 3), dict(stride=[2, 2], padding=[1, 1], dilation=[1, 1], groups=1)),
        ((1, 2, 11, 40), (5, 2, 3, 5), dict(stride=[1, 3], padding=[2, 0], dilation=[2, 1], groups=1)),
        ((2, 7, 8, 9), (4, 7, 3, 3), dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1)),
        ((2, 8, 8, 9), (4, 8, 3, 3), dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1)),
        # 40 output channels: the direct kernel's loop over two channel vectors, and a masked third
        ((1, 1, 8, 10), (40, 1, 3, 3), dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1)),
        # conv.cpp's im2col + GEMM (bf16, even K > 64, amx tier): 1200 rows (two im2col
        # chunks of at most 1024) x 40 channels (a partial column block) at K = 288 (tile kernel); K =
        # 120 (not a multiple of 32) with asymmetric stride / padding / dilation; a 1x1 conv; K = 81
        # (odd: ATen's convolution)
        ((2, 32, 24, 25), (40, 32, 3, 3), dict(stride=[1, 1], padding=[1, 1], dilation=[1, 1], groups=1)),
        ((1, 8, 11, 40), (20, 8, 3, 5), dict(stride=[1, 3], padding=[2, 0], dilation=[2, 1], groups=1)),
        ((2, 96, 5, 7), (48, 96, 1, 1), dict(stride=[1, 1], padding=[0, 0], dilation=[1, 1], groups=1)),
        ((2, 9, 8, 9), (4, 9, 3, 3), dict(stride=[2, 2], padding=[1, 1], dilation=[1, 1], groups=1)),
    ],
)
@pytest.mark.parametrize("act", ["none", "gelu"])
def test_conv2d_matches_oracle(provider, dtype, shape, weight, params, act):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(*shape, generator=g).to(dtype)
    w = (torch.randn(*weight, generator=g) / 4).to(dtype)
    b = torch.randn(weight[0], generator=g).to(dtype)
    oracle = {"none": lambda y: y, "gelu": F.gelu}[act]
    out = ops.conv2d(x, w, b, *params.values(), act, provider)
    assert_close_dtype(out, oracle(F.conv2d(x.double(), w.double(), b.double(), **params)), dtype)
    args = (x, w, b, *params.values(), act, provider)
    assert_matches_fake(ops.conv2d, args, out)  # conv.cpp's outputs are channels-last, and so are their fakes'
    # channels-last x and an fp32 bias (rounded to x's dtype first, as the reference does)
    xc, b32 = x.contiguous(memory_format=torch.channels_last), torch.randn(weight[0], generator=g)
    out = ops.conv2d(xc, w, b32, *params.values(), act, provider)
    assert_close_dtype(out, oracle(F.conv2d(x.double(), w.double(), b32.to(dtype).double(), **params)), dtype)


@pytest.mark.parametrize(
    "x, weight, padding",
    [
        ((1, 2, 3, 3), (4, 2, 5, 5), [1, 1]),  # a window exactly as large as the padded image
        ((0, 3, 0, 5), (4, 3, 1, 1), [1, 1]),  # an empty batch may have an empty spatial dim
    ],
    ids=["exact-window", "empty-batch-and-image"],
)
@pytest.mark.parametrize("layout", ["contiguous", "channels-last-weight"])
def test_conv2d_takes_the_edge_cases_eager_takes(provider, x, weight, padding, layout):
    # A channels-last weight and a 1x1 output: gelu laid it out otherwise than the convolution (the
    # reference applied it out of place), and the fake promised the convolution's layout.
    x, w = torch.randn(*x), torch.randn(*weight)
    w = w.contiguous(memory_format=torch.channels_last) if layout != "contiguous" else w
    args = (x, w, None, [1, 1], padding, [1, 1], 1, "gelu", provider)
    out = ops.conv2d(*args)
    torch.testing.assert_close(out, F.gelu(F.conv2d(x, w, None, 1, padding)))
    assert_matches_fake(ops.conv2d, args, out)


@pytest.mark.parametrize("cin", [7, 8])  # K = 63: the direct kernel; K = 72: im2col + GEMM on amx, else ATen's
def test_conv2d_rounds_an_fp32_bias_to_x_dtype_first(provider, cin):
    # Every output is exactly 1 + bias: an fp32 bias of 256.75 rounded to bf16 first (256) gives 257,
    # a tie that rounds to 256; added unrounded it gives 257.75 -> 258. A tolerance cannot tell them apart.
    x = torch.ones(1, cin, 5, 6, dtype=torch.bfloat16)
    w = torch.zeros(4, cin, 3, 3, dtype=torch.bfloat16)
    w[:, 0, 1, 1] = 1
    b32 = torch.full((4,), 256.75)
    out = ops.conv2d(x, w, b32, [1, 1], [0, 0], [1, 1], 1, "none", provider)
    assert torch.equal(out.float(), torch.full((1, 4, 3, 4), 256.0)), out.unique()


@pytest.mark.parametrize(
    "call,match",
    [
        (
            lambda p: ops.conv2d(
                torch.randn(2, 3, 4), torch.randn(4, 3, 1, 1), None, [1, 1], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: x must be \[B, C, H, W\], got \(2, 3, 4\)",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 3, 4, 4), torch.randn(4, 2, 1, 1), None, [1, 1], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: weight \(4, 2, 1, 1\) with groups=1 does not take the 3 channels",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 4, 4, 4), torch.randn(3, 2, 1, 1), None, [1, 1], [0, 0], [1, 1], 2, provider=p
            ),
            r"amxopt\.conv2d: weight \(3, 2, 1, 1\) has 3 output channels, not a multiple of groups=2",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 3, 4, 4), torch.randn(4, 3, 1, 1), torch.randn(5), [1, 1], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: bias must be \(4,\)",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 3, 4, 4),
                torch.randn(4, 3, 1, 1),
                torch.randn(4).half(),
                [1, 1],
                [0, 0],
                [1, 1],
                1,
                provider=p,
            ),
            r"amxopt\.conv2d: bias must be \(4,\) in torch.float32 or float32, got torch.float16",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 3, 4, 4), torch.randn(4, 3, 1, 1), None, [1, 1], [0, 0], [1, 1], 1, "relu", p
            ),
            r"amxopt\.conv2d: activation must be one of .*got 'relu'",
        ),
        (  # a stride > 1 must not round a window that hangs off x up to one output
            lambda p: ops.conv2d(
                torch.randn(1, 1, 5, 5), torch.randn(4, 1, 6, 6), None, [2, 2], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: the kernel's window \(6 with dilation 1\) is larger than x's padded size 5 in dim 2",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 1, 9, 5), torch.randn(4, 1, 3, 3), None, [3, 3], [0, 0], [3, 3], 1, provider=p
            ),
            r"amxopt\.conv2d: the kernel's window \(7 with dilation 3\) is larger than x's padded size 5 in dim 3",
        ),
        (  # a dilation whose window is past int64: the native check wrapped and took it
            lambda p: ops.conv2d(
                torch.randn(1, 1, 5, 5), torch.randn(4, 1, 3, 3), None, [1, 1], [0, 0], [2**62, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: the kernel's window \([^)]+ with dilation 4611686018427387904\) is larger than x's padded "
            r"size 5 in dim 2",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 1, 5, 5), torch.randn(4, 1, 1, 1), None, [0, 1], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: stride and dilation must be positive and padding not negative, got stride \[0, 1\]",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 1, 5, 5), torch.randn(0, 1, 1, 1), None, [1, 1], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: weight \(0, 1, 1, 1\) has no output channels",
        ),
        (
            lambda p: ops.conv2d(
                torch.randn(1, 1, 5, 5), torch.randn(4, 1, 0, 3), None, [1, 1], [0, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: weight \(4, 1, 0, 3\) has an empty kernel",
        ),
        (  # eager's convolution refuses it too; native wrote the bias into a (1, 4, 2, 4) output
            lambda p: ops.conv2d(
                torch.randn(1, 3, 0, 6), torch.randn(4, 3, 1, 3), None, [1, 1], [1, 0], [1, 1], 1, provider=p
            ),
            r"amxopt\.conv2d: x \(1, 3, 0, 6\) has an empty spatial dim",
        ),
    ],
    ids=[
        "3d-x",
        "channels",
        "groups-of-outputs",
        "bias",
        "bias-dtype",
        "activation",
        "window",
        "dilated-window",
        "window-past-int64",
        "stride",
        "no-output-channels",
        "empty-kernel",
        "empty-image",
    ],
)
def test_conv2d_bad_input_raises(provider, call, match):
    with pytest.raises(ValueError, match=match):
        call(provider)


# A window at an edge wholly in the padding, x or the weight channels-last: oneDNN's fp32 kernels
# (torch 2.13, AVX2) read out of bounds there, and crashed the process (eager fp32 crashes too).
_EDGE_CONV = """
import sys, torch, torch.nn.functional as F
from amxopt.ops import native
from tests.ops.test_ops import assert_close_dtype, assert_matches_fake
provider, tier = sys.argv[1:]
cl = torch.channels_last
cases = [  # x, x channels-last, weight, weight channels-last, stride, padding, dilation, groups
    ((3, 6, 13, 1), False, (99, 2, 7, 2), True, [9, 4], [1, 3], [1, 2], 3),
    ((2, 4, 13, 1), True, (4, 2, 3, 1), False, [1, 2], [0, 3], [1, 2], 2),
    ((2, 4, 13, 2), True, (4, 4, 1, 1), True, [4, 4], [5, 5], [2, 2], 1),
]
g = torch.Generator().manual_seed(0)
with native.max_tier(tier) if tier else torch.no_grad():
    for dtype in (torch.float32, torch.bfloat16):
        for xs, xcl, ws, wcl, *params in cases:
            x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in (xs, ws, ws[:1]))
            args = (x.contiguous(memory_format=cl) if xcl else x, w.contiguous(memory_format=cl) if wcl else w, b)
            out = torch.ops.amxopt.conv2d(*args, *params, "gelu", provider)
            want = F.gelu(F.conv2d(x.double(), w.double(), b.double(), *params))
            assert_close_dtype(out, want, dtype)
            assert_matches_fake(torch.ops.amxopt.conv2d, (*args, *params, "gelu", provider), out)
"""


def test_conv2d_of_a_window_wholly_in_the_padding_runs(provider):
    tier = "" if provider == "reference" else native.active_tier()
    code = [sys.executable, "-c", _EDGE_CONV, provider, tier]
    done = subprocess.run(code, cwd=pathlib.Path(__file__).parents[2], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-3000:]}"


def test_conv2d_of_the_sgl_provider_has_the_native_kernels_strides():
    # sgl_kernel has no conv2d, so that provider runs the native kernel (channels-last): its fake said contiguous
    if not native.available()[0]:
        pytest.skip("the native kernels are not built here")
    args = (torch.randn(1, 1, 8, 8), torch.randn(4, 1, 3, 3), None, [1, 1], [0, 0], [1, 1], 1, "none", "sgl_kernel")
    out = ops.conv2d(*args)
    assert out.is_contiguous(memory_format=torch.channels_last)
    assert_matches_fake(ops.conv2d, args, out)


@pytest.mark.parametrize("threads", [3, 8, 24])
def test_results_do_not_depend_on_the_thread_count(provider, threads):
    """The GEMM and attention share their work items between threads, which take items from each
    other's shares once their own is done, and cut smaller items where the thread count would leave
    threads without one (native.linear_work_split): with more threads than cores (and than the
    tuned items) every output is still computed once, each sum in the same order, so the results are
    bitwise those of one thread. (The fp32 engine's row chunks change the M of its sgemm calls with
    the thread count; MKL's sgemm gives each row the same sums whatever M, on the CPUs tested.)"""
    g = torch.Generator().manual_seed(11)
    gemms = []
    # the second K-blocked on the amx tier; the third in two waves on the fp32 engine (one item of all of
    # a wave's rows per column group at one thread, row chunks at more)
    for m, k, n in [(100, 64, 200), (200, 5120, 96), (4200, 4096, 40)]:
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(torch.bfloat16)
        gemms.append((torch.randn(m, k, generator=g).to(torch.bfloat16), ops.pack_linear_weight(w, provider), n))
    q, k, v = (torch.randn(150, 4, 32, generator=g).to(torch.bfloat16) for _ in range(3))
    cu = torch.tensor([0, 40, 150], dtype=torch.int32)

    def run():
        linears = [ops.linear(x, packed, None, "gelu", n, provider) for x, packed, n in gemms]
        return (*linears, ops.varlen_attention(q, k, v, cu, cu, 110, 110, 0.2, True, provider))

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        expected = run()
        torch.set_num_threads(threads)
        if provider == "native" and threads == 24:  # these calls cut smaller items than at one thread
            assert native.linear_work_split(200, 96, 5120, 24) != native.linear_work_split(200, 96, 5120, 1)
            assert native.attention_work_split([40, 110], 4, True, 24).rows < 128
        for _ in range(3):
            for a, e in zip(run(), expected, strict=True):
                assert torch.equal(a, e)
    finally:
        torch.set_num_threads(before)


# The real models' GEMMs (rows, K, N) and attentions (segments, heads), for work split checks.
_MODEL_GEMMS = {
    "qwen3-vl qkv": (784, 1024, 3072),
    "qwen3-vl fc2": (784, 4096, 1024),
    "qwen3-vl merger": (196, 4096, 2048),
    "omni q": (390, 1280, 1280),
    "omni fc2": (390, 5120, 1280),
    "wan cross k": (512, 1536, 1536),
    "wan ffn up": (1280, 1536, 8960),
    "wan ffn down": (1280, 8960, 1536),
    "wan time proj": (1, 1536, 9216),
}
_MODEL_ATTENTIONS = {"qwen3-vl": ([784], 16), "omni audio": ([98, 98, 98, 96], 20), "wan": ([1280], 12)}


@pytest.mark.parametrize("threads", [56, 96])
def test_work_items_keep_many_threads_busy(provider, threads):
    """On a many-core Xeon the items tuned on 2 cores would leave most threads idle (the K-blocked AMX
    GEMM made 10 of Qwen3-Omni's fc2, 8 of Qwen3-VL's merger; the fp32 engine 4 of Qwen3-VL's fc2; the
    attention 60 of Wan's 12 heads): every model GEMM of 32 rows or more and every attention now keeps
    at least 80% of the threads busy."""
    if provider != "native":
        pytest.skip("work items are the native kernels'")
    for name, (m, k, n) in _MODEL_GEMMS.items():
        split = native.linear_work_split(m, n, k, threads)
        if m >= 32:
            assert split.balance(threads) >= 0.8, (name, split)
    for name, (lens, heads) in _MODEL_ATTENTIONS.items():
        split = native.attention_work_split(lens, heads, True, threads)
        assert split.balance(threads) >= 0.8, (name, split)


# The items each engine was tuned for on 2 cores (rows, columns), which every model shape keeps there.
_TUNED_ITEMS = {
    # the K-blocked engine's rows: chunks of nearly equal size, at most 256 (390 = 208 + 182)
    "amx": {"qwen3-vl qkv": (32, 128), "omni fc2": (208, 256), "wan ffn down": (256, 256), "wan time proj": (96, 128)},
    "avx512_bf16": {name: (96, 128) for name in ("qwen3-vl qkv", "omni fc2", "wan ffn down", "wan time proj")},
    "fp32": {"qwen3-vl qkv": (784, 256), "wan ffn down": (1280, 256), "wan time proj": (1, 32)},
}


def test_work_items_on_two_threads_are_the_tuned_ones(provider):
    if provider != "native":
        pytest.skip("work items are the native kernels'")
    if native.amx_schedule_pinned():
        pytest.skip("an AMX GEMM schedule is pinned for this process (AMXOPT_AMX_SCHEDULE)")
    for name, item in _TUNED_ITEMS[native.active_tier()].items():
        m, k, n = _MODEL_GEMMS[name]
        assert native.linear_work_split(m, n, k, 2)[:2] == item, name
    for lens, heads in _MODEL_ATTENTIONS.values():
        assert native.attention_work_split(lens, heads, True, 2).rows == (64 if native.active_tier() == "fp32" else 256)
    # ... except where those leave a thread idle: Omni's 5 column groups of 256 on the fp32 engine
    if native.active_tier() == "fp32":
        assert native.linear_work_split(390, 1280, 1280, 2) == (390, 128, 10)


# --- values at the edges: NaN, infinities, huge negatives, zero widths ---------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [40, 6])
def test_attention_propagates_nan_and_inf_scores_as_the_math_does(provider, dtype, length):
    # A NaN key makes every row NaN, a NaN query element its own row, a +inf score the rows it
    # reaches: never a key treated as masked or a row of zeros (the fp32 softmax did both; ATen's
    # fused kernels, which the reference called, write zeros for a NaN query row, in bf16 and in
    # short fp32 segments).
    cu = torch.tensor([0, length], dtype=torch.int32)
    q, k, v = (torch.randn(length, 1, 64, generator=torch.Generator().manual_seed(i)) for i in range(3))
    nan_key, nan_query, inf_key = k.clone(), q.clone(), k.clone()
    nan_key[3, 0, 5], nan_query[1, 0, 2], inf_key[3, 0, 5] = math.nan, math.nan, math.inf
    for qq, kk in ((q, nan_key), (nan_query, k), (q, inf_key)):
        scores = qq[:, 0] @ kk[:, 0].T * 0.125
        want = torch.softmax(scores, dim=-1).isnan().any(dim=-1)[:, None, None].expand(length, 1, 64)
        got = ops.varlen_attention(qq.to(dtype), kk.to(dtype), v.to(dtype), cu, cu, 0, 0, 0.125, False, provider)
        assert torch.equal(got.isnan(), want) and want.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scale", [0.125, -0.125, 1e20, MAX_SCALE])
def test_attention_of_huge_finite_scores_is_the_softmax(provider, dtype, scale):
    # MAX_SCALE, the largest scale the op takes: the reference gave NaN (inf - inf in ATen's softmax)
    # Scaled scores past 2^31: the largest one's weight must be exactly 1. Against a rounded scaled
    # max it was e^(rounding residual), which overflowed (NaN rows) or underflowed (zeros).
    cu = torch.tensor([0, 8, 20], dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    q, k = ((torch.randn(20, 2, 64, generator=gen) * 1e5).to(dtype) for _ in range(2))
    v = torch.randn(20, 2, 64, generator=gen).to(dtype)
    got = ops.varlen_attention(q, k, v, cu, cu, 0, 0, scale, False, provider)
    assert_close_dtype(got, attention_oracle(q, k, v, cu, cu, scale, False), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_keeps_a_huge_first_score_across_key_blocks(provider, dtype):
    # The first key's score 400 above every later one, 600 keys (several key blocks): each later
    # block's scores are rescaled against the running max, which a block's own max must not replace.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, 1, 16, generator=gen) for n in (1, 600, 600))
    q[0, 0, 0] = k[0, 0, 0] = 40.0
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cu_q, cu_k = torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 600], dtype=torch.int32)
    got = ops.varlen_attention(q, k, v, cu_q, cu_k, 0, 0, 0.25, False, provider)
    assert_close_dtype(got, attention_oracle(q, k, v, cu_q, cu_k, 0.25, False), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_rows_that_see_no_key_are_zero_after_a_nan_attention(provider, dtype):
    # One thread, so the second call reuses the first's scratch: NaN left there by a NaN key must not
    # reach rows of a causal segment (600 queries, 40 keys) that see no key.
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(600, 2, 64, generator=gen).to(dtype) for _ in range(3))
    poisoned = k.clone()
    poisoned[3, :, 5] = math.nan
    cu, cu_k = torch.tensor([0, 600], dtype=torch.int32), torch.tensor([0, 40], dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ops.varlen_attention(q, poisoned, v, cu, cu, 0, 0, 0.125, False, provider)
        got = ops.varlen_attention(q, k[:40], v[:40], cu, cu_k, 0, 0, 0.125, True, provider)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[:560], torch.zeros_like(got[:560]))
    assert_close_dtype(got, attention_oracle(q, k[:40], v[:40], cu, cu_k, 0.125, True), dtype)


@pytest.mark.parametrize("d", [5, 37, 1152])
def test_layer_norm_of_a_small_spread_beside_a_large_mean(provider, d):
    # 300 +- 1e-3 in fp32: the rounded mean alone is off by up to 2% of the spread (0.07 off at D = 5,
    # as ATen's own layer_norm is: 0.09-0.16, hence no reference here); the deviations' sum corrects it.
    if provider == "reference":
        pytest.skip("ATen's layer_norm, the reference, loses the spread beside a large mean")
    g = torch.Generator().manual_seed(0)
    x = (300 + 1e-3 * torch.randn(8, d, generator=g, dtype=torch.float64)).float()
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    want = F.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-12)
    assert (ops.layer_norm(x, w, b, 1e-12, provider).double() - want).abs().max() < 1e-5
    scale, shift = torch.randn(d, generator=g), torch.randn(d, generator=g)
    got = ops.norm_modulate(x, w, b, scale, shift, 1e-12, False, provider)
    assert (got.double() - (want * (1 + scale.double()) + shift.double())).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [5, 40, 1152])
def test_norms_of_rows_whose_squares_overflow_fp32(provider, dtype, d):
    # |x| ~ 1e20: x * x overflows fp32, and the native rows came out all zeros (helper review, stop 61);
    # ATen's layer_norm, the reference, gives NaN there, and its rms_norm zeros.
    if provider == "reference":
        pytest.skip("ATen's norms, the reference, overflow on these rows")
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(6, d, generator=g) * 1e20).to(dtype)
    x[5] = torch.randn(d, generator=g).to(dtype)  # an ordinary row beside them
    w, b = torch.randn(d, generator=g), torch.randn(d, generator=g)
    scale, shift = torch.randn(d, generator=g), torch.randn(d, generator=g)
    for rms in (False, True):
        want = (
            F.rms_norm(x.double(), (d,), w.double(), 1e-6)
            if rms
            else F.layer_norm(x.double(), (d,), w.double(), b.double(), 1e-6)
        )
        got = ops.rms_norm(x, w, 1e-6, provider) if rms else ops.layer_norm(x, w, b, 1e-6, provider)
        assert_close_dtype(got, want.to(dtype), dtype)
        got = ops.norm_modulate(x, w, None if rms else b, scale, shift, 1e-6, rms, provider)
        assert_close_dtype(got, (want * (1 + scale.double()) + shift.double()).to(dtype), dtype)
    nan = x.clone()
    nan[0, 1] = math.inf  # an infinity still gives NaN, as in eager
    assert ops.layer_norm(nan, w, b, 1e-6, provider)[0].isnan().all()


def test_gelu_of_huge_negative_values_is_zero(provider):
    # gelu(v) -> -0 as v -> -inf; v times the capped erf tail grew with |v| (-1.3 at -1e36).
    x = torch.tensor([[-13.0, -1e10, -1e30, -1e36, -3e38] + [-20.0] * 11])
    got = ops.linear(x, ops.pack_linear_weight(torch.eye(16), provider), None, "gelu", 16, provider)
    assert torch.equal(got, torch.zeros_like(got))


def test_zero_width_rows_normalize_and_zero_in_features_is_refused(provider):
    x = torch.randn(4, 0)
    assert ops.layer_norm(x, None, None, 1e-5, provider).shape == (4, 0)
    assert ops.rms_norm(x, None, 1e-5, provider).shape == (4, 0)
    with pytest.raises(ValueError, match=r"amxopt.linear: x has shape \(4, 0\).*in_features > 0"):
        ops.linear(x, ops.pack_linear_weight(torch.randn(8, 1), provider), torch.randn(8), "none", 8, provider)


def test_an_fp32_bias_on_bf16_rows_is_added_in_fp32_and_rounded_once(provider):
    # An identity weight: each output is x + bias, exact in fp32, so rounding once gives one bf16
    # value. The bias is no bf16 value: dropped or rounded to bf16 first, the output differs.
    n = 64
    x = torch.full((3, n), -(2.0**-9)).bfloat16()
    bias = 1 + torch.arange(n, dtype=torch.float32) * 2.0**-10
    out = ops.linear(x, ops.pack_linear_weight(torch.eye(n).bfloat16(), provider), bias, "none", n, provider)
    assert torch.equal(out, (x.float() + bias).bfloat16())


def test_norms_of_small_rows_add_eps_and_take_eps_zero(provider):
    # Rows of 1e-3: eps 1e-6 is most of the mean square (without it the rms norm is 0.93 off);
    # eps = 0 is valid (nn.LayerNorm(eps=0)) where the rows have a spread.
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 1e-3
    assert_close_dtype(ops.rms_norm(x, None, 1e-6, provider), rms_norm_oracle(x, None, 1e-6), torch.float32)
    assert_close_dtype(
        ops.layer_norm(x, None, None, 1e-6, provider), layer_norm_oracle(x, None, None, 1e-6), torch.float32
    )
    y = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    assert_close_dtype(
        ops.layer_norm(y, None, None, 0.0, provider), layer_norm_oracle(y, None, None, 0.0), torch.float32
    )
    assert_close_dtype(ops.rms_norm(y, None, 0.0, provider), rms_norm_oracle(y, None, 0.0), torch.float32)


def test_conv2d_fake_at_the_direct_kernels_largest_width(provider):
    # Cin * kh * kw = 64, the direct kernel's bound: the fake must give its output's strides.
    args = (torch.randn(1, 4, 9, 9), torch.randn(8, 4, 4, 4), None, [1, 1], [0, 0], [1, 1], 1, "none", provider)
    assert_matches_fake(ops.conv2d, args, ops.conv2d(*args))
