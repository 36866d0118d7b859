"""The ``amxopt`` ops: schemas, fake (meta) impls, and the reference ops they fall back to.

The schemas live here; the CPU kernels are registered in C++ (``csrc/ops.cpp``), so a graph's call
goes through the dispatcher with no Python in between. Every op ends with ``provider='auto'``:
``auto``/``native`` run amxopt's kernels on the best tier this CPU has, ``reference`` runs the plain
ATen definition in ``amxopt.ops.reference`` (the C++ kernel forwards to ``amxopt::reference_<op>``,
defined below), ``sgl_kernel`` SGLang's CPU kernels where installed (``amxopt.ops.sgl``). Where the
C++ library cannot be built or loaded, Python registers the CPU kernels instead and every provider
runs the reference.

Shape checks are written once here and run by the fakes (so tracing a bad call fails with the same
message) and by the reference ops; the C++ kernels repeat them in C++ (they must stand on their own).
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

from amxopt.ops import native, reference

# The vocabulary every layer reads (patterns, passes, report, CLI): the dtypes amxopt's kernels take,
# and the activations a GEMM's epilogue fuses (defined by the reference implementations).
DTYPES = (torch.float32, torch.bfloat16)
ACTIVATIONS = tuple(reference.ACTIVATIONS)
# The largest |scale| of an attention: the kernels' softmax multiplies it by log2(e) in float32 (csrc/ops.cpp kMaxScale).
MAX_SCALE = torch.finfo(torch.float32).max / 2
_NB = 32  # packed weight: output columns per VNNI block (csrc/common.h kNB)

_lib = torch.library.Library("amxopt", "DEF")

_SCHEMAS = {
    "pack_linear_weight": "(Tensor weight{provider}) -> Tensor",
    # + residual: act(x W^T + bias) + residual (the output's shape and x's dtype), rounded once.
    # amx_schedule: the order of the amx tier's tile GEMM for this call (AMX_SCHEDULES), which
    # autotune picks per shape; "default" leaves it to the process (native.amx_schedule). Other
    # tiers and providers take no notice of it; a pinned process schedule overrides it.
    "linear": (
        "(Tensor x, Tensor packed_weight, Tensor? bias, str activation, SymInt out_features{provider}, *, "
        "Tensor? residual=None{schedule}) -> Tensor"
    ),
    # + rotary: q and k rotated first, as rotary_embedding(q / k, cos[:, None], sin[:, None],
    # interleaved) would (a self-attention; cos / sin [T, D / 2], or [T, D] for rotate_half's factors).
    "varlen_attention": (
        "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
        "SymInt max_seqlen_k, float scale, bool causal{provider}, *, Tensor? rotary_cos=None, "
        "Tensor? rotary_sin=None, bool rotary_interleaved=False) -> Tensor"
    ),
    "patch_embed": (
        "(Tensor x, Tensor packed_weight, Tensor? bias, SymInt[] kernel_size, SymInt out_channels{provider}) -> Tensor"
    ),
    "conv2d": (
        "(Tensor x, Tensor weight, Tensor? bias, SymInt[] stride, SymInt[] padding, SymInt[] dilation, "
        "SymInt groups, str activation='none'{provider}) -> Tensor"
    ),
    "layer_norm": "(Tensor x, Tensor? weight, Tensor? bias, float eps{provider}) -> Tensor",
    "rms_norm": "(Tensor x, Tensor? weight, float eps{provider}) -> Tensor",
    # Wan's glue: norm(x) * (1 + scale) + shift; x + y * gate; rotary embedding of pairs.
    "norm_modulate": (
        "(Tensor x, Tensor? weight, Tensor? bias, Tensor scale, Tensor shift, float eps, bool rms{provider}) -> Tensor"
    ),
    "gated_residual": "(Tensor x, Tensor y, Tensor gate{provider}) -> Tensor",
    "rotary_embedding": "(Tensor x, Tensor cos, Tensor sin, bool interleaved{provider}) -> Tensor",
}
# Sizes are SymInt so that a traced replacement keeps them symbolic under dynamic shapes.
OPS = tuple(_SCHEMAS)
AMX_SCHEDULES = ("default", *native.AMX_SCHEDULES)  # linear's amx_schedule
for _name, _schema in _SCHEMAS.items():
    _lib.define(_name + _schema.format(provider=", str provider='auto'", schedule=", str amx_schedule='default'"))
    _lib.define(f"reference_{_name}" + _schema.format(provider="", schedule=""))


class AmxOpError(ValueError):
    """A bad input to an amxopt op: the message names the op and the offending shape or value.

    The C++ kernels raise plain ``ValueError`` with the same messages; catch ``ValueError``.
    """


def _check(cond: bool, op: str, msg: str) -> None:
    if not cond:
        raise AmxOpError(f"amxopt.{op}: {msg}")


def _check_float(op: str, name: str, t: torch.Tensor) -> None:
    _check(t.dtype in DTYPES, op, f"{name} must be float32 or bfloat16, got {t.dtype}")


def resolve_provider(provider: str, op: str = "") -> str:
    """``auto`` -> ``native`` where amxopt's C++ kernels are loaded, else ``reference``.

    ``op`` names the op in the error, as the C++ kernels' check does.
    """
    if provider == "auto":
        return "native" if native.available()[0] else "reference"
    if provider not in ("native", "reference", "sgl_kernel"):
        where = f"amxopt.{op}" if op else "amxopt"
        raise AmxOpError(f"{where}: unknown provider {provider!r}; known: auto, native, reference, sgl_kernel")
    return provider


def packed_linear_shape(n: int, k: int, dtype: torch.dtype, provider: str = "auto") -> tuple[int, ...]:
    """Shape of ``pack_linear_weight`` of an ``[n, k]`` weight.

    Native bf16 with even K: the VNNI blocks followed by zeros, shaped
    ``[n, k/2 + ceil(r (k + 1) / 2n), 2]`` (``r`` padding columns, csrc/common.h), a shape that
    names N and K exactly, so a weight packed for other in/out features is refused. sgl_kernel's
    ``convert_weight_packed`` layout (:func:`sgl_packs`): ``[n, k, 1]``, told apart from the plain
    matrix it has as many values as. Otherwise the plain ``[n, k]`` matrix.
    """
    provider = resolve_provider(provider)
    if provider == "sgl_kernel" and sgl_packs(n, k, dtype):
        return (n, k, 1)
    # Where the C++ library did not load, every provider runs the reference, and packs like it.
    native_layout = provider == "native" and native.available()[0]
    if native_layout and dtype == torch.bfloat16 and k % 2 == 0 and k > 0 and n > 0:
        padding = -(-n // _NB) * _NB - n
        return (n, k // 2 - (-padding * (k + 1) // (2 * n)), 2)
    return (n, k)


def sgl_packs(n: int, k: int, dtype: torch.dtype) -> bool:
    """Whether sgl_kernel's ``convert_weight_packed`` takes an ``[n, k]`` weight (else it stays plain)."""
    return dtype == torch.bfloat16 and n % 16 == 0 and n > 0 and k % 32 == 0 and k > 0


