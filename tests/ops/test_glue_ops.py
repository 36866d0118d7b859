"""The glue ops (norm_modulate, gated_residual, rotary_embedding) against float64 oracles.

Each oracle is Wan's own eager code written in float64 (diffusers' WanTransformerBlock and
WanAttnProcessor), so the ops are held to the model's definition, for every provider and tier.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given

from tests.ops.test_ops import assert_matches_fake
from tests.strategies import assert_close_dtype, glue_cases

ops = torch.ops.amxopt


def norm_modulate_oracle(x, weight, bias, scale, shift, eps, rms):
    xd = x.double()
    if rms:
        y = xd / torch.sqrt((xd * xd).mean(-1, keepdim=True) + eps)
        y = y if weight is None else y * weight.double()
    else:
        w = None if weight is None else weight.double()
        b = None if bias is None else bias.double()
        y = F.layer_norm(xd, (x.shape[-1],), w, b, eps)
    return y * (1 + scale.double()) + shift.double()


def gated_residual_oracle(x, y, gate):
    return x.double() + y.double() * gate.double()


def rotary_oracle(x, cos, sin, interleaved):
    # Wan's apply_rotary_emb (interleaved pairs) or rotate_half, with the angles' cos/sin per pair, or
    # (rotate_half) D wide as Qwen3-VL's vision rotary passes them.
    xd, c, s = x.double(), cos.double(), sin.double()
    if interleaved:
        x1, x2 = xd.unflatten(-1, (-1, 2)).unbind(-1)
        out = torch.empty_like(xd)
        out[..., 0::2] = x1 * c - x2 * s
        out[..., 1::2] = x1 * s + x2 * c
        return out
    h = x.shape[-1] // 2
    cc, ss = (c, s) if c.shape[-1] == 2 * h else (torch.cat((c, c), -1), torch.cat((s, s), -1))
    return xd * cc + torch.cat((-xd[..., h:], xd[..., :h]), -1) * ss


@pytest.mark.parametrize("rms", [False, True])
@given(case=glue_cases())
def test_norm_modulate_matches_oracle(provider, rms, case):
    bias = None if rms else case.bias
    args = (case.x, case.weight, bias, case.scale, case.shift, case.eps, rms, provider)
    out = ops.norm_modulate(*args)
    expected = norm_modulate_oracle(case.x, case.weight, bias, case.scale, case.shift, case.eps, rms)
    assert_close_dtype(out, expected, case.dtype)
    assert_matches_fake(ops.norm_modulate, args, out)


@given(case=glue_cases())
def test_gated_residual_matches_oracle(provider, case):
    args = (case.x, case.y, case.gate, provider)
    out = ops.gated_residual(*args)
    assert_close_dtype(out, gated_residual_oracle(case.x, case.y, case.gate), case.dtype)
    assert_matches_fake(ops.gated_residual, args, out)


@given(case=glue_cases())
def test_rotary_embedding_matches_oracle(provider, case):
    args = (case.y, case.cos, case.sin, case.interleaved, provider)
    out = ops.rotary_embedding(*args)
    assert_close_dtype(out, rotary_oracle(case.y, case.cos, case.sin, case.interleaved), case.dtype)
    assert_matches_fake(ops.rotary_embedding, args, out)


_bf = torch.bfloat16
OPCHECK_CASES = {
    "norm_modulate-bf16-fp32-mod": lambda p: (
        ops.norm_modulate,
        (torch.randn(2, 5, 48, dtype=_bf), None, None, torch.randn(2, 1, 48), torch.randn(2, 1, 48), 1e-6, False, p),
    ),
    "norm_modulate-rms-weight-per-token": lambda p: (
        ops.norm_modulate,
        (torch.randn(2, 3, 20), torch.randn(20), None, torch.randn(2, 3, 20), torch.randn(3, 20), 1e-6, True, p),
    ),
    "gated_residual-bf16": lambda p: (
        ops.gated_residual,
        (torch.randn(2, 7, 40, dtype=_bf), torch.randn(2, 7, 40, dtype=_bf), torch.randn(2, 1, 40), p),
    ),
    "rotary-interleaved-4d": lambda p: (
        ops.rotary_embedding,
        (torch.randn(1, 6, 2, 16, dtype=_bf), torch.randn(1, 6, 1, 8), torch.randn(1, 6, 1, 8), True, p),
    ),
    "rotary-half-fp32": lambda p: (
        ops.rotary_embedding,
        (torch.randn(3, 4, 10), torch.randn(4, 5), torch.randn(4, 5), False, p),
    ),
    "rotary-half-full-width-bf16": lambda p: (
        ops.rotary_embedding,
        (torch.randn(6, 2, 40, dtype=_bf), torch.randn(6, 1, 40), torch.randn(6, 1, 40), False, p),
    ),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES))
def test_opcheck(provider, case):
    op, args = OPCHECK_CASES[case](provider)
    torch.library.opcheck(op, args)


def test_noncontiguous_inputs(provider):
    # x transposed (strided rows), y a slice, cos/sin strided slices as Wan takes them (freqs[..., 0::2]).
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 9, generator=g).transpose(1, 2)  # [2, 9, 32], last dim strided
    y = torch.randn(2, 9, 64, generator=g)[..., ::2]
    gate = torch.randn(2, 1, 32, generator=g)
    freqs = torch.randn(1, 9, 1, 32, generator=g)
    q = torch.randn(2, 9, 3, 32, generator=g).transpose(0, 1).contiguous().transpose(0, 1)
    assert_close_dtype(ops.gated_residual(x, y, gate, provider), gated_residual_oracle(x, y, gate), torch.float32)
    out = ops.norm_modulate(x, None, None, gate, gate[..., :1].expand(2, 1, 32), 1e-6, False, provider)
    assert_close_dtype(out, norm_modulate_oracle(x, None, None, gate, gate[..., :1], 1e-6, False), torch.float32)
    cos, sin = freqs[..., 0::2], freqs[..., 1::2]
    assert_close_dtype(
        ops.rotary_embedding(q, cos, sin, True, provider), rotary_oracle(q, cos, sin, True), torch.float32
    )
    # and their outputs are laid out as the fakes say (contiguous), not as x is
    for op, args in (
        (ops.gated_residual, (x, y, gate, provider)),
        (ops.norm_modulate, (x, None, None, gate, gate, 1e-6, False, provider)),
        (ops.rotary_embedding, (x, cos[:, :, 0], sin[:, :, 0], True, provider)),
    ):
        assert_matches_fake(op, args, op(*args))


_GX = torch.randn(2, 5, 8)
ERROR_CASES = {
    "norm_modulate-scale-shape": (
        lambda p: ops.norm_modulate(_GX, None, None, torch.randn(2, 1, 7), torch.randn(8), 1e-6, False, p),
        r"amxopt\.norm_modulate: scale has shape \(2, 1, 7\), which does not broadcast to \(2, 5, 8\)",
    ),
    "norm_modulate-shift-batch": (
        lambda p: ops.norm_modulate(_GX, None, None, torch.randn(8), torch.randn(3, 1, 8), 1e-6, False, p),
        r"amxopt\.norm_modulate: shift has shape \(3, 1, 8\), which does not broadcast",
    ),
    "norm_modulate-rms-bias": (
        lambda p: ops.norm_modulate(_GX, None, torch.randn(8), torch.randn(8), torch.randn(8), 1e-6, True, p),
        r"amxopt\.norm_modulate: an RMSNorm has no bias",
    ),
    "norm_modulate-int-scale": (
        lambda p: ops.norm_modulate(_GX, None, None, torch.ones(8, dtype=torch.int64), torch.randn(8), 1e-6, False, p),
        r"amxopt\.norm_modulate: scale must be float32 or bfloat16, got torch\.int64",
    ),
    "gated_residual-y-shape": (
        lambda p: ops.gated_residual(_GX, torch.randn(2, 4, 8), torch.randn(8), p),
        r"amxopt\.gated_residual: y must match x torch\.float32 \(2, 5, 8\), got torch\.float32 \(2, 4, 8\)",
    ),
    "gated_residual-y-dtype": (
        lambda p: ops.gated_residual(_GX, _GX.bfloat16(), torch.randn(8), p),
        r"amxopt\.gated_residual: y must match x torch\.float32",
    ),
    "gated_residual-gate-too-many-dims": (
        lambda p: ops.gated_residual(_GX, _GX, torch.randn(1, 2, 5, 8), p),
        r"amxopt\.gated_residual: gate has shape \(1, 2, 5, 8\), which does not broadcast",
    ),
    "gated_residual-gate-middle-dim": (
        lambda p: ops.gated_residual(_GX, _GX, torch.randn(2, 4, 8), p),
        r"amxopt\.gated_residual: gate has shape \(2, 4, 8\), which does not broadcast to \(2, 5, 8\)",
    ),
    "rotary-odd-dim": (
        lambda p: ops.rotary_embedding(torch.randn(2, 7), torch.randn(3), torch.randn(3), True, p),
        r"amxopt\.rotary_embedding: x \(2, 7\) must end in an even dim",
    ),
    "rotary-cos-width": (
        lambda p: ops.rotary_embedding(_GX, torch.randn(5, 8), torch.randn(5, 8), True, p),
        r"amxopt\.rotary_embedding: cos has shape \(5, 8\), which does not broadcast to \(2, 5, 4\)",
    ),
    "rotary-cos-width-half": (
        lambda p: ops.rotary_embedding(_GX, torch.randn(5, 6), torch.randn(5, 6), False, p),
        r"amxopt\.rotary_embedding: cos has shape \(5, 6\), which does not broadcast to \(2, 5, 4\)",
    ),
    "rotary-cos-sin-differ": (
        lambda p: ops.rotary_embedding(_GX, torch.randn(5, 4), torch.randn(1, 4), True, p),
        r"amxopt\.rotary_embedding: cos \(5, 4\) and sin \(1, 4\) must have the same shape",
    ),
}


@pytest.mark.parametrize("case", list(ERROR_CASES))
def test_bad_input_raises(provider, case):
    call, match = ERROR_CASES[case]
    with pytest.raises(ValueError, match=match):
        call(provider)


def test_norm_modulate_of_small_rows_adds_eps(provider):
    # Rows of 1e-3: eps 1e-6 is most of the mean square (without it the rms norm is 0.93 off).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=g) * 1e-3
    scale, shift = torch.randn(64, generator=g) * 0.1, torch.randn(64, generator=g) * 0.1
    for rms in (True, False):
        got = ops.norm_modulate(x, None, None, scale, shift, 1e-6, rms, provider)
        assert_close_dtype(got, norm_modulate_oracle(x, None, None, scale, shift, 1e-6, rms), torch.float32)


def test_gated_residual_of_bf16_rounds_once(provider):
    # x + y * gate in fp32, one rounding to bf16: rounding y * gate first differs in a quarter of
    # the elements (by up to 0.031), within assert_close's bf16 tolerance.
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randn(2, 40, 64, generator=g).bfloat16() for _ in range(2))
    gate = torch.randn(2, 1, 64, generator=g)
    assert torch.equal(ops.gated_residual(x, y, gate, provider), (x.float() + y.float() * gate).bfloat16())
