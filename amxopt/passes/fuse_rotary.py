"""fuse_rotary: the rotary embedding of q and k -> inside the attention that reads them.

Why: ``amxopt.rotary_embedding`` on q and k writes both back to memory only for the attention to
read them again, right after a GEMM has evicted them: 48 calls of 0.5 ms in a Qwen3-VL-2B vision
forward on a Zen 4 (1.5% of it), a larger share where AMX makes the GEMMs several times faster.
``amxopt.varlen_attention`` copies each query row and packs each key once anyway; with
``rotary_cos`` / ``rotary_sin`` it rotates them on the way, with the rotary op's own row kernel
and rounding, so the result is bit for bit the same (csrc/attention.cpp).

What it takes: an attention whose q and k are, through views only, the outputs of two rotary
embeddings with the same cos, sin and pairing, each read by nothing else; cos / sin broadcast over
the heads (one angle per token); q and k of the same tokens (a self-attention). The attention then
reads the rotaries' inputs with their leading dims flattened into tokens, and cos / sin as
``[tokens, width]``. Anything else is left as it was; a pair of rotaries that feeds an attention but
cannot be taken is reported with the reason. ``AmxConfig(fuse_rotary=False)`` turns it off.

    before:  q = rotary_embedding(q0, cos, sin, il);  k = rotary_embedding(k0, cos, sin, il)
             o = varlen_attention(transpose(unsqueeze(transpose(q))), ..., causal)
    after:   o = varlen_attention(flatten(q0), flatten(k0), v, ..., causal,
                                  rotary_cos=flatten(expand(cos)), rotary_sin=..., rotary_interleaved=il)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import fx
from torch._prims_common import make_contiguous_strides_for
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import (
    LAYOUT,
    REPLACED,
    TIMED,
    arg,
    cleanup,
    insert_traced,
    leave,
    replace_node,
    val,
    written_alias,
    written_inside,
)

aten = torch.ops.aten
amx = torch.ops.amxopt
# Ops that only re-view their input: a rotary's output reaches the attention through these.
_VIEWS = {
    aten.view.default, aten._unsafe_view.default, aten.transpose.int, aten.permute.default,
    aten.unsqueeze.default, aten.squeeze.dim, aten.select.int, aten.alias.default,
}  # fmt: skip
# ... and these, which copy (and may reorder, a copy's fake value looking contiguous whatever it
# holds) unless their input is laid out contiguously: taken only then.
_RESHAPES = {aten.reshape.default, aten.flatten.using_ints, aten.unflatten.int}


def _contiguous(t: torch.Tensor) -> bool:
    want = make_contiguous_strides_for(t.shape)
    return all(_known(n == 1) or _known(a == b) for n, a, b in zip(t.shape, t.stride(), want))


def _views_only(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return node.target in _VIEWS or (node.target in _RESHAPES and _contiguous(val(node.args[0])))


def _reads_metadata(user: fx.Node, node: fx.Node) -> bool:
    """``user`` reads only the size or dtype of ``node``: a ``sym_size`` (Wan sizes its cu_seqlens on
    the permuted q), or ``type_as(y, node)`` (diffusers' attention casts its output as q)."""
    if user.target is aten.sym_size.int:
        return True
    return user.target is aten.type_as.default and user.args[1] is node and user.args[0] is not node


def _rotary_behind(node: fx.Node) -> tuple[fx.Node, list[tuple[fx.Node, fx.Node]]] | None:
    """The rotary embedding ``node`` views, if every node from it to ``node`` is read by the next one
    only, apart from readers of its size or dtype; and those readers, each with the node it reads."""
    readers = []

    def users(n: fx.Node) -> list[fx.Node]:
        readers.extend((u, n) for u in n.users if _reads_metadata(u, n))
        return [u for u in n.users if not _reads_metadata(u, n)]

    while _views_only(node) and len(users(node)) == 1:
        node = node.args[0]
    if node.op == "call_function" and node.target is amx.rotary_embedding.default and len(users(node)) == 1:
        return node, readers
    return None


def _reread(readers: list[tuple[fx.Node, fx.Node]], x: fx.Node) -> Callable[[], None] | None:
    """How to point each reader of a size or dtype of the rotary's output (or a view of it) at its
    input ``x`` (the rotary keeps shape and dtype), so that nothing reads the output once the
    attention rotates; None if a size is none of x's."""
    shape = val(x).shape
    dims = {}
    for u, _ in readers:
        if u.target is aten.sym_size.int:
            dims[u] = next((i for i, s in enumerate(shape) if _known(s == val(u))), None)
    if None in dims.values():
        return None

    def apply() -> None:
        for u, read in readers:
            if u.target is aten.sym_size.int:
                with u.graph.inserting_before(u):
                    new = u.graph.call_function(aten.sym_size.int, (x, dims[u]))
                new.meta.update(u.meta)
                u.replace_all_uses_with(new)
            else:
                u.replace_input_with(read, x)

    return apply


def _known(cond) -> bool:
    return statically_known_true(cond)


def _same_value(a, b, depth: int = 4) -> bool:
    """``a`` and ``b`` are one value: the same node, or the same deterministic, non-mutating op on the
    same values, with no tensor written in place between them (Wan's rotary rules slice cos / sin
    for q and for k apart; ``e.view(-1).mul_(2)`` between two ``e.cos()`` made them two angles, and
    export reads ``e`` through the same node before and after the write), and neither written in place
    after it was made (two ``torch.zeros`` filled each with its own angles)."""
    if a is b:
        return True
    if isinstance(a, fx.Node) != isinstance(b, fx.Node) or isinstance(a, torch.Tensor):
        return False
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_value(x, y, depth) for x, y in zip(a, b))
    if isinstance(a, float) and type(b) is float:  # 0.0 == -0.0: e.copysign(0.0) is not e.copysign(-0.0)
        return a == b and math.copysign(1.0, a) == math.copysign(1.0, b)
    if not isinstance(a, fx.Node):
        return type(a) is type(b) and a == b
    if depth == 0 or a.op != "call_function" or a.target != b.target or a.kwargs != b.kwargs:
        return False
    if written_inside([min(a, b)], max(a, b)) is not None:
        return False
    if written_alias(a) is not None or written_alias(b) is not None:  # made alike, then filled apart
        return False
    op = a.target
    if (
        not isinstance(op, torch._ops.OpOverload)
        or op._schema.is_mutable
        or torch.Tag.nondeterministic_seeded in op.tags
    ):
        return False
    return len(a.args) == len(b.args) and all(_same_value(x, y, depth - 1) for x, y in zip(a.args, b.args))