# --- checks (shapes and dtypes only, so the fakes can run them) ----------------------------------


def _check_pack(weight):
    _check(weight.dim() == 2, "pack_linear_weight", f"weight must be [N, K], got {tuple(weight.shape)}")
    _check_float("pack_linear_weight", "weight", weight)


def _check_gemm(op, x_desc, in_features, dtype, packed_weight, bias, out_features, provider):
    """Checks shared by the ops that multiply by a packed weight (``x_desc`` names the operand)."""
    _check(0 < out_features < 2**31, op, f"out_features must be in [1, 2**31), got {out_features}")
    _check(
        dtype == packed_weight.dtype,
        op,
        f"{x_desc} is {dtype} but the packed weight is {packed_weight.dtype}; cast the input or re-pack",
    )
    expected = packed_linear_shape(out_features, in_features, dtype, provider)
    _check(
        tuple(packed_weight.shape) == expected,
        op,
        f"{x_desc} has {in_features} input features; with out_features={out_features} the packed weight "
        f"should have shape {expected}, got {tuple(packed_weight.shape)}",
    )
    if bias is not None:
        _check(bias.shape == (out_features,), op, f"bias has shape {tuple(bias.shape)}, expected ({out_features},)")
        allowed = " or ".join(sorted({str(dtype), str(torch.float32)}))
        _check(bias.dtype in (dtype, torch.float32), op, f"bias is {bias.dtype}; it must be {allowed}")


