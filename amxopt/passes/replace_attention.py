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

The rules are ``amxopt/patterns/attention.py``.
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import REPLACED, cleanup
from amxopt.passes._rewrite import apply_rules
from amxopt.patterns import attention

_VARLEN = attention.amx.varlen_attention.default


def replace_attention(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    # Adapter-routed nodes already at the configured provider are amxopt ops as captured: label
    # them for the report (the re-target rule relabels the others).
    for node in gm.graph.find_nodes(op="call_function", target=_VARLEN):
        node.meta.setdefault(REPLACED, attention.ADAPTER_ROUTED)
    n_replaced = apply_rules(gm, attention.rules(), config)
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