def _why_not(attn: fx.Node, rq: fx.Node, rk: fx.Node) -> str | None:
    """Why the rotaries ``rq`` (of q) and ``rk`` (of k) cannot move into ``attn``; None if they can."""
    if rq.meta.get(LAYOUT) or rk.meta.get(LAYOUT):
        # The views between them read the rotary's output in export's recorded layout, not its own:
        # the checks below, made on those recorded values, would not hold.
        return "the rotary's output is laid out otherwise than export saw it (a transposed q or k)"
    factors = [(arg(r, 1, "cos"), arg(r, 2, "sin"), arg(r, 3, "interleaved")) for r in (rq, rk)]
    if not all(_same_value(a, b) for a, b in zip(*factors)):
        return "q and k are rotated by different cos / sin, or pair their values otherwise"
    provider = arg(attn, 9, "provider", "auto")
    if any(arg(r, 4, "provider", "auto") != provider for r in (rq, rk)):
        return "the rotary and the attention run on different providers"
    cos = val(rq.args[1])
    for name, r, seen in (("q", rq, val(attn.args[0])), ("k", rk, val(attn.args[1]))):
        x = val(r.args[0])
        by_token = x.dim() >= 3 and all(
            _known(a == b) for a, b in zip((math.prod(x.shape[:-2]), *x.shape[-2:]), seen.shape)
        )
        if not by_token:
            return f"the attention's {name} {tuple(seen.shape)} is not the rotary's input {tuple(x.shape)} by token"
        # The attention reads the rotary's (contiguous) output in its own order: as one reshape of it.
        if not (_known(seen.storage_offset() == 0) and _contiguous(seen)):
            return f"the attention reads {name} in another order than the rotary wrote it"
    written = written_inside([rq, rk], attn)
    if written is not None:
        return f"{written.name} writes a tensor in place between them"
    xq, xk = val(rq.args[0]), val(rk.args[0])
    if xq.dim() != xk.dim() or not all(_known(a == b) for a, b in zip(xq.shape[:-2], xk.shape[:-2])):
        return f"q {tuple(xq.shape)} and k {tuple(xk.shape)} are not the same tokens (not a self-attention)"
    if cos.dim() < 2 or cos.dim() > xq.dim() or not _known(cos.shape[-2] == 1):
        return f"cos {tuple(cos.shape)} is not one angle per token for every head"
    return None


def _attention_with_rotary(q0, k0, v, cu_q, cu_k, max_q, max_k, scale, causal, cos, sin, provider, interleaved):
    lead = q0.shape[:-2]  # the tokens, as the rotary saw them ([T] or [B, S])
    cos_t, sin_t = (c.expand(*lead, 1, c.shape[-1]).flatten(0, -2) for c in (cos, sin))
    return amx.varlen_attention(
        q0.flatten(0, -3),
        k0.flatten(0, -3),
        v,
        cu_q,
        cu_k,
        max_q,
        max_k,
        scale,
        causal,
        provider,
        rotary_cos=cos_t,
        rotary_sin=sin_t,
        rotary_interleaved=interleaved,
    )


def fuse_rotary(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_fused = 0
    if not config.fuse_rotary:
        return PassResult(gm, False)
    for attn in list(gm.graph.nodes):
        if attn.op != "call_function" or attn.target is not amx.varlen_attention.default:
            continue
        if attn.kwargs.get("rotary_cos") is not None:
            continue
        q_side, k_side = _rotary_behind(attn.args[0]), _rotary_behind(attn.args[1])
        if q_side is None or k_side is None or q_side[0] is k_side[0]:
            continue
        (rq, q_readers), (rk, k_readers) = q_side, k_side
        reason = _why_not(attn, rq, rk)
        rereads = [_reread(q_readers, rq.args[0]), _reread(k_readers, rk.args[0])]
        if reason is None and None in rereads:
            reason = "a size read from a view of its output is not one of its input's"
        if reason is not None:
            leave(attn, f"its rotary embedding stays a separate op: {reason}")
            continue
        for apply in rereads:
            apply()
        args = [
            rq.args[0], rk.args[0], attn.args[2], attn.args[3], attn.args[4],
            arg(attn, 5, "max_seqlen_q"), arg(attn, 6, "max_seqlen_k"), arg(attn, 7, "scale"), arg(attn, 8, "causal"),
            arg(rq, 1, "cos"), arg(rq, 2, "sin"), arg(attn, 9, "provider", "auto"), arg(rq, 3, "interleaved"),
        ]  # fmt: skip
        fused = insert_traced(attn, _attention_with_rotary, args, attn.meta.get(REPLACED, "?"), attn.meta.get(TIMED))
        replace_node(attn, fused)
        n_fused += 1
    if n_fused:
        cleanup(gm)
    return PassResult(gm, n_fused > 0)