def _check_activation(op, activation):
    _check(activation in ACTIVATIONS, op, f"activation must be one of {', '.join(ACTIVATIONS)}, got {activation!r}")


def _check_schedule(op, amx_schedule):
    _check(
        amx_schedule in AMX_SCHEDULES,
        op,
        f"amx_schedule must be one of {', '.join(AMX_SCHEDULES)}, got {amx_schedule!r}",
    )


def _check_linear(x, packed_weight, bias, activation, out_features, provider, residual=None, amx_schedule="default"):
    op = "linear"
    _check_schedule(op, amx_schedule)
    _check_activation(op, activation)
    _check_float(op, "x", x)
    _check(
        x.dim() >= 1 and x.shape[-1] != 0,
        op,
        f"x has shape {tuple(x.shape)}; it needs at least one dim, and in_features > 0",
    )
    _check_gemm(op, f"x {tuple(x.shape)}", x.shape[-1], x.dtype, packed_weight, bias, out_features, provider)
    if residual is not None:
        out = (*x.shape[:-1], out_features)
        _check(
            tuple(residual.shape) == out, op, f"residual has shape {tuple(residual.shape)}, expected the output's {out}"
        )
        _check(residual.dtype == x.dtype, op, f"residual is {residual.dtype} but x is {x.dtype}")


def _check_attention_shapes(q, k, v, scale):
    op = "varlen_attention"
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check(t.dim() == 3, op, f"{name} must be packed [T, H, D], got {tuple(t.shape)}")
        _check_float(op, name, t)
    _check(q.dtype == k.dtype == v.dtype, op, f"q/k/v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    _check(k.shape == v.shape, op, f"k {tuple(k.shape)} and v {tuple(v.shape)} must match")
    _check(q.shape[2] == k.shape[2], op, f"head dims differ: q {q.shape[2]}, k {k.shape[2]}")
    _check(k.shape[1] > 0, op, f"k and v have no heads: {tuple(k.shape)}")
    _check(
        q.shape[1] % k.shape[1] == 0,
        op,
        f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} key/value heads",
    )
    _check(abs(scale) <= MAX_SCALE, op, f"scale must be finite, at most {MAX_SCALE:.6g} in magnitude, got {scale}")


def _check_attention_rotary(q, k, cos, sin, interleaved):
    op = "varlen_attention"
    _check(
        (cos is None) == (sin is None),
        op,
        f"rotary_cos and rotary_sin come together; got only {'rotary_sin' if cos is None else 'rotary_cos'}",
    )
    if cos is None:
        return
    t, d = q.shape[0], q.shape[2]
    _check(
        k.shape[0] == t,
        op,
        f"a rotary embedding needs q and k of the same tokens (self-attention); q has {t} and k {k.shape[0]}",
    )
    _check(d % 2 == 0, op, f"a rotary embedding needs an even head dim, got {d}")
    _check_float(op, "rotary_cos", cos)
    _check_float(op, "rotary_sin", sin)
    widths = (d // 2,) if interleaved else (d // 2, d)
    wide = "" if interleaved else f" or [{t}, {d}] (rotate_half's factors per half)"
    _check(
        cos.dim() == 2 and cos.shape[0] == t and cos.shape[1] in widths,
        op,
        f"rotary_cos must be [tokens, head_dim / 2], i.e. [{t}, {d // 2}]{wide}, got {tuple(cos.shape)}",
    )
    _check(
        sin.shape == cos.shape,
        op,
        f"rotary_cos {tuple(cos.shape)} and rotary_sin {tuple(sin.shape)} must have the same shape",
    )


def checked_attention_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, rotary, rotate):
    """The checks of a Python attention provider; its q and k, rotated by ``rotate(x, cos, sin,
    interleaved)`` where the call carries a rotary embedding (``rotary``: cos, sin, interleaved)."""
    cos, sin, interleaved = rotary
    _check_attention_shapes(q, k, v, scale)
    _check_segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _check_attention_rotary(q, k, cos, sin, interleaved)
    if cos is None:
        return q, k
    return tuple(rotate(t, cos[:, None], sin[:, None], interleaved) for t in (q, k))


