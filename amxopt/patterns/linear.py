"""Rules: ``aten.linear`` (+ a following gelu / gelu_tanh / silu, or + a residual) -> ``amxopt.linear``.

The residual rules come first: a Linear whose only user is an ``add`` of a tensor of its output's
shape and dtype (a transformer block's ``h + attn(h)``, ``h + mlp(h)``) becomes one GEMM that adds
it in its epilogue, with ``AmxConfig.fuse_residual``. Then the activation rules (one per entry of
``ACTIVATION_RULES``): a Linear whose only user is a fusable activation becomes one GEMM with the
activation in its epilogue, with ``AmxConfig.fuse_activation``. Refusals: a weight computed in the
graph, dtypes other than equal fp32/bf16, a bias of another dtype or that broadcasts (``[1, N]``,
``[S, N]``: F.linear takes it); for a residual, one that
broadcasts or has another dtype (that add stays, after a plain ``amxopt.linear``).
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amxopt.ops import reference
from amxopt.ops.library import packed_linear_shape
from amxopt.passes import _autotune
from amxopt.passes._graph import dtype_of, not_constant, released_source, val
from amxopt.patterns import (
    ACTIVATION_RULES,
    DTYPES,
    ActivationRule,
    Match,
    Rule,
    linear_replacement,
    linear_residual_replacement,
)

aten = torch.ops.aten


def _linear(x, weight, bias):
    return aten.linear.default(x, weight, bias)


def _activation_pattern(act: ActivationRule):
    def pattern(x, weight, bias):
        return act(aten.linear.default(x, weight, bias))

    return pattern


def _residual_pattern(linear_first: bool, own_input: bool):
    """``linear + residual`` or ``residual + linear``; with ``own_input`` the residual is the Linear's
    input (``h + fc(h)``: the matcher binds one node to one wildcard only, so that needs its own pattern)."""

    def pattern(x, weight, bias, residual):
        y = aten.linear.default(x, weight, bias)
        return aten.add.Tensor(y, residual) if linear_first else aten.add.Tensor(residual, y)

    def own(x, weight, bias):
        return pattern(x, weight, bias, x)

    return own if own_input else pattern


def _residual(match: Match):
    return match.values.get("residual", match["x"])


def _residual_applies(match: Match, config) -> bool:
    """An add of a tensor of exactly the Linear's output shape and dtype (no broadcast, no promotion)."""
    r, y = val(_residual(match)), val(match.root)
    return (
        isinstance(r, torch.Tensor)
        and r.dtype == y.dtype
        and r.dim() == y.dim()
        and all(statically_known_true(a == b) for a, b in zip(r.shape, y.shape))
    )


def _refusal(match: Match) -> str | None:
    x, w, b = match["x"], match["weight"], match["bias"]
    if (refusal := not_constant(w, "weight")) is not None:
        return refusal
    if dtype_of(x) not in DTYPES or dtype_of(w) != dtype_of(x):
        return f"dtypes x={dtype_of(x)} weight={dtype_of(w)} have no kernel (need equal fp32 or bf16)"
    if b is not None and dtype_of(b) not in DTYPES:
        return f"bias dtype {dtype_of(b)} has no kernel"
    if b is not None and not _one_per_output(val(b), val(w)):
        # F.linear broadcasts a bias against its output ([1, N], [S, N]); the kernels take one per column.
        return f"bias of shape {tuple(val(b).shape)} is not one per output feature ({val(w).shape[0]},)"
    return None


def _one_per_output(bias: torch.Tensor, weight: torch.Tensor) -> bool:
    return bias.dim() == 1 and statically_known_true(bias.shape[0] == weight.shape[0])


def _timing(activation: str, residual: bool, match: Match, fn, config) -> _autotune.Timing | None:
    """amxopt.linear (+ fused activation or residual) against aten.linear + the activation (or the
    add), at this node's shapes; on the amx tier, in the faster of its GEMM schedules."""
    if released_source(match["weight"]):
        return None
    xv, wv, bv = val(match["x"]), val(match["weight"]), val(match["bias"])
    x = _rows(_autotune.meta(xv))  # described without data: the random inputs are made only to time
    rows, k, n = x.numel() // x.shape[-1], x.shape[-1], _autotune.concrete(wv.shape)[0]
    op = f"linear [{_autotune.describe(x, wv, bv)}] {'+ residual' if residual else activation}"

    @functools.cache
    def real():
        """amxopt's run by schedule, and ATen's run, on random inputs."""
        x = _rows(_autotune.materialize(xv))
        w, b = _autotune.materialize(wv, scale=k**-0.5), _autotune.materialize(bv)
        packed = torch.ops.amxopt.pack_linear_weight(w, config.provider)
        r = _autotune.materialize(val(_residual(match))).reshape(*x.shape[:-1], n) if residual else None
        act = None if residual else reference.ACTIVATIONS[activation]

        def run_aten():
            y = torch.nn.functional.linear(x, w, b)
            return y + r if residual else act(y)

        extra = {"residual": r} if residual else {}
        amxopt = functools.partial(torch.ops.amxopt.linear, x, packed, b, activation, n, config.provider, **extra)
        return lambda schedule: functools.partial(amxopt, amx_schedule=schedule), run_aten

    # Only a VNNI-packed (bf16) weight runs the tile GEMM: an fp32 Linear runs alike in both schedules.
    vnni = len(packed_linear_shape(n, k, wv.dtype, config.provider)) == 3
    order = _autotune.amx_schedule(op, config, rows, k, lambda s: real()[0](s)) if vnni else None
    schedule = "rows" if order and order.choice == "rows" else "default"
    named = f"{op}, AMX rows schedule" if schedule == "rows" else op
    return _autotune.compare(named, config, lambda: (real()[0](schedule), real()[1]), order)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x's rows as one matrix (one key for every batch shape), unless x is a view that flattening
    would copy (a transpose): the kernels on both sides then see the strides the graph gives them."""
    return x[None] if x.dim() == 1 else x.flatten(0, -2) if x.is_contiguous() else x


def _rule(activation: str, pattern, when: str | None) -> Rule:
    return Rule(
        name="aten.linear",
        kind="linear",
        pattern=pattern,
        replacement=linear_replacement,
        inputs=("x", "weight", "bias"),
        options=lambda match, config: {"activation": activation, "provider": config.provider},
        guard=_refusal,
        timing=functools.partial(_timing, activation, False),
        when=when,
    )


def _residual_rule(linear_first: bool, own_input: bool) -> Rule:
    return Rule(
        name="aten.linear + add",
        kind="linear",
        pattern=_residual_pattern(linear_first, own_input),
        replacement=linear_residual_replacement,
        inputs=("x", "weight", "bias", "x" if own_input else "residual"),
        options=lambda match, config: {"activation": "none", "provider": config.provider},
        applies=_residual_applies,
        guard=_refusal,
        timing=functools.partial(_timing, "none", True),
        when="fuse_residual",
    )


@functools.cache
def rules() -> tuple[Rule, ...]:
    residual = tuple(_residual_rule(first, own) for first in (True, False) for own in (True, False))
    fused = tuple(_rule(a.activation, _activation_pattern(a), "fuse_activation") for a in ACTIVATION_RULES)
    return (*residual, *fused, _rule("none", _linear, None))
