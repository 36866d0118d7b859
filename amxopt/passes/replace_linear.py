"""replace_linear: ``aten.linear`` (+ a following gelu/silu) -> ``amxopt.linear``.

Why: a packed-weight GEMM with the activation in its epilogue saves a pass over the output and
lets the weight be packed once at load time. Refuses (and reports) weights computed in the graph,
dtypes other than fp32/bf16, and x/weight dtype mismatches. The activation is fused only when it
is the linear's single user, so no intermediate is needed by anything else.

    before:  y = aten.linear(x, W, b);  z = aten.gelu(y, approximate="tanh")
    after:   z = amxopt.linear(x, amxopt.pack_linear_weight(W), b, "gelu_tanh", N)
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.ops import reference
from amxopt.passes import _autotune
from amxopt.passes._graph import (
    arg,
    cleanup,
    dtype_of,
    insert_traced,
    is_constant,
    kept_for_speed,
    leave,
    released_source,
    replace_node,
    val,
)
from amxopt.patterns import ACTIVATION_RULES, linear_replacement

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16)


def _refusal(node: fx.Node) -> str | None:
    x, w, b = node.args[0], node.args[1], arg(node, 2, "bias")
    if not is_constant(w):
        return "weight is computed in the graph, not a constant"
    if dtype_of(x) not in _DTYPES or dtype_of(w) != dtype_of(x):
        return f"dtypes x={dtype_of(x)} weight={dtype_of(w)} have no kernel (need equal fp32 or bf16)"
    if b is not None and dtype_of(b) not in _DTYPES:
        return f"bias dtype {dtype_of(b)} has no kernel"
    return None


def _fusable_activation(node: fx.Node) -> tuple[fx.Node | None, str]:
    if len(node.users) != 1:
        return None, "none"
    user = next(iter(node.users))
    for rule in ACTIVATION_RULES:
        if user.op == "call_function" and user.target == rule.target and user.args[0] is node:
            if rule.approximate is None or arg(user, 1, "approximate", "none") == rule.approximate:
                return user, rule.activation
    return None, "none"


def _timing(node: fx.Node, activation: str, config: AmxConfig) -> _autotune.Timing | None:
    """amxopt.linear (+ fused activation) against aten.linear + the activation, at this node's shapes."""
    if not _autotune.enabled(config) or released_source(node.args[1]):
        return None
    xv, wv, bias = val(node.args[0]), val(node.args[1]), arg(node, 2, "bias")
    x = _autotune.materialize(xv).flatten(0, -2) if xv.dim() > 1 else _autotune.materialize(xv)[None]
    w = _autotune.materialize(wv, scale=x.shape[-1] ** -0.5)
    b = _autotune.materialize(val(bias)) if bias is not None else None
    packed = torch.ops.amxopt.pack_linear_weight(w, config.provider)
    act = reference.ACTIVATIONS[activation]
    return _autotune.compare(
        f"linear [{_autotune.describe(x, w, b)}] {activation}",
        config,
        lambda: torch.ops.amxopt.linear(x, packed, b, activation, w.shape[0], config.provider),
        lambda: act(torch.nn.functional.linear(x, w, b)),
    )


def replace_linear(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != aten.linear.default:
            continue
        reason = _refusal(node)
        if reason:
            leave(node, reason)
            continue
        act_node, activation = _fusable_activation(node) if config.fuse_activation else (None, "none")
        timing = _timing(node, activation, config)
        if kept_for_speed(node, timing):
            continue
        fn = functools.partial(linear_replacement, activation=activation, provider=config.provider)
        last = act_node or node
        args = [node.args[0], node.args[1], arg(node, 2, "bias")]
        new = insert_traced(last, fn, args, "aten.linear", timing)
        if act_node is not None:
            replace_node(act_node, new, node)
        else:
            replace_node(node, new)
        n_replaced += 1
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
