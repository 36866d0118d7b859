"""Rewrite rules as data, and the replacement functions they point to.

A replacement function takes the matched tensors as arguments (everything else is bound with
``functools.partial``) and is traced by ``amxopt.passes._graph.insert_traced`` on the matched
node's fake values, so its output shapes stay symbolic where the capture was dynamic.
Nothing here touches a graph.
"""

from __future__ import annotations

import dataclasses

import torch

aten = torch.ops.aten
amx = torch.ops.amxopt


@dataclasses.dataclass(frozen=True)
class ActivationRule:
    """An elementwise op that ``amxopt.linear`` can fuse into its epilogue."""

    target: object
    activation: str
    approximate: str | None = None  # gelu's ``approximate`` kwarg that this rule matches


ACTIVATION_RULES = (
    ActivationRule(aten.gelu.default, "gelu", "none"),
    ActivationRule(aten.gelu.default, "gelu_tanh", "tanh"),
    ActivationRule(aten.silu.default, "silu"),
)

# Kinds of node amxopt replaces, and the aten ops of each kind a captured graph may hold.
KIND_TARGETS = {
    "linear": (aten.linear.default,),
    "attention": (aten.scaled_dot_product_attention.default,),
    "patch_embed": (aten.conv3d.default, aten.conv3d.padding),
    "conv2d": (aten.conv2d.default, aten.conv2d.padding),
    "layer_norm": (aten.layer_norm.default,),
    "rms_norm": (aten.rms_norm.default,),
}
AMX_KINDS = {
    amx.linear.default: "linear",
    amx.varlen_attention.default: "attention",
    amx.patch_embed.default: "patch_embed",
    amx.conv2d.default: "conv2d",
    amx.layer_norm.default: "layer_norm",
    amx.rms_norm.default: "rms_norm",
}


def linear_replacement(x, weight, bias, *, activation: str, provider: str):
    packed = amx.pack_linear_weight(weight, provider)
    return amx.linear(x, packed, bias, activation, weight.shape[0], provider)


def sdpa_replacement(q, k, v, *, scale: float | None, causal: bool, provider: str):
    """``[B, H, S, D]`` dense attention as varlen attention over B equal segments."""
    b, h, s, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    qp = q.transpose(1, 2).reshape(b * s, h, d)
    kp = k.transpose(1, 2).reshape(b * sk, hk, d)
    vp = v.transpose(1, 2).reshape(b * sk, hk, v.shape[3])
    steps = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    out = amx.varlen_attention(
        qp, kp, vp, steps * s, steps * sk, s, sk, d**-0.5 if scale is None else scale, causal, provider
    )
    return out.reshape(b, s, h, v.shape[3]).transpose(1, 2)


def patch_embed_replacement(x, weight, bias, *, provider: str):
    out_channels, kernel = weight.shape[0], list(weight.shape[2:])
    packed = amx.pack_linear_weight(weight.reshape(out_channels, -1), provider)
    return amx.patch_embed(x, packed, bias, kernel, out_channels, provider)


def patch_embed_2d_replacement(x, weight, bias, *, provider: str):
    """Conv2d patch embedding (CLIP, SigLIP) as the Conv3d one over a time axis of one."""
    return patch_embed_replacement(x.unsqueeze(2), weight.unsqueeze(2), bias, provider=provider).squeeze(2)


def conv2d_replacement(x, weight, bias, *, stride, padding, dilation, groups, provider: str):
    return amx.conv2d(x, weight, bias, stride, padding, dilation, groups, provider)


def layer_norm_replacement(x, weight, bias, *, eps: float, provider: str):
    return amx.layer_norm(x, weight, bias, eps, provider)


def rms_norm_replacement(x, weight, *, eps: float, provider: str):
    return amx.rms_norm(x, weight, eps, provider)
