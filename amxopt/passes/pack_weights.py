"""pack_weights: fold ``amxopt.pack_linear_weight(constant)`` into packed buffers at load time.

Why: packing (VNNI for the AMX kernels) costs a full pass over the weight; done once here, the
graph only reads packed buffers. The unpacked originals are deleted from the GraphModule when
nothing else uses them (``AmxConfig.release_weights``), so the optimized model holds one copy of
each weight. A weight also read by a non-amxopt node is packed and kept (the report says so).

    before:  w = get_attr[blocks.0.attn.qkv.weight];  p = amxopt.pack_linear_weight(w);  amxopt.linear(x, p, ...)
    after:   p = get_attr[_packed.blocks_0_attn_qkv_weight];                          amxopt.linear(x, p, ...)
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.ops import packed
from amxopt.passes._graph import (
    add_constant,
    attrs_behind,
    cleanup,
    drop_dead_code,
    drop_unread,
    evaluate_constant,
    fetch,
    first_attr,
    is_constant,
    source_attr,
    val,
)

_PACK = torch.ops.amxopt.pack_linear_weight.default
PACKED_PREFIX = "_packed"
# On a packed buffer computed from weights (w.t()): their names, which a stored graph keeps.
DERIVED_FROM = "amxopt_derived_from"


def _pack(node: fx.Node, gm: fx.GraphModule, memo: dict) -> torch.Tensor:
    """The packed weight for ``node``: the source's earlier packing when there is one, else packed now."""
    weight, provider = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("provider", "auto")
    src = source_attr(weight)
    source = fetch(gm, src.target) if src is not None else None
    # Only a weight packed whole (as its [N, K] flattening) shares the packing with other graphs.
    if source is not None and tuple(val(weight).shape) != packed.flat_shape(source):
        source = None
    if source is not None:
        done = packed.packed_for(source, provider)
        if done is not None:
            return done  # packed by an earlier graph of this model, or at load time
    origin = first_attr(weight)
    if origin is not None and packed.is_released(fetch(gm, origin.target)):
        raise RuntimeError(
            f"amxopt: {origin.target} was released after packing, but this graph packs it again (as "
            f"{tuple(val(weight).shape)} for provider {provider!r}): optimize with AmxConfig(keep_source=True)"
        )
    with torch.no_grad():
        result = node.target(evaluate_constant(weight, gm, memo), *node.args[1:], **node.kwargs)
    if source is not None:
        packed.remember(source, provider, result)  # a later graph reuses it
    else:  # computed from source weights (w.t(), w.bfloat16()): those stay, and their writes are watched
        node.meta[DERIVED_FROM] = [attr.target for attr in attrs_behind(weight)]
        for target in node.meta[DERIVED_FROM]:
            packed.mark_derived(fetch(gm, target))
    return result


def pack_weights(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    memo: dict = {}
    sources = []
    n_packed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _PACK:
            continue
        weight = node.args[0]
        if not is_constant(weight):
            continue
        packed_weight = _pack(node, gm, memo)
        src = first_attr(weight)
        new = add_constant(gm, PACKED_PREFIX, src.target if src is not None else node.name, packed_weight, node)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
        sources.append(src)
        n_packed += 1
    if not n_packed:
        return PassResult(gm, False)
    memo.clear()
    drop_dead_code(gm)
    if config.release_weights:
        drop_unread(gm, {src.target for src in sources if src is not None}, "unpacked copy kept")
    cleanup(gm)
    return PassResult(gm, True)
