"""replace_attention: dense SDPA and adapter-routed varlen attention -> ``amxopt.varlen_attention``.

Why: one varlen kernel serves every attention in these models (Qwen's per-frame segments, the
audio encoder's 104-token windows, Wan's dense self/cross attention), and the packed ``[T, H, D]``
layout is what the kernels want. Refuses (and reports) attention masks, dropout > 0, GQA without
``enable_gqa``, and causal attention between different query/key lengths (SDPA aligns that mask
top-left, varlen kernels bottom-right).

    before:  o = aten.scaled_dot_product_attention(q, k, v, scale=s)          # q: [B, H, S, D]
    after:   o = amxopt.varlen_attention(q.transpose(1, 2).reshape(B*S, H, D), ...,
                                         cu_seqlens=arange(B+1)*S, scale=s).reshape(...).transpose(1, 2)

The Qwen adapters already route attention to ``amxopt.varlen_attention`` at capture time (with
the reference provider); this pass re-targets those nodes to the configured provider.
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
    REPLACED,
    arg,
    cleanup,
    dtype_of,
    insert_traced,
    kept_for_speed,
    leave,
    replace_node,
    val,
)
from amxopt.patterns import sdpa_replacement

aten = torch.ops.aten
_VARLEN = torch.ops.amxopt.varlen_attention.default
_PROVIDER_ARG = 9


def _refusal(node: fx.Node) -> str | None:
    q, k, v = (val(a) for a in node.args[:3])
    if arg(node, 3, "attn_mask") is not None:
        # A padding mask, or an additive bias such as UMT5's relative positions: no amxopt op takes one yet.
        return "has an attention mask (amxopt.varlen_attention takes none; causal is a flag)"
    if arg(node, 4, "dropout_p", 0.0) != 0.0:
        return f"dropout_p={arg(node, 4, 'dropout_p')}"
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q/k/v are not [B, H, S, D]"
    if dtype_of(node.args[0]) not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype_of(node.args[0])} has no kernel"
    if q.shape[1] != k.shape[1] and not arg(node, 7, "enable_gqa", False):
        return "query and key head counts differ without enable_gqa"
    if arg(node, 5, "is_causal", False) and not statically_known_true(q.shape[2] == k.shape[2]):
        return "causal with query/key lengths that may differ (SDPA aligns the mask top-left)"
    return None


def _timing(node: fx.Node, fn, config: AmxConfig) -> _autotune.Timing | None:
    """Dense attention: amxopt's varlen op against the aten SDPA call it replaces. (Adapter-routed
    varlen nodes are not timed: what they replace is the model's per-segment Python loop.)"""
    if not _autotune.enabled(config):
        return None
    q, k, v = (_autotune.materialize(val(a)) for a in node.args[:3])
    rest = [_autotune.materialize(val(a)) if isinstance(a, fx.Node) else a for a in node.args[3:]]
    kwargs = {n: _autotune.materialize(val(a)) if isinstance(a, fx.Node) else a for n, a in node.kwargs.items()}
    causal = " causal" if arg(node, 5, "is_causal", False) else ""
    return _autotune.compare(
        f"attention [{_autotune.describe(q, k, v)}]{causal}",
        config,
        lambda: fn(q, k, v),
        lambda: node.target(q, k, v, *rest, **kwargs),
    )


def replace_attention(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == _VARLEN and node.args[_PROVIDER_ARG] != config.provider:
            node.args = (*node.args[:_PROVIDER_ARG], config.provider)
            node.meta.setdefault(REPLACED, "adapter-routed varlen attention")
            n_replaced += 1
        elif node.target == _VARLEN:
            node.meta.setdefault(REPLACED, "adapter-routed varlen attention")
        elif node.target == aten.scaled_dot_product_attention.default:
            reason = _refusal(node)
            if reason:
                leave(node, reason)
                continue
            fn = functools.partial(
                sdpa_replacement,
                scale=arg(node, 6, "scale"),
                causal=bool(arg(node, 5, "is_causal", False)),
                provider=config.provider,
            )
            timing = _timing(node, fn, config)
            if kept_for_speed(node, timing):
                continue
            source = "aten.scaled_dot_product_attention"
            replace_node(node, insert_traced(node, fn, list(node.args[:3]), source, timing))
            n_replaced += 1
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
