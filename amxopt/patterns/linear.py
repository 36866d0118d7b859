"""Rules: ``aten.linear`` (+ a following gelu / gelu_tanh / silu) -> ``amxopt.linear``.

The activation rules come first (one per entry of ``ACTIVATION_RULES``), so a Linear whose only
user is a fusable activation becomes one GEMM with the activation in its epilogue; they apply only
with ``AmxConfig.fuse_activation``. Refusals: a weight computed in the graph, dtypes other than
equal fp32/bf16, a bias of another dtype.
"""

from __future__ import annotations

import functools

import torch

from amxopt.ops import reference
from amxopt.passes import _autotune
from amxopt.passes._graph import dtype_of, is_constant, released_source, val
from amxopt.patterns import ACTIVATION_RULES, DTYPES, ActivationRule, Match, Rule, linear_replacement

aten = torch.ops.aten


def _linear(x, weight, bias):
    return aten.linear.default(x, weight, bias)


def _activation_pattern(act: ActivationRule):
    def pattern(x, weight, bias):
        return act(aten.linear.default(x, weight, bias))

    return pattern


def _refusal(match: Match) -> str | None:
    x, w, b = match["x"], match["weight"], match["bias"]
    if not is_constant(w):
        return "weight is computed in the graph, not a constant"
    if dtype_of(x) not in DTYPES or dtype_of(w) != dtype_of(x):
        return f"dtypes x={dtype_of(x)} weight={dtype_of(w)} have no kernel (need equal fp32 or bf16)"
    if b is not None and dtype_of(b) not in DTYPES:
        return f"bias dtype {dtype_of(b)} has no kernel"
    return None


def _timing(activation: str, match: Match, fn, config) -> _autotune.Timing | None:
    """amxopt.linear (+ fused activation) against aten.linear + the activation, at this node's shapes."""
    if released_source(match["weight"]):
        return None
    xv, wv, bias = val(match["x"]), val(match["weight"]), match["bias"]
    x = _autotune.materialize(xv).flatten(0, -2) if xv.dim() > 1 else _autotune.materialize(xv)[None]
    w = _autotune.materialize(wv, scale=x.shape[-1] ** -0.5)
    b = _autotune.materialize(val(bias))
    packed = torch.ops.amxopt.pack_linear_weight(w, config.provider)
    act = reference.ACTIVATIONS[activation]
    return _autotune.compare(
        f"linear [{_autotune.describe(x, w, b)}] {activation}",
        config,
        lambda: torch.ops.amxopt.linear(x, packed, b, activation, w.shape[0], config.provider),
        lambda: act(torch.nn.functional.linear(x, w, b)),
    )


def _rule(activation: str, pattern, when: str | None) -> Rule:
    return Rule(
        name="aten.linear",
        kind="linear",
        pattern=pattern,
        replacement=linear_replacement,
        inputs=("x", "weight", "bias"),
        options=lambda match, config: {"activation": activation, "provider": config.provider},
        guard=_refusal,
        timing=functools.partial(_timing, activation),
        when=when,
    )


@functools.cache
def rules() -> tuple[Rule, ...]:
    fused = tuple(_rule(a.activation, _activation_pattern(a), "fuse_activation") for a in ACTIVATION_RULES)
    return (*fused, _rule("none", _linear, None))
