"""The ``sgl_kernel`` provider: amxopt's ops on SGLang's CPU kernels, where a CPU build is installed.

sgl-kernel (``import sgl_kernel``; ops under ``torch.ops.sgl_kernel``) is built from source for
AVX-512 + AMX and is not on the package registries. Its GEMMs and attention run oneDNN's brgemm on
AMX tiles (as native's ``amx`` tier does), so it is usable only where the CPU has AMX: SGLang itself
checks ``torch._C._cpu._is_amx_tile_supported()`` and ``hasattr(torch.ops.sgl_kernel,
"convert_weight_packed")``, and so does :func:`available`. It is never picked by ``auto``: it is
there to compare against (``tools/bench_ops.py``) and for users who run SGLang's kernels already.

What maps onto it, and what it cannot take (those calls run amxopt's native kernel, or for a Linear
whose weight sgl-kernel cannot pack, ATen):

- ``pack_linear_weight``/``linear``: ``convert_weight_packed`` (bf16, N % 16 == 0, K % 32 == 0; the
  packed tensor keeps the shape ``[N, K]``) and ``weight_packed_linear`` with an fp32 bias. It has
  no fused activation: amxopt applies it to the fp32 output (``out_dtype``, where the installed
  version has it) and rounds once. Other weights stay plain ``[N, K]`` and run on ATen.
- ``varlen_attention``: ``flash_attn_varlen_func`` (q/k/v ``[T, H, D]``, int32 bounds, GQA). Older
  versions have no ``sm_scale`` argument and use 1/sqrt(D), and versions disagree on how causal
  aligns unequal query/key segments: other scales, causal cross-attention, empty segments and odd
  head dims run native.
- ``patch_embed``: the patches gathered as ``[M, C*kt*kh*kw]`` and one ``weight_packed_linear`` (its
  conv3d op rejects Wan's (1, 2, 2) kernel and needs a bias; the GEMM is the same).
- ``layer_norm``/``rms_norm``: ``layernorm_cpu``/``rmsnorm_cpu`` for bf16 x with a weight of x's
  dtype; others run native.
- ``conv2d`` and the glue ops have no sgl-kernel counterpart: they run native (csrc/ops.cpp); so does
  the rotary embedding ``varlen_attention`` may carry, applied to q and k before SGLang's attention.
"""

from __future__ import annotations

import functools
import math

import torch

from amxopt.ops import library, reference

PROVIDER = "sgl_kernel"
_NEEDED = ("convert_weight_packed", "weight_packed_linear", "flash_attn_varlen_func", "layernorm_cpu", "rmsnorm_cpu")


@functools.cache
def available() -> tuple[bool, str]:
    """(usable here?, why): the package imports, has its CPU ops, and the CPU has AMX tiles."""
    try:
        import sgl_kernel  # noqa: F401 - registers torch.ops.sgl_kernel
    except Exception as e:  # noqa: BLE001 - a broken build raises anything; all mean "not usable"
        return False, f"the sgl_kernel package is not importable ({type(e).__name__}: {e})"
    return _ops_usable()


def _ops_usable() -> tuple[bool, str]:
    missing = [name for name in _NEEDED if not hasattr(torch.ops.sgl_kernel, name)]
    if missing:
        return False, f"sgl_kernel has no CPU ops {missing} (a CUDA-only build?)"
    if not torch._C._cpu._is_amx_tile_supported():
        return False, "sgl_kernel's CPU GEMMs and attention need AMX tiles, which this CPU lacks"
    return True, "SGLang's CPU kernels (sgl_kernel)"


def _ops():
    usable, why = available()
    if not usable:
        raise RuntimeError(f"amxopt: provider {PROVIDER!r} is not usable here: {why}")
    return torch.ops.sgl_kernel


def _has_arg(op, name: str) -> bool:
    return any(a.name == name for a in op.default._schema.arguments)


def pack_linear_weight(weight):
    library._check_pack(weight)
    if not library.sgl_packs(weight.shape[0], weight.shape[1], weight.dtype):
        return reference.pack_linear_weight(weight)
    # [N, K, 1]: the plain matrix's size, another shape (library.packed_linear_shape)
    return _ops().convert_weight_packed(weight.detach().contiguous()).unsqueeze(-1)


