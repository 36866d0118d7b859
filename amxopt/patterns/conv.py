"""Rules for convolutions: patch embeddings (Conv3d, and Conv2d, with kernel == stride) ->
``amxopt.patch_embed``; any other Conv2d with a constant weight -> ``amxopt.conv2d``, with a
following gelu / gelu_tanh / silu fused into it where that is the conv's only user (with
``AmxConfig.fuse_activation``; the Qwen3-Omni audio encoder's three conv + gelu pairs).

One rule per (op overload, replacement) from one table. A patch embedding refuses a weight computed
in the graph, dtypes without a kernel, stride != kernel, padding, dilation or groups; an input whose
spatial sizes are not provably multiples of the kernel is cropped to them, as the convolution reads
it. ``amxopt.conv2d`` refuses computed weights, dtypes without a kernel, string padding and inputs
that are not ``[B, C, H, W]``.
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amxopt.ops import reference
from amxopt.passes import _autotune
from amxopt.passes._graph import dtype_of, not_constant, op_name, released_source, val
from amxopt.patterns import (
    ACTIVATION_RULES,
    DTYPES,
    ActivationRule,
    Match,
    Rule,
    conv2d_replacement,
    crop_to_kernel,
    patch_embed_2d_replacement,
    patch_embed_replacement,
)

aten = torch.ops.aten


def _conv_pattern(target):
    def pattern(x, weight, bias, stride, padding, dilation, groups):
        return target(x, weight, bias, stride, padding, dilation, groups)

    return pattern


def _expand(v, dims: int) -> list:
    return list(v) * dims if len(v) == 1 else list(v)


def _weight_refusal(match: Match) -> str | None:
    x, w = match["x"], match["weight"]
    if (refusal := not_constant(w, "weight")) is not None:
        return refusal
    if dtype_of(x) not in DTYPES or dtype_of(w) != dtype_of(x):
        return f"dtypes x={dtype_of(x)} weight={dtype_of(w)} have no kernel"
    return None


# --- patch embedding -------------------------------------------------------------------------------


def _patch_refusal(dims: int, match: Match) -> str | None:
    reason = _weight_refusal(match)
    if reason:
        return reason
    kernel = list(val(match["weight"]).shape[2:])
    stride, padding = _expand(match["stride"], dims), match["padding"]
    dilation, groups = _expand(match["dilation"], dims), match["groups"]
    if stride != kernel:
        return f"stride {stride} != kernel {kernel} (not a patch embedding)"
    if isinstance(padding, str) and padding != "valid" or not isinstance(padding, str) and any(padding):
        return f"padding {padding}"
    if any(d != 1 for d in dilation) or groups != 1:
        return f"dilation {dilation} / groups {groups}"
    xv = val(match["x"])
    if xv.dim() != dims + 2:
        return f"input is {xv.dim()}-D, expected {'[B, C, T, H, W]' if dims == 3 else '[B, C, H, W]'}"
    return None


def _patch_options(match: Match, config) -> dict:
    """An input size not provably a multiple of the kernel (a dynamic SigLIP image) is cropped to
    one first, as the convolution leaves the remainder out."""
    xv, kernel = val(match["x"]), val(match["weight"]).shape[2:]
    divisible = all(statically_known_true(d % k == 0) for d, k in zip(xv.shape[2:], kernel))
    return {"provider": config.provider, "crop": not divisible}


def _patch_timing(conv, match: Match, fn, config) -> _autotune.Timing | None:
    """amxopt.patch_embed (weight packed once, as after pack_weights) against the ATen convolution."""
    if released_source(match["weight"]):
        return None
    xv, wv, bv = val(match["x"]), val(match["weight"]), val(match["bias"])

    def setup():
        x, w, b = _autotune.materialize(xv), _autotune.materialize(wv, scale=0.05), _autotune.materialize(bv)
        out_channels = w.shape[0]
        packed = torch.ops.amxopt.pack_linear_weight(w.reshape(out_channels, -1), config.provider)
        kernel = [1, *w.shape[2:]] if w.dim() == 4 else list(w.shape[2:])

        def run():
            cropped = crop_to_kernel(x, list(w.shape[2:]))  # as the replacement does where sizes are not multiples
            x5 = cropped.unsqueeze(2) if w.dim() == 4 else cropped
            y = torch.ops.amxopt.patch_embed(x5, packed, b, kernel, out_channels, config.provider)
            return y.squeeze(2) if w.dim() == 4 else y

        return run, lambda: conv(x, w, b, stride=list(w.shape[2:]))

    return _autotune.compare(f"patch_embed [{_autotune.describe(xv, wv, bv)}]", config, setup)


# target -> (spatial dims, the ATen convolution autotune times against, replacement)
_PATCH_CONVS = {
    aten.conv3d.default: (3, torch.nn.functional.conv3d, patch_embed_replacement),
    aten.conv3d.padding: (3, torch.nn.functional.conv3d, patch_embed_replacement),
    aten.conv2d.default: (2, torch.nn.functional.conv2d, patch_embed_2d_replacement),
    aten.conv2d.padding: (2, torch.nn.functional.conv2d, patch_embed_2d_replacement),
}


@functools.cache
def patch_embed_rules() -> tuple[Rule, ...]:
    return tuple(
        Rule(
            name=op_name(target).removesuffix(".default"),
            kind="patch_embed" if dims == 3 else "conv2d",
            pattern=_conv_pattern(target),
            replacement=replacement,
            inputs=("x", "weight", "bias"),
            options=_patch_options,
            guard=functools.partial(_patch_refusal, dims),
            timing=functools.partial(_patch_timing, conv),
        )
        for target, (dims, conv, replacement) in _PATCH_CONVS.items()
    )


# --- any other conv2d ------------------------------------------------------------------------------


def _conv2d_params(match: Match) -> dict:
    return dict(
        stride=_expand(match["stride"], 2),
        padding=_expand(match["padding"], 2),
        dilation=_expand(match["dilation"], 2),
        groups=match["groups"],
    )


def _conv2d_refusal(match: Match) -> str | None:
    reason = _weight_refusal(match)
    if reason:
        return reason
    if isinstance(match["padding"], str):
        return f"string padding {match['padding']!r}"
    if val(match["x"]).dim() != 4:
        return f"input is {val(match['x']).dim()}-D, expected [B, C, H, W]"
    return None


def _conv2d_timing(activation: str, match: Match, fn, config) -> _autotune.Timing | None:
    """amxopt.conv2d (+ fused activation) against aten.conv2d + the activation, at this node's shapes."""
    xv, wv, bv = val(match["x"]), val(match["weight"]), val(match["bias"])
    params = _conv2d_params(match)
    act = reference.ACTIVATIONS[activation]

    def setup():
        x, w, b = (_autotune.materialize(v) for v in (xv, wv, bv))
        return lambda: fn(x, w, b), lambda: act(torch.nn.functional.conv2d(x, w, b, **params))

    return _autotune.compare(f"conv2d [{_autotune.describe(xv, wv, bv)}] {params} {activation}", config, setup)


def _conv2d_activation_pattern(target, act: ActivationRule):
    def pattern(x, weight, bias, stride, padding, dilation, groups):
        return act(target(x, weight, bias, stride, padding, dilation, groups))

    return pattern


def _conv2d_rule(activation: str, pattern, when: str | None) -> Rule:
    return Rule(
        name="aten.conv2d",
        kind="conv2d",
        pattern=pattern,
        replacement=conv2d_replacement,
        inputs=("x", "weight", "bias"),
        options=lambda match, config: {
            **_conv2d_params(match),
            "activation": activation,
            "provider": config.provider,
        },
        guard=_conv2d_refusal,
        timing=functools.partial(_conv2d_timing, activation),
        when=when,
    )


@functools.cache
def conv2d_rules() -> tuple[Rule, ...]:
    targets = (aten.conv2d.default, aten.conv2d.padding)
    fused = tuple(
        _conv2d_rule(a.activation, _conv2d_activation_pattern(t, a), "fuse_activation")
        for t in targets
        for a in ACTIVATION_RULES
    )
    return (*fused, *(_conv2d_rule("none", _conv_pattern(t), None) for t in targets))
