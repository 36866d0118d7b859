"""Rules: LayerNorm / RMSNorm, and the fp32-upcast LayerNorm/RMSNorm, -> ``amxopt.layer_norm`` / ``rms_norm``.

The upcast rules come first: ``to(x, f32) -> norm -> to(x.dtype)`` (diffusers' ``FP32LayerNorm``,
Wan) is one amxopt norm on ``x``, since the kernels accumulate in fp32 whatever the input dtype.
One rule per cast op (``aten.to.dtype``, ``aten._to_copy``) and norm. The ``type_as`` window
(``FP32LayerNorm(x.float()).type_as(x)``, Wan's norm2) comes before them: it is the longer match. Refusals: norms over more
than the last dim, dtypes without a kernel, an output dtype other than the input's.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from amxopt.passes import _autotune
from amxopt.passes._graph import dtype_of, val
from amxopt.patterns import (
    CASTS,
    DTYPES,
    Match,
    Rule,
    layer_norm_replacement,
    normalizes_last_dim,
    rms_eps,
    rms_norm_replacement,
    upcast_extent,
    upcast_of,
)

aten = torch.ops.aten


def _layer_norm(x, shape, weight, bias, eps, cudnn):
    return aten.layer_norm.default(x, shape, weight, bias, eps, cudnn)


def _rms_norm(x, shape, weight, eps):
    return aten.rms_norm.default(x, shape, weight, eps)


def _upcast_layer_norm(cast):
    def pattern(x, dtype, shape, weight, bias, eps, cudnn):
        return cast(_layer_norm(cast(x, torch.float32), shape, weight, bias, eps, cudnn), dtype)

    return pattern


def _upcast_rms_norm(cast):
    def pattern(x, dtype, shape, weight, eps):
        return cast(_rms_norm(cast(x, torch.float32), shape, weight, eps), dtype)

    return pattern


def _type_as_layer_norm(back):
    """diffusers' ``FP32LayerNorm(x.float()).type_as(x)`` (Wan's norm2): the norm reads ``xf``, ``x``
    cast up once or more; its output is cast back to fp32 (a node export keeps), then to ``x``'s
    dtype by ``type_as``. ``upcast_of`` checks the chain from ``x`` to ``xf``."""

    def pattern(xf, x, shape, weight, bias, eps, cudnn):
        y = _layer_norm(xf, shape, weight, bias, eps, cudnn)
        return aten.type_as.default(back(y, torch.float32) if back is not None else y, x)

    return pattern


# kind -> (pattern, upcast pattern maker, replacement, tensor parameters)
_NORMS = {
    "layer_norm": (_layer_norm, _upcast_layer_norm, layer_norm_replacement, ("weight", "bias")),
    "rms_norm": (_rms_norm, _upcast_rms_norm, rms_norm_replacement, ("weight",)),
}


def _refusal(match: Match) -> str | None:
    x, shape, xv = match["x"], match["shape"], val(match["x"])
    params = [match[p] for p in ("weight", "bias") if p in match.values]
    if not normalizes_last_dim(shape, x):
        return f"normalizes over {list(shape)}, not just the last dim of {tuple(xv.shape)}"
    if dtype_of(x) not in DTYPES or any(p is not None and dtype_of(p) not in DTYPES for p in params):
        return f"dtypes {[dtype_of(a) for a in (x, *params)]} have no kernel"
    if dtype_of(match.out) != dtype_of(x):
        return f"output dtype {dtype_of(match.out)} differs from input dtype {dtype_of(x)}"
    return None


def _same_dtype_window(match: Match, config) -> bool:
    """An upcast window folds only when it casts back to the input's own dtype."""
    return dtype_of(match["x"]) in DTYPES and dtype_of(match.out) == dtype_of(match["x"])


def _options(kind: str, match: Match, config) -> dict:
    eps = rms_eps(match["eps"]) if kind == "rms_norm" else float(match["eps"])
    return {"eps": eps, "provider": config.provider}


def _real(a):
    """A random real tensor for a node (its fake value's shape and dtype); a literal or None as is."""
    return _autotune.materialize(val(a))


def _timing(kind: str, params: tuple[str, ...], upcast: bool, match: Match, fn, config) -> _autotune.Timing | None:
    """The amxopt norm against the aten norm it replaces (with the up/down casts when folded)."""
    node = match.root

    def setup():
        xs = _real(match["x"])
        ps = [_real(match[p]) for p in params]
        rest = [_real(a) for a in node.args[1:]]
        kwargs = {k: _real(v) for k, v in node.kwargs.items()}

        def run_aten():
            y = node.target(xs.float() if upcast else xs, *rest, **kwargs)
            return y.to(xs.dtype) if upcast else y

        return lambda: fn(xs, *ps), run_aten

    described = _autotune.describe(val(match["x"]), *(val(match[p]) for p in params))
    return _autotune.compare(f"{kind} [{described}]{' fp32 upcast' if upcast else ''}", config, setup)


def _rule(kind: str, pattern, upcast: bool) -> Rule:
    _, _, replacement, params = _NORMS[kind]
    return Rule(
        name=f"aten.{kind}" + (" (fp32 upcast)" if upcast else ""),
        kind=kind,
        pattern=pattern,
        replacement=replacement,
        inputs=("x", *params),
        options=functools.partial(_options, kind),
        applies=_same_dtype_window if upcast else lambda match, config: True,
        guard=_refusal,
        timing=functools.partial(_timing, kind, params, upcast),
    )


def _type_as_window(match: Match, config) -> bool:
    return upcast_of(match["xf"], match["x"]) and _same_dtype_window(match, config)


@functools.cache
def rules() -> tuple[Rule, ...]:
    upcast = tuple(_rule(kind, make(cast), True) for kind, (_, make, _, _) in _NORMS.items() for cast in CASTS)
    type_as = tuple(
        dataclasses.replace(
            _rule("layer_norm", _type_as_layer_norm(back), True),
            name="aten.layer_norm (fp32 upcast, type_as)",
            applies=_type_as_window,
            extent=upcast_extent,
        )
        for back in (*CASTS, None)
    )
    return (*type_as, *upcast, *(_rule(kind, norm, False) for kind, (norm, _, _, _) in _NORMS.items()))
