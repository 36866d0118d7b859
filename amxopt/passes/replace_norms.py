"""replace_norms: LayerNorm / RMSNorm (and the fp32-upcast LayerNorm) -> ``amxopt.layer_norm`` / ``rms_norm``.

Why: one pass over memory with fp32 accumulation, reading bf16 and writing bf16, instead of an
upcast copy, a norm and a downcast copy. The upcast pattern is diffusers' ``FP32LayerNorm`` (Wan):
the amxopt op accumulates in fp32 whatever its input dtype, so the casts fold away. Refuses (and
reports) norms over more than the last dim, dtypes without a kernel, and outputs whose dtype differs
from the input's.

    before:  x32 = aten.to(x, f32);  y32 = aten.layer_norm(x32, [D], w, b, eps);  y = aten.to(y32, bf16)
    after:   y = amxopt.layer_norm(x, w, b, eps)
             (aten.rms_norm(x, [D], w, eps) -> amxopt.rms_norm(x, w, eps) likewise)
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes import _autotune
from amxopt.passes._graph import arg, cleanup, dtype_of, insert_traced, kept_for_speed, leave, replace_node, val
from amxopt.patterns import layer_norm_replacement, rms_norm_replacement

aten = torch.ops.aten
_DTYPES = (torch.float32, torch.bfloat16)
_CASTS = (aten.to.dtype, aten._to_copy.default)


def _cast_target(node: fx.Node) -> torch.dtype | None:
    """The dtype a cast node converts to, or None if ``node`` is not a plain dtype cast."""
    if node.op != "call_function" or node.target not in _CASTS:
        return None
    if node.target == aten.to.dtype:
        return arg(node, 1, "dtype")
    extra = set(node.kwargs) - {"dtype"}
    return None if extra else node.kwargs.get("dtype")


def _refusal(node: fx.Node, x: fx.Node, params: list) -> str | None:
    shape = arg(node, 1, "normalized_shape")
    xv = val(x)
    if len(shape) != 1 or shape[0] != xv.shape[-1]:
        return f"normalizes over {list(shape)}, not just the last dim of {tuple(xv.shape)}"
    if dtype_of(x) not in _DTYPES or any(p is not None and dtype_of(p) not in _DTYPES for p in params):
        return f"dtypes {[dtype_of(a) for a in (x, *params)]} have no kernel"
    return None


def _upcast_window(node: fx.Node) -> tuple[fx.Node, fx.Node]:
    """(input, output) of the norm with a surrounding ``to(f32) ... to(orig)`` folded in, if present."""
    x, out = node.args[0], node
    if _cast_target(x) == torch.float32 and len(node.users) == 1:
        down = next(iter(node.users))
        src = x.args[0]
        if dtype_of(src) in _DTYPES and _cast_target(down) == dtype_of(src):
            return src, down
    return x, out


def _timing(node: fx.Node, x: fx.Node, out: fx.Node, params: list, fn, config: AmxConfig):
    """The amxopt norm against the aten norm it replaces (with the up/down casts when folded)."""
    if not _autotune.enabled(config):
        return None
    xs = _autotune.materialize(val(x))
    ps = [_autotune.materialize(val(p)) if p is not None else None for p in params]
    rest = [_autotune.materialize(val(a)) if isinstance(a, fx.Node) else a for a in node.args[1:]]
    kwargs = {k: _autotune.materialize(val(v)) if isinstance(v, fx.Node) else v for k, v in node.kwargs.items()}
    upcast = out is not node

    def run_aten():
        y = node.target(xs.float() if upcast else xs, *rest, **kwargs)
        return y.to(xs.dtype) if upcast else y

    return _autotune.compare(
        f"{_op_kind(node)} [{_autotune.describe(xs, *ps)}]{' fp32 upcast' if upcast else ''}",
        config,
        lambda: fn(xs, *ps),
        run_aten,
    )


def _op_kind(node: fx.Node) -> str:
    return "layer_norm" if node.target == aten.layer_norm.default else "rms_norm"


def replace_norms(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target == aten.layer_norm.default:
            params = [arg(node, 2, "weight"), arg(node, 3, "bias")]
            x, out = _upcast_window(node)
            fn = functools.partial(
                layer_norm_replacement, eps=float(arg(node, 4, "eps", 1e-5)), provider=config.provider
            )
            source = "aten.layer_norm" + (" (fp32 upcast)" if out is not node else "")
        elif node.target == aten.rms_norm.default:
            params = [arg(node, 2, "weight")]
            x, out = _upcast_window(node)
            eps = arg(node, 3, "eps")
            eps = torch.finfo(dtype_of(node.args[0])).eps if eps is None else float(eps)
            fn = functools.partial(rms_norm_replacement, eps=eps, provider=config.provider)
            source = "aten.rms_norm" + (" (fp32 upcast)" if out is not node else "")
        else:
            continue
        reason = _refusal(node, x, params)
        if reason is None and dtype_of(out) != dtype_of(x):
            reason = f"output dtype {dtype_of(out)} differs from input dtype {dtype_of(x)}"
        if reason:
            leave(node, reason)
            continue
        timing = _timing(node, x, out, params, fn, config)
        if kept_for_speed(node, timing):
            continue
        new = insert_traced(out, fn, [x, *params], source, timing)
        if out is node:
            replace_node(node, new)
        else:
            upcast = node.args[0]
            replace_node(out, new, node, upcast)
        n_replaced += 1
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
