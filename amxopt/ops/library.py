"""The ``amxopt`` torch.library ops: schema, input checks, fake (meta) impl, provider dispatch.

Every op names its provider explicitly (the last argument), so a rewritten graph says which kernel
family runs each node and optimizing two models with different providers never interferes.
Checks shared by all providers live here, so a bad input gets the same clear error whichever
kernel would have run; providers only compute.
"""

from __future__ import annotations

import torch

from amxopt.ops import providers

ACTIVATIONS = ("none", "gelu", "gelu_tanh", "silu")
_FLOAT_DTYPES = (torch.float32, torch.bfloat16)


class AmxOpError(ValueError):
    """A bad input to an amxopt op: the message names the op and the offending shape or value."""


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise AmxOpError(f"amxopt.{op}: {msg}")


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    _check(t.dtype in _FLOAT_DTYPES, op, f"{name} must be float32 or bfloat16, got {t.dtype}")


# --- pack_linear_weight -------------------------------------------------------------------------


@torch.library.custom_op("amxopt::pack_linear_weight", mutates_args=())
def pack_linear_weight(weight: torch.Tensor, provider: str) -> torch.Tensor:
    """Convert a ``[N, K]`` Linear weight into ``provider``'s kernel layout (a new tensor)."""
    _check(weight.dim() == 2, "pack_linear_weight", f"weight must be [N, K], got {tuple(weight.shape)}")
    _check_float("pack_linear_weight", "weight", weight)
    return providers.get(provider).pack_linear_weight(weight)


@pack_linear_weight.register_fake
def _(weight, provider):
    return weight.new_empty(providers.get(provider).packed_linear_shape(weight.shape[0], weight.shape[1], weight.dtype))


# --- linear ------------------------------------------------------------------------------------


def _check_gemm(op, x_desc, in_features, dtype, packed_weight, bias, out_features, provider):
    """Checks shared by the ops that multiply by a packed weight (``x_desc`` names the operand)."""
    _check(
        dtype == packed_weight.dtype,
        op,
        f"{x_desc} is {dtype} but the packed weight is {packed_weight.dtype}; cast the input or re-pack",
    )
    expected = tuple(providers.get(provider).packed_linear_shape(out_features, in_features, dtype))
    _check(
        tuple(packed_weight.shape) == expected,
        op,
        f"{x_desc} has {in_features} input features; with out_features={out_features} the packed weight "
        f"should have shape {expected}, got {tuple(packed_weight.shape)}",
    )
    if bias is not None:
        _check(bias.shape == (out_features,), op, f"bias has shape {tuple(bias.shape)}, expected ({out_features},)")
        _check(
            bias.dtype in (dtype, torch.float32),
            op,
            f"bias is {bias.dtype}; it must be {dtype} or float32",
        )


@torch.library.custom_op("amxopt::linear", mutates_args=())
def linear(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str,
    out_features: int,
    provider: str,
) -> torch.Tensor:
    """``act(x @ w.T + b)`` for any leading dims of ``x``, with ``w`` from ``pack_linear_weight``."""
    op = "linear"
    _check(activation in ACTIVATIONS, op, f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    _check_float(op, "x", x)
    _check(x.dim() >= 1, op, f"x has shape {tuple(x.shape)}; it needs at least one dim")
    _check_gemm(op, f"x {tuple(x.shape)}", x.shape[-1], x.dtype, packed_weight, bias, out_features, provider)
    return providers.get(provider).linear(x, packed_weight, bias, activation, out_features)


@linear.register_fake
def _(x, packed_weight, bias, activation, out_features, provider):
    return x.new_empty((*x.shape[:-1], out_features))


# --- varlen_attention --------------------------------------------------------------------------


@torch.library.custom_op("amxopt::varlen_attention", mutates_args=())
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
    provider: str,
) -> torch.Tensor:
    """Attention within each segment of packed ``q [T, H, D]``, ``k/v [Tk, Hk, D]``.

    Segment ``i`` is rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` of q and the matching rows of k/v.
    ``max_seqlen_*`` are upper bounds on the segment lengths, or 0 when unknown (kernels then read
    them from ``cu_seqlens``). ``causal`` is bottom-right aligned; GQA when ``H % Hk == 0``.
    """
    op = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.dim() == 3, op, f"{name} must be packed [T, H, D], got {tuple(t.shape)}")
        _check_float(op, name, t)
    _check(q.dtype == k.dtype == v.dtype, op, f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check(k.shape == v.shape, op, f"k {tuple(k.shape)} and v {tuple(v.shape)} must match")
    _check(q.shape[2] == k.shape[2], op, f"head dims differ: q {q.shape[2]}, k {k.shape[2]}")
    _check(
        k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0,
        op,
        f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads",
    )
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        _check(
            cu.dim() == 1 and cu.numel() >= 2 and not cu.is_floating_point(),
            op,
            f"{name} must be a 1-D integer tensor of segment bounds, got {cu.dtype} {tuple(cu.shape)}",
        )
        _check(int(cu[0]) == 0, op, f"{name} must start at 0, got {int(cu[0])}")
        _check(int(cu[-1]) == total, op, f"{name} ends at {int(cu[-1])} but there are {total} tokens")
        _check(bool((cu[1:] >= cu[:-1]).all()), op, f"{name} must be non-decreasing, got {cu.tolist()}")
    _check(
        cu_seqlens_q.numel() == cu_seqlens_k.numel(),
        op,
        f"{cu_seqlens_q.numel() - 1} query segments but {cu_seqlens_k.numel() - 1} key segments",
    )
    for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cu_seqlens_q), ("max_seqlen_k", max_seqlen_k, cu_seqlens_k)):
        longest = int((cu[1:] - cu[:-1]).max())
        _check(
            bound == 0 or bound >= longest,
            op,
            f"{name}={bound} but the longest segment has {longest} tokens (pass 0 when unknown)",
        )
    return providers.get(provider).varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal
    )


