"""Plain-ATen implementations of every amxopt op: the oracle for all tests and the fallback provider.

Readable over fast: each function is the definition of what its op computes. Inputs have been
validated by ``amxopt.ops.library`` before they get here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._prims_common import suggest_memory_format

ACTIVATIONS = {
    "none": lambda y: y,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "silu": F.silu,
}


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    # The reference layout is the plain [N, K] matrix, in its own contiguous storage.
    return weight.detach().contiguous().clone()


def linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out_features: int,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    if residual is not None:  # act(x W^T + b) + residual in fp32, rounded once
        y = F.linear(x.float(), packed_weight.float(), None if bias is None else bias.float())
        return (ACTIVATIONS[activation](y) + residual.float()).to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:  # fp32 bias on bf16 x: add in fp32, round once
        y = (F.linear(x, packed_weight).float() + bias).to(x.dtype)
    else:
        y = F.linear(x, packed_weight, bias)
    return ACTIVATIONS[activation](y)


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float,
    causal: bool,
) -> torch.Tensor:
    # max_seqlen_* are sizing hints for blocked kernels; the reference reads the bounds directly.
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    gqa = q.shape[1] != k.shape[1]
    for q0, q1, k0, k1 in zip(bounds_q, bounds_q[1:], bounds_k, bounds_k[1:]):
        if q1 == q0:
            continue
        # [1, H, L, D]: ATen's fused CPU attention kernels need 4-D inputs (3-D falls back to math).
        qs, ks, vs = (t.transpose(0, 1).unsqueeze(0) for t in (q[q0:q1], k[k0:k1], v[k0:k1]))
        # softmax(s q.k) == softmax(|s| (-q).k): ATen's kernels mishandle a negative scale with a mask.
        seg_scale = abs(scale)
        if scale < 0:
            qs = -qs
        mask = None
        if causal:
            # Bottom-right aligned, as flash-attention defines causal for len_q != len_k.
            rows = torch.arange(q1 - q0).unsqueeze(1) + (k1 - k0) - (q1 - q0)
            mask = rows >= torch.arange(k1 - k0).unsqueeze(0)
        if k1 == k0 or (mask is not None and not mask.any(dim=1).all()) or _overflows(qs, ks, vs, seg_scale):
            # Rows that see no key: define their output as zeros (flash-attention's convention). NaN and
            # inf: as the math gives them (ATen's fused kernels write zeros for a NaN query row); a
            # scale that takes the scores past float32's range, too (ATen's give NaN: inf - inf).
            seg = _masked_attention(qs, ks, vs, mask, seg_scale, gqa)
        elif causal and q1 - q0 == k1 - k0 and scale != 0:  # (ATen's causal kernel gives NaN at scale 0)
            seg = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=seg_scale, enable_gqa=gqa)
        else:
            seg = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=seg_scale, enable_gqa=gqa)
        out[q0:q1] = seg[0].transpose(0, 1)
    return out


def _overflows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> bool:
    """Whether a segment's scaled scores may not be finite in float32: a NaN or inf input, or
    ``scale * |q| * |k| * D`` near float32's largest value (with room for the kernels' own factors)."""
    if not bool(torch.isfinite(v).all()):
        return True
    if q.numel() == 0 or k.numel() == 0:
        return False
    bound = scale * q.abs().amax().item() * k.abs().amax().item() * q.shape[-1]
    return not bound < torch.finfo(torch.float32).max / 16  # (NaN: not less)


def _masked_attention(q, k, v, mask, scale, gqa):
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = q.float() @ k.float().transpose(-1, -2)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    # Scaled after the row's largest score is taken off (softmax is the same): a scale that takes
    # the scores themselves past float32's range does not take their differences to inf - inf.
    if scores.shape[-1]:  # (no key: every row's output is zeros)
        scores = scores - scores.amax(dim=-1, keepdim=True).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    scores = scores * scale
    if mask is not None:  # (at scale 0, -inf * 0 is NaN)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if mask is not None:  # a row that sees no key: zeros, not the NaN of a softmax over -inf alone
        probs = probs.masked_fill(~mask.any(dim=-1, keepdim=True), 0.0)
    return (probs @ v.float()).to(q.dtype)


def patch_embed(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel_size: list[int],
    out_channels: int,
) -> torch.Tensor:
    b, c, t, h, w = x.shape
    kt, kh, kw = kernel_size
    nt, nh, nw = t // kt, h // kh, w // kw
    patches = (
        x.reshape(b, c, nt, kt, nh, kh, nw, kw)
        .permute(0, 2, 4, 6, 1, 3, 5, 7)
        .reshape(b * nt * nh * nw, c * kt * kh * kw)
    )
    y = linear(patches, packed_weight, bias, "none", out_channels)
    return y.reshape(b, nt, nh, nw, out_channels).permute(0, 4, 1, 2, 3)


def conv2d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    stride: list[int],
    padding: list[int],
    dilation: list[int],
    groups: int,
    activation: str = "none",
) -> torch.Tensor:
    b = None if bias is None else bias.to(x.dtype)
    if any(p > d * (k - 1) for p, d, k in zip(padding, dilation, weight.shape[2:], strict=True)):
        out = _conv2d_nchw(x, weight, b, stride, padding, dilation, groups)
    else:
        out = F.conv2d(x, weight, b, list(stride), list(padding), list(dilation), groups)
    # In place, as the native kernels apply it: an elementwise op may lay out a tensor with size-1
    # dims otherwise (the op's fake gives the convolution's layout).
    return out if activation == "none" else out.copy_(ACTIVATIONS[activation](out))


def _conv2d_nchw(x, weight, bias, stride, padding, dilation, groups) -> torch.Tensor:
    """A convolution where a window at an edge lies wholly in the padding: there oneDNN's fp32
    kernels for a channels-last x or weight (torch 2.13, AVX2) read out of bounds, and eager crashed
    the process. Computed on NCHW copies (its NCHW kernel does not), laid out as eager's would be
    (channels-last where x or the weight is), as the native kernels do (csrc/ops.cpp)."""
    cl = torch.channels_last
    nhwc = cl in (suggest_memory_format(x), suggest_memory_format(weight))
    out = F.conv2d(x.contiguous(), weight.contiguous(), bias, list(stride), list(padding), list(dilation), groups)
    laid = torch.empty(
        out.shape, dtype=out.dtype, device=out.device, memory_format=cl if nhwc else torch.contiguous_format
    )
    return laid.copy_(out)


def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype).contiguous()


def norm_modulate(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    scale: torch.Tensor,
    shift: torch.Tensor,
    eps: float,
    rms: bool,
) -> torch.Tensor:
    # Wan: (norm(x.float()) * (1 + scale) + shift).type_as(x), every step in fp32.
    if rms:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        y = y if weight is None else y * weight.float()
    else:
        w = None if weight is None else weight.float()
        b = None if bias is None else bias.float()
        y = F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)
    return (y * (1 + scale.float()) + shift.float()).to(x.dtype).contiguous()


def gated_residual(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    # Wan: (x.float() + y * gate).type_as(x), with gate in fp32.
    return (x.float() + y.float() * gate.float()).to(x.dtype).contiguous()


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    # Each pair (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos) in fp32; the pairs are (x[2i], x[2i+1])
    # when interleaved (Wan), else (x[i], x[i + D/2]) (rotate_half). A D-wide cos / sin (rotate_half's
    # own, not interleaved) gives the first half's factors, then the second half's.
    h = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :h], x[..., h:])
    c, s = cos.float(), sin.float()
    c2, s2 = c, s
    if c.shape[-1] == 2 * h and not interleaved:
        c, c2, s, s2 = c[..., :h], c[..., h:], s[..., :h], s[..., h:]
    a, b = x1.float() * c - x2.float() * s, x1.float() * s2 + x2.float() * c2
    if interleaved:
        return torch.stack((a, b), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat((a, b), dim=-1).to(x.dtype)
