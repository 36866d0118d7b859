"""replace_patch_embed: Conv3d / Conv2d whose kernel equals its stride -> ``amxopt.patch_embed`` (one GEMM).

Why: such a convolution is a patchify followed by a matrix multiply; as a GEMM it runs ~75x
faster than ATen's Conv3d on these shapes (90 ms vs 1.2 ms for Qwen3-VL's 784 patches). Conv2d
patch embeddings (CLIP, SigLIP) become the same op over a time axis of one. Refuses (and reports)
any other convolution (padding, dilation, groups, overlapping windows, e.g. the Wan VAE's causal
convs; a Conv2d refused here is left to replace_conv2d), weights computed in the graph, and inputs
not provably divisible by the kernel (the convolution would silently drop the remainder).

    before:  y = aten.conv3d(x, W[O, C, kt, kh, kw], b, stride=[kt, kh, kw])
    after:   y = amxopt.patch_embed(x, amxopt.pack_linear_weight(W.reshape(O, -1)), b, [kt, kh, kw], O)
    before:  y = aten.conv2d(x, W[O, C, kh, kw], b, stride=[kh, kw])
    after:   y = amxopt.patch_embed(x[:, :, None], pack(W.reshape(O, -1)), b, [1, kh, kw], O)[:, :, 0]
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes import _autotune
from amxopt.passes._graph import (
    arg,
    cleanup,
    dtype_of,
    insert_traced,
    is_constant,
    kept_for_speed,
    leave,
    op_name,
    released_source,
    replace_node,
    val,
)
from amxopt.patterns import patch_embed_2d_replacement, patch_embed_replacement

aten = torch.ops.aten
# target -> (spatial dims, the ATen convolution autotune times against, replacement)
_CONVS = {
    aten.conv3d.default: (3, torch.nn.functional.conv3d, patch_embed_replacement),
    aten.conv3d.padding: (3, torch.nn.functional.conv3d, patch_embed_replacement),
    aten.conv2d.default: (2, torch.nn.functional.conv2d, patch_embed_2d_replacement),
    aten.conv2d.padding: (2, torch.nn.functional.conv2d, patch_embed_2d_replacement),
}


def _expand(v, dims: int) -> list:
    return list(v) * dims if len(v) == 1 else list(v)


def _refusal(node: fx.Node) -> str | None:
    x, w = node.args[0], node.args[1]
    if not is_constant(w):
        return "weight is computed in the graph, not a constant"
    if dtype_of(x) not in (torch.float32, torch.bfloat16) or dtype_of(w) != dtype_of(x):
        return f"dtypes x={dtype_of(x)} weight={dtype_of(w)} have no kernel"
    dims = _CONVS[node.target][0]
    kernel = list(val(w).shape[2:])
    stride = _expand(arg(node, 3, "stride", [1]), dims)
    padding = arg(node, 4, "padding", [0])
    dilation = _expand(arg(node, 5, "dilation", [1]), dims)
    groups = arg(node, 6, "groups", 1)
    if stride != kernel:
        return f"stride {stride} != kernel {kernel} (not a patch embedding)"
    if isinstance(padding, str) and padding != "valid" or not isinstance(padding, str) and any(padding):
        return f"padding {padding}"
    if any(d != 1 for d in dilation) or groups != 1:
        return f"dilation {dilation} / groups {groups}"
    xv = val(x)
    if xv.dim() != dims + 2:
        return f"input is {xv.dim()}-D, expected {'[B, C, T, H, W]' if dims == 3 else '[B, C, H, W]'}"
    if not all(statically_known_true(d % k == 0) for d, k in zip(xv.shape[2:], kernel)):
        return f"input {tuple(xv.shape)} is not provably divisible by kernel {kernel}"
    return None


def _timing(node: fx.Node, config: AmxConfig) -> _autotune.Timing | None:
    """amxopt.patch_embed against the ATen convolution it replaces, at this node's shapes."""
    if not _autotune.enabled(config) or released_source(node.args[1]):
        return None
    x, w = _autotune.materialize(val(node.args[0])), _autotune.materialize(val(node.args[1]), scale=0.05)
    bias = arg(node, 2, "bias")
    b = _autotune.materialize(val(bias)) if bias is not None else None
    _, conv, replacement = _CONVS[node.target]
    with torch.no_grad():
        packed_fn = _packed(replacement, w, b, config.provider)
    return _autotune.compare(
        f"patch_embed [{_autotune.describe(x, w, b)}]",
        config,
        lambda: packed_fn(x),
        lambda: conv(x, w, b, stride=list(w.shape[2:])),
    )


def _packed(replacement, w, b, provider: str):
    """``x -> replacement(x, w, b)`` with the weight packed once, as it will run after pack_weights."""
    out_channels = w.shape[0]
    packed = torch.ops.amxopt.pack_linear_weight(w.reshape(out_channels, -1), provider)
    kernel = [1, *w.shape[2:]] if w.dim() == 4 else list(w.shape[2:])

    def run(x):
        x5 = x.unsqueeze(2) if w.dim() == 4 else x
        y = torch.ops.amxopt.patch_embed(x5, packed, b, kernel, out_channels, provider)
        return y.squeeze(2) if w.dim() == 4 else y

    return run


def replace_patch_embed(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in _CONVS:
            continue
        reason = _refusal(node)
        if reason:
            leave(node, reason)
            continue
        timing = _timing(node, config)
        if kept_for_speed(node, timing):
            continue
        fn = functools.partial(_CONVS[node.target][2], provider=config.provider)
        args = [node.args[0], node.args[1], arg(node, 2, "bias")]
        replace_node(node, insert_traced(node, fn, args, op_name(node.target).removesuffix(".default"), timing))
        n_replaced += 1
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