@varlen_attention.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal, provider):
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


# --- patch_embed -------------------------------------------------------------------------------


@torch.library.custom_op("amxopt::patch_embed", mutates_args=())
def patch_embed(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    bias: torch.Tensor | None,
    kernel_size: list[int],
    out_channels: int,
    provider: str,
) -> torch.Tensor:
    """Conv3d with kernel == stride, no padding: ``[B, C, T, H, W] -> [B, O, T/kt, H/kh, W/kw]``.

    Computed as one GEMM of the patches against the packed ``[O, C*kt*kh*kw]`` weight; the result
    is in channels-last memory order (a permuted view of ``[B, T/kt, H/kh, W/kw, O]``).
    """
    op = "patch_embed"
    _check(x.dim() == 5, op, f"x must be [B, C, T, H, W], got {tuple(x.shape)}")
    _check(len(kernel_size) == 3, op, f"kernel_size must have 3 entries, got {kernel_size}")
    _check(all(k > 0 for k in kernel_size), op, f"kernel_size must be positive, got {kernel_size}")
    _check_float(op, "x", x)
    for dim, k in zip(x.shape[2:], kernel_size):
        _check(dim % k == 0, op, f"x {tuple(x.shape)} is not divisible by kernel {tuple(kernel_size)}")
    k_total = x.shape[1] * kernel_size[0] * kernel_size[1] * kernel_size[2]
    desc = f"x {tuple(x.shape)} (patches of {x.shape[1]}x{'x'.join(map(str, kernel_size))} = {k_total})"
    _check_gemm(op, desc, k_total, x.dtype, packed_weight, bias, out_channels, provider)
    return providers.get(provider).patch_embed(x, packed_weight, bias, kernel_size, out_channels)


@patch_embed.register_fake
def _(x, packed_weight, bias, kernel_size, out_channels, provider):
    b, _, t, h, w = x.shape
    kt, kh, kw = kernel_size
    # Channels-last: the GEMM writes [B, T', H', W', O]; Wan's flatten(2).transpose(1, 2) is then free.
    return x.new_empty((b, t // kt, h // kh, w // kw, out_channels)).permute(0, 4, 1, 2, 3)


# --- norms -------------------------------------------------------------------------------------


def _check_norm(op, x, params):
    _check(x.dim() >= 1, op, f"x has shape {tuple(x.shape)}; it needs at least one dim")
    _check_float(op, "x", x)
    for name, p in params:
        if p is not None:
            _check(
                p.shape == (x.shape[-1],),
                op,
                f"{name} has shape {tuple(p.shape)}, expected ({x.shape[-1]},) for x {tuple(x.shape)}",
            )
            _check_float(op, name, p)


@torch.library.custom_op("amxopt::layer_norm", mutates_args=())
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float, provider: str
) -> torch.Tensor:
    """LayerNorm over the last dim, fp32 accumulation, output in ``x.dtype`` (params may be fp32)."""
    _check_norm("layer_norm", x, (("weight", weight), ("bias", bias)))
    return providers.get(provider).layer_norm(x, weight, bias, eps)


@layer_norm.register_fake
def _(x, weight, bias, eps, provider):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("amxopt::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, provider: str) -> torch.Tensor:
    """RMSNorm over the last dim, fp32 accumulation, output in ``x.dtype`` (weight may be fp32)."""
    _check_norm("rms_norm", x, (("weight", weight),))
    return providers.get(provider).rms_norm(x, weight, eps)


@rms_norm.register_fake
def _(x, weight, eps, provider):
    return torch.empty_like(x, memory_format=torch.contiguous_format)
