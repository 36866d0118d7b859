"""replace_conv2d: ``aten.conv2d`` with a constant weight -> ``amxopt.conv2d``.

Why: on CPUs without bf16 arithmetic ATen's bf16 convolution is emulated, about 30x slower than the
same convolution in fp32 (the Qwen3-Omni audio encoder's three 3x3 stride-2 convs took most of its
eager bf16 time on an AMD Zen 3); ``amxopt.conv2d`` computes it at the precision the CPU's tier runs
fast (csrc/ops.cpp) and leaves it to ATen elsewhere, where autotune picks the faster of the two.
Refuses (and reports) weights computed in the graph, string padding and dtypes without a kernel.

    before:  y = aten.conv2d(x, W, b, stride, padding, dilation, groups)
    after:   y = amxopt.conv2d(x, W, b, stride, padding, dilation, groups)
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes import _autotune
from amxopt.passes._graph import arg, cleanup, dtype_of, insert_traced, is_constant, kept_for_speed, leave, replace_node
from amxopt.patterns import conv2d_replacement

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16)


def _pairs(v) -> list:
    return list(v) * 2 if len(v) == 1 else list(v)


def _params(node: fx.Node) -> dict:
    return dict(
        stride=_pairs(arg(node, 3, "stride", [1])),
        padding=_pairs(arg(node, 4, "padding", [0])),
        dilation=_pairs(arg(node, 5, "dilation", [1])),
        groups=arg(node, 6, "groups", 1),
    )


def _refusal(node: fx.Node) -> str | None:
    x, w = node.args[0], node.args[1]
    if not is_constant(w):
        return "weight is computed in the graph, not a constant"
    if dtype_of(x) not in _DTYPES or dtype_of(w) != dtype_of(x):
        return f"dtypes x={dtype_of(x)} weight={dtype_of(w)} have no kernel"
    if isinstance(arg(node, 4, "padding", [0]), str):
        return f"string padding {arg(node, 4, 'padding')!r}"
    if x.meta["val"].dim() != 4:
        return f"input is {x.meta['val'].dim()}-D, expected [B, C, H, W]"
    return None


def _timing(node: fx.Node, fn, config: AmxConfig) -> _autotune.Timing | None:
    if not _autotune.enabled(config):
        return None
    x, w = (_autotune.materialize(n.meta["val"]) for n in node.args[:2])
    bias = arg(node, 2, "bias")
    b = _autotune.materialize(bias.meta["val"]) if bias is not None else None
    params = _params(node)
    return _autotune.compare(
        f"conv2d [{_autotune.describe(x, w, b)}] {params}",
        config,
        lambda: fn(x, w, b),
        lambda: torch.nn.functional.conv2d(x, w, b, **params),
    )


def replace_conv2d(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in (aten.conv2d.default, aten.conv2d.padding):
            continue
        reason = _refusal(node)
        if reason:
            leave(node, reason)
            continue
        fn = functools.partial(conv2d_replacement, **_params(node), provider=config.provider)
        timing = _timing(node, fn, config)
        if kept_for_speed(node, timing):
            continue
        args = [node.args[0], node.args[1], arg(node, 2, "bias")]
        replace_node(node, insert_traced(node, fn, args, "aten.conv2d", timing))
        n_replaced += 1
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