def _check_segments(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
    """The data-dependent half of the attention checks (segment bounds): not for fakes."""
    op = "varlen_attention"
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        integer = not (cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool)
        _check(
            cu.dim() == 1 and cu.numel() >= 2 and integer,
            op,
            f"{name} must be a 1-D integer tensor of at least 2 segment bounds (0, ..., the token count), "
            f"got {cu.dtype} {tuple(cu.shape)}",
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


def _check_patch(x, packed_weight, bias, kernel_size, out_channels, provider):
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


def _check_conv2d(x, weight, bias, stride, padding, dilation, groups, activation):
    op = "conv2d"
    _check_activation(op, activation)
    _check(x.dim() == 4, op, f"x must be [B, C, H, W], got {tuple(x.shape)}")
    _check_float(op, "x", x)
    _check(
        weight.dim() == 4 and weight.dtype == x.dtype,
        op,
        f"weight must be a 4-D {x.dtype} tensor, got {weight.dtype} {tuple(weight.shape)}",
    )
    _check(
        groups > 0 and weight.shape[1] * groups == x.shape[1],
        op,
        f"weight {tuple(weight.shape)} with groups={groups} does not take the {x.shape[1]} channels of x "
        f"{tuple(x.shape)}",
    )
    _check(
        weight.shape[0] % groups == 0,
        op,
        f"weight {tuple(weight.shape)} has {weight.shape[0]} output channels, not a multiple of groups={groups}",
    )
    _check(
        len(stride) == len(padding) == len(dilation) == 2,
        op,
        f"stride, padding and dilation need 2 entries each, got {list(stride)}, {list(padding)}, {list(dilation)}",
    )
    _check(weight.shape[0] != 0, op, f"weight {tuple(weight.shape)} has no output channels")
    _check(weight.shape[2] != 0 and weight.shape[3] != 0, op, f"weight {tuple(weight.shape)} has an empty kernel")
    if all(isinstance(n, int) for n in x.shape):  # as eager's convolution: empty images only in an empty batch
        _check(
            x.shape[0] == 0 or x.shape[1] == 0 or (x.shape[2] > 0 and x.shape[3] > 0),
            op,
            f"x {tuple(x.shape)} has an empty spatial dim (only an empty batch or no channels may be empty)",
        )
    for d in range(2):
        _check(
            stride[d] > 0 and padding[d] >= 0 and dilation[d] > 0,
            op,
            "stride and dilation must be positive and padding not negative, got stride "
            f"{list(stride)}, padding {list(padding)}, dilation {list(dilation)}",
        )
        window, room = dilation[d] * (weight.shape[2 + d] - 1) + 1, x.shape[2 + d] + 2 * padding[d]
        if isinstance(room, int):  # a symbolic size is checked when the op runs (no guard is added)
            _check(
                window <= room,
                op,
                f"the kernel's window ({window} with dilation {dilation[d]}) is larger than x's padded size "
                f"{room} in dim {2 + d} of x {tuple(x.shape)}",
            )
    if bias is not None:
        _check(
            bias.shape == (weight.shape[0],) and bias.dtype in (x.dtype, torch.float32),
            op,
            f"bias must be ({weight.shape[0]},) in {x.dtype} or float32, got {bias.dtype} {tuple(bias.shape)}",
        )


def _check_norm(op, x, params, eps):
    _check(x.dim() >= 1, op, f"x has shape {tuple(x.shape)}; it needs at least one dim")
    _check(math.isfinite(eps) and eps >= 0, op, f"eps must be finite and not negative, got {eps:g}")
    _check_float(op, "x", x)
    for name, p in params:
        if p is not None:
            _check(
                p.shape == (x.shape[-1],),
                op,
                f"{name} has shape {tuple(p.shape)}, expected ({x.shape[-1]},) for x {tuple(x.shape)}",
            )
            _check_float(op, name, p)


def _check_broadcast(op, name, p, x, width):
    """``p`` broadcasts to ``x.shape[:-1] + (width,)``, with ``width`` as its own last dim."""
    _check_float(op, name, p)
    want = (*x.shape[:-1], width)
    ok = 1 <= p.dim() <= x.dim() and p.shape[-1] == width
    ok = ok and all(a in (1, b) for a, b in zip(reversed(p.shape[:-1]), reversed(x.shape[:-1])))
    _check(ok, op, f"{name} has shape {tuple(p.shape)}, which does not broadcast to {want} for x {tuple(x.shape)}")


def _check_norm_modulate(x, weight, bias, scale, shift, eps, rms):
    op = "norm_modulate"
    _check_norm(op, x, (("weight", weight), ("bias", bias)), eps)
    _check(not (rms and bias is not None), op, "an RMSNorm has no bias")
    _check_broadcast(op, "scale", scale, x, x.shape[-1])
    _check_broadcast(op, "shift", shift, x, x.shape[-1])


def _check_gated_residual(x, y, gate):
    op = "gated_residual"
    _check(x.dim() >= 1, op, f"x has shape {tuple(x.shape)}; it needs at least one dim")
    _check_float(op, "x", x)
    _check(
        y.shape == x.shape and y.dtype == x.dtype,
        op,
        f"y must match x {x.dtype} {tuple(x.shape)}, got {y.dtype} {tuple(y.shape)}",
    )
    _check_broadcast(op, "gate", gate, x, x.shape[-1])


def _check_rotary(x, cos, sin, interleaved):
    op = "rotary_embedding"
    _check(
        x.dim() >= 1 and x.shape[-1] % 2 == 0,
        op,
        f"x {tuple(x.shape)} must end in an even dim (pairs of values to rotate)",
    )
    _check_float(op, "x", x)
    _check(cos.shape == sin.shape, op, f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    # One cos / sin per pair (D / 2), or rotate_half's factors for each half (D, not interleaved).
    d = x.shape[-1]
    width = d if not interleaved and cos.dim() >= 1 and cos.shape[-1] == d else d // 2
    _check_broadcast(op, "cos", cos, x, width)
    _check_broadcast(op, "sin", sin, x, width)


# --- fakes: checks, then shapes only ---------------------------------------------------------------


def _fake(op: str):
    """Register ``fn`` as ``op``'s fake. It is also the op's Meta kernel, which the dispatcher picks when
    any one argument is on the meta device: tensors on two devices (a buffer left on meta beside CPU
    inputs) are refused there, as eager's ops refuse them, rather than given an empty CPU output."""

    def register(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            devices: dict[torch.device, list[str]] = {}
            for name, value in signature.bind(*args, **kwargs).arguments.items():
                if isinstance(value, torch.Tensor):
                    devices.setdefault(value.device, []).append(name)
            where = "; ".join(f"{', '.join(names)} on {device}" for device, names in devices.items())
            _check(len(devices) <= 1, op, f"its tensors must be on one device, got {where}")
            return fn(*args, **kwargs)

        return torch.library.register_fake(f"amxopt::{op}", lib=_lib)(checked)

    return register


@_fake("pack_linear_weight")
def _(weight, provider="auto"):
    _check_pack(weight)
    return weight.new_empty(packed_linear_shape(weight.shape[0], weight.shape[1], weight.dtype, provider))


@_fake("linear")
def _(x, packed_weight, bias, activation, out_features, provider="auto", *, residual=None, amx_schedule="default"):
    _check_linear(x, packed_weight, bias, activation, out_features, provider, residual, amx_schedule)
    return x.new_empty((*x.shape[:-1], out_features))


@_fake("varlen_attention")
def _(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    provider="auto",
    *,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
):
    _check_attention_shapes(q, k, v, scale)
    _check_attention_rotary(q, k, rotary_cos, rotary_sin, rotary_interleaved)
    return q.new_empty((q.shape[0], q.shape[1], v.shape[2]))


@_fake("patch_embed")
def _(x, packed_weight, bias, kernel_size, out_channels, provider="auto"):
    _check_patch(x, packed_weight, bias, kernel_size, out_channels, provider)
    b, _, t, h, w = x.shape
    kt, kh, kw = kernel_size
    # Channels-last: the GEMM writes [B, T', H', W', O]; Wan's flatten(2).transpose(1, 2) is then free.
    return x.new_empty((b, t // kt, h // kh, w // kw, out_channels)).permute(0, 4, 1, 2, 3)


DIRECT_CONV_K = 64  # conv.cpp's kDirectK: Cin x kh x kw up to which the native conv2d runs directly


def _channels_last_conv2d(x, weight, groups, provider) -> bool:
    """Whether the native conv2d takes one of conv.cpp's kernels, whose output is channels-last: the
    direct one (Cin x kh x kw <= DIRECT_CONV_K), or im2col + GEMM (bf16, even Cin x kh x kw, on the
    amx tier). sgl_kernel has no conv2d: its provider runs the native one."""
    k = weight.shape[1] * weight.shape[2] * weight.shape[3]
    native_kernels = resolve_provider(provider) in ("native", "sgl_kernel") and native.available()[0]  # else reference
    if not native_kernels or groups != 1 or k == 0 or x.shape[0] == 0:
        return False
    gemm = x.dtype == torch.bfloat16 and k % 2 == 0 and native.active_tier() == "amx"
    return k <= DIRECT_CONV_K or gemm


@_fake("conv2d")
def _(x, weight, bias, stride, padding, dilation, groups, activation="none", provider="auto"):
    _check_conv2d(x, weight, bias, stride, padding, dilation, groups, activation)
    out = reference.conv2d(x, weight, bias, stride, padding, dilation, groups)
    if _channels_last_conv2d(x, weight, groups, provider):
        # (a new tensor: .contiguous() keeps the strides of one whose size-1 dims make it channels-last)
        return torch.empty(out.shape, dtype=out.dtype, device=out.device, memory_format=torch.channels_last)
    return out


@_fake("layer_norm")
def _(x, weight, bias, eps, provider="auto"):
    _check_norm("layer_norm", x, (("weight", weight), ("bias", bias)), eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_fake("rms_norm")
def _(x, weight, eps, provider="auto"):
    _check_norm("rms_norm", x, (("weight", weight),), eps)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_fake("norm_modulate")
def _(x, weight, bias, scale, shift, eps, rms, provider="auto"):
    _check_norm_modulate(x, weight, bias, scale, shift, eps, rms)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_fake("gated_residual")
def _(x, y, gate, provider="auto"):
    _check_gated_residual(x, y, gate)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@_fake("rotary_embedding")
def _(x, cos, sin, interleaved, provider="auto"):
    _check_rotary(x, cos, sin, interleaved)
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# --- reference ops: checks, then amxopt.ops.reference ------------------------------------------------


def _ref_pack_linear_weight(weight):
    _check_pack(weight)
    return reference.pack_linear_weight(weight)


def _ref_linear(x, packed_weight, bias, activation, out_features, *, residual=None):
    _check_linear(x, packed_weight, bias, activation, out_features, "reference", residual)
    return reference.linear(x, packed_weight, bias, activation, out_features, residual)


def _ref_varlen_attention(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    scale,
    causal,
    *,
    rotary_cos=None,
    rotary_sin=None,
    rotary_interleaved=False,
):
    q, k = checked_attention_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        (rotary_cos, rotary_sin, rotary_interleaved), reference.rotary_embedding,
    )  # fmt: skip
    return reference.varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)


def _ref_patch_embed(x, packed_weight, bias, kernel_size, out_channels):
    _check_patch(x, packed_weight, bias, kernel_size, out_channels, "reference")
    return reference.patch_embed(x, packed_weight, bias, kernel_size, out_channels)


def _ref_conv2d(x, weight, bias, stride, padding, dilation, groups, activation="none"):
    _check_conv2d(x, weight, bias, stride, padding, dilation, groups, activation)
    return reference.conv2d(x, weight, bias, stride, padding, dilation, groups, activation)


def _ref_layer_norm(x, weight, bias, eps):
    _check_norm("layer_norm", x, (("weight", weight), ("bias", bias)), eps)
    return reference.layer_norm(x, weight, bias, eps)


def _ref_rms_norm(x, weight, eps):
    _check_norm("rms_norm", x, (("weight", weight),), eps)
    return reference.rms_norm(x, weight, eps)


def _ref_norm_modulate(x, weight, bias, scale, shift, eps, rms):
    _check_norm_modulate(x, weight, bias, scale, shift, eps, rms)
    return reference.norm_modulate(x, weight, bias, scale, shift, eps, rms)


def _ref_gated_residual(x, y, gate):
    _check_gated_residual(x, y, gate)
    return reference.gated_residual(x, y, gate)


def _ref_rotary_embedding(x, cos, sin, interleaved):
    _check_rotary(x, cos, sin, interleaved)
    return reference.rotary_embedding(x, cos, sin, interleaved)


_REFERENCE = {
    "pack_linear_weight": _ref_pack_linear_weight,
    "linear": _ref_linear,
    "varlen_attention": _ref_varlen_attention,
    "patch_embed": _ref_patch_embed,
    "conv2d": _ref_conv2d,
    "layer_norm": _ref_layer_norm,
    "rms_norm": _ref_rms_norm,
    "norm_modulate": _ref_norm_modulate,
    "gated_residual": _ref_gated_residual,
    "rotary_embedding": _ref_rotary_embedding,
}
for _name, _fn in _REFERENCE.items():
    _lib.impl(f"reference_{_name}", _fn, "CPU")


def _python_kernel(fn):
    arity = fn.__code__.co_argcount  # the op's arguments before ``provider``
    op = fn.__name__.removeprefix("_ref_")

    def run(*args, **kwargs):
        provider = args[arity] if len(args) > arity else kwargs.pop("provider", "auto")
        resolve_provider(provider, op)  # an unknown provider is an error even here
        if "amx_schedule" in kwargs:  # linear's: the reference has no tile GEMM to order
            _check_schedule(op, kwargs.pop("amx_schedule"))
        return fn(*args[:arity], **kwargs)

    return run


# The sgl_kernel provider's ops (amxopt/ops/sgl.py; they read the checks above): the C++ kernels
# call amxopt::sgl_<op> for provider="sgl_kernel".
from amxopt.ops import sgl  # noqa: E402

for _name, _fn in sgl.OPS.items():
    _lib.define(f"sgl_{_name}" + _SCHEMAS[_name].format(provider="", schedule=""))
    _lib.impl(f"sgl_{_name}", _fn, "CPU")


class _NoBackward(torch.autograd.Function):
    """The output of op ``name`` (computed below autograd) tied to the inputs that require grad by
    a node whose backward raises."""

    @staticmethod
    def forward(ctx, name, out, *inputs):
        ctx.op = name
        return out.clone()

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"amxopt.{ctx.op}: has no backward (amxopt computes inference only)")


def _no_backward(name: str):
    """The Autograd kernel of op ``name`` where the C++ library (which registers torch's "not
    implemented" one) cannot load."""
    op = getattr(torch.ops.amxopt, name).default

    def run(*args, **kwargs):
        with torch._C._AutoDispatchBelowAutograd():
            out = op(*args, **kwargs)
        wants = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if torch.is_grad_enabled() and any(t.requires_grad for t in wants):
            return _NoBackward.apply(name, out, *(t for t in wants if t.requires_grad))
        return out

    return run


# The C++ kernels, or (where they cannot be loaded) the reference behind every provider.
if not native.load()[0]:
    for _name, _fn in _REFERENCE.items():
        _lib.impl(_name, _python_kernel(_fn), "CPU")
        _lib.impl(_name, _no_backward(_name), "Autograd")