def linear(x, packed_weight, bias, activation, out_features, *, residual=None):
    library._check_linear(x, packed_weight, bias, activation, out_features, PROVIDER, residual)
    k = x.shape[-1]
    if not library.sgl_packs(out_features, k, x.dtype):
        return reference.linear(x, packed_weight, bias, activation, out_features, residual)
    packed_weight = packed_weight.squeeze(-1)
    if x.numel() == 0:
        return x.new_empty((*x.shape[:-1], out_features))
    ops = _ops()
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    bias32 = None if bias is None else bias.float().contiguous()
    if activation != "none" and _has_arg(ops.weight_packed_linear, "out_dtype"):
        y = ops.weight_packed_linear(x2, packed_weight, bias32, True, out_dtype=torch.float32)
        y = reference.ACTIVATIONS[activation](y).to(x.dtype)  # one rounding, after the activation
    else:
        y = reference.ACTIVATIONS[activation](ops.weight_packed_linear(x2, packed_weight, bias32, True))
    y = y.view(*x.shape[:-1], out_features)
    # SGLang's GEMM has no residual input: added after it (a second rounding).
    return y if residual is None else (y.float() + residual.float()).to(x.dtype)


def patch_embed(x, packed_weight, bias, kernel_size, out_channels):
    library._check_patch(x, packed_weight, bias, kernel_size, out_channels, PROVIDER)
    b, c, t, h, w = x.shape
    kt, kh, kw = kernel_size
    nt, nh, nw = t // kt, h // kh, w // kw
    patches = x.reshape(b, c, nt, kt, nh, kh, nw, kw).permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(-1, c * kt * kh * kw)
    y = linear(patches, packed_weight, bias, "none", out_channels)
    # Channels-last, as native's: [B, T', H', W', O] seen as [B, O, T', H', W'].
    return y.view(b, nt, nh, nw, out_channels).permute(0, 4, 1, 2, 3)


def _native_rotary(x, cos, sin, interleaved):
    return torch.ops.amxopt.rotary_embedding(x, cos, sin, interleaved, "native")


def varlen_attention(
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
    # SGLang's attention takes no rotary embedding: amxopt's own op rotates q and k first.
    q, k = library.checked_attention_inputs(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
        (rotary_cos, rotary_sin, rotary_interleaved), _native_rotary,
    )  # fmt: skip
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale, causal)
    ops = _ops()
    attn = ops.flash_attn_varlen_func
    scaled = _has_arg(attn, "sm_scale")
    lengths_q = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    lengths_k = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
    takes = (
        q.dtype == torch.bfloat16
        and q.shape[2] % 2 == 0
        and q.shape[0] > 0
        and bool((lengths_k > 0).all())
        and (scale > 0 if scaled else math.isclose(scale, q.shape[2] ** -0.5, rel_tol=1e-6))
        and (not causal or torch.equal(cu_seqlens_q, cu_seqlens_k))
    )
    if not takes:
        return torch.ops.amxopt.varlen_attention(*args, provider="native")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    cu_q, cu_k = (c.to(torch.int32).contiguous() for c in (cu_seqlens_q, cu_seqlens_k))
    max_q = max_seqlen_q or int(lengths_q.max())
    max_k = max_seqlen_k or int(lengths_k.max())
    extra = {"sm_scale": float(scale)} if scaled else {}
    return attn(q, k, v, cu_q, cu_k, max_q, max_k, causal, **extra)


def _norm_takes(x, params) -> bool:
    return x.dtype == torch.bfloat16 and x.numel() > 0 and all(p is None or p.dtype == x.dtype for p in params)


def layer_norm(x, weight, bias, eps):
    library._check_norm("layer_norm", x, (("weight", weight), ("bias", bias)), eps)
    if weight is None or not _norm_takes(x, (weight, bias)):
        return torch.ops.amxopt.layer_norm(x, weight, bias, eps, provider="native")
    x2 = x.reshape(-1, x.shape[-1])
    y = _ops().layernorm_cpu(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight.contiguous(), bias, eps)
    return y.view(x.shape)


def rms_norm(x, weight, eps):
    library._check_norm("rms_norm", x, (("weight", weight),), eps)
    if weight is None or not _norm_takes(x, (weight,)):
        return torch.ops.amxopt.rms_norm(x, weight, eps, provider="native")
    x2 = x.reshape(-1, x.shape[-1])
    y = _ops().rmsnorm_cpu(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight.contiguous(), eps)
    return y.view(x.shape)


# The amxopt ops this provider maps (csrc/ops.cpp calls amxopt::sgl_<op> for exactly these).
OPS = {
    "pack_linear_weight": pack_linear_weight,
    "linear": linear,
    "patch_embed": patch_embed,
    "varlen_attention": varlen_attention,
    "layer_norm": layer_norm,
    "rms_norm": rms_norm,
}
