"""Rules: the elementwise glue between Wan's GEMMs -> ``amxopt.norm_modulate``, ``gated_residual``,
``rotary_embedding``.

Once the GEMMs are fast these chains dominate what is left: each is 4 to 14 ATen ops with fp32
intermediates written to memory, and each becomes one pass over the activations. The patterns are
diffusers' ``WanTransformerBlock`` and ``WanAttnProcessor`` as export records them:

* modulate: ``(norm(x.float()) * (1 + scale) + shift).type_as(x)`` (LayerNorm or RMSNorm, with or
  without weights; the norm is ``FP32LayerNorm`` in Wan);
* gated residual: ``(x.float() + y * gate).type_as(x)``, and ``(x.float() + y.float() * gate).type_as(x)``;
* rotary: ``apply_rotary_emb``'s interleaved pairs, ``x1 * cos - x2 * sin`` and ``x1 * sin + x2 * cos``
  written into an ``empty_like`` through strided slices;
* rotate_half: ``(x.float() * cos + cat(-x2, x1) * sin).to(x.dtype)`` with ``x1, x2`` the halves of
  the last dim, transformers' ``apply_rotary_pos_emb_vision`` (Qwen3-VL's vision blocks: 14 ATen
  ops for q and k together, each an fp32 pass over them), cos / sin D wide.

Refusals: dtypes without a kernel, a ``y`` of another shape or dtype than ``x``, an operand that does
not broadcast to ``x`` along its last dim (a per-channel operand is the only kind the kernels read),
norms over more than the last dim, a rotate_half whose halves are not the last dim's or whose result
is not in ``x``'s dtype.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amxopt.passes import _autotune
from amxopt.passes._graph import dtype_of, val
from amxopt.patterns import (
    CASTS,
    DTYPES,
    Match,
    Rule,
    gated_residual_replacement,
    layer_norm_modulate_replacement,
    normalizes_last_dim,
    rms_eps,
    rms_norm_modulate_replacement,
    rotary_replacement,
    rotate_half_replacement,
    upcast_extent,
    upcast_of,
)

aten = torch.ops.aten
_END = sys.maxsize  # export's open slice end


def _modulated(y, x, scale, shift, back):
    # FP32LayerNorm casts its output back to its input's dtype: fp32 again, a node export keeps.
    y = back(y, torch.float32) if back is not None else y
    return aten.type_as.default(aten.add.Tensor(aten.mul.Tensor(y, aten.add.Tensor(scale, 1)), shift), x)


# The norm reads ``xf``: ``x`` cast up to fp32 once or more (Wan's block casts, then FP32LayerNorm
# casts again); ``_upcast_of`` checks that chain, so the patterns need not spell each length. Where
# the casts are no-ops (an fp32 model) export keeps one node for both: the ``x``-only patterns.
def _modulate_layer_norm(back, upcast: bool):
    def pattern(xf, x, shape, weight, bias, eps, cudnn, scale, shift):
        return _modulated(aten.layer_norm.default(xf, shape, weight, bias, eps, cudnn), x, scale, shift, back)

    def direct(x, shape, weight, bias, eps, cudnn, scale, shift):
        return _modulated(aten.layer_norm.default(x, shape, weight, bias, eps, cudnn), x, scale, shift, back)

    return pattern if upcast else direct


def _modulate_rms_norm(back, upcast: bool):
    def pattern(xf, x, shape, weight, eps, scale, shift):
        return _modulated(aten.rms_norm.default(xf, shape, weight, eps), x, scale, shift, back)

    def direct(x, shape, weight, eps, scale, shift):
        return _modulated(aten.rms_norm.default(x, shape, weight, eps), x, scale, shift, back)

    return pattern if upcast else direct


def _upcast_of(match: Match, config) -> bool:
    return "xf" not in match.values or upcast_of(match["xf"], match["x"])


def _gated_residual(x_cast, y_cast):
    # Each operand's cast to fp32 is optional: export drops it where the tensor is fp32 already.
    def up(cast, t):
        return cast(t, torch.float32) if cast is not None else t

    def pattern(x, y, gate):
        return aten.type_as.default(aten.add.Tensor(up(x_cast, x), aten.mul.Tensor(up(y_cast, y), gate)), x)

    return pattern


def _rotary_interleaved(x, freqs_cos, freqs_sin, dim):
    # diffusers' WanAttnProcessor.apply_rotary_emb; ``dim`` is the last dim, as export normalizes it.
    pairs = aten.unbind.int(aten.unflatten.int(x, -1, [-1, 2]), -1)
    x1, x2 = pairs[0], pairs[1]
    cos = aten.slice.Tensor(freqs_cos, dim, 0, _END, 2)
    sin = aten.slice.Tensor(freqs_sin, dim, 1, _END, 2)
    out = aten.empty_like.default(x, pin_memory=False)
    even = aten.copy_.default(
        aten.slice.Tensor(out, dim, 0, _END, 2), aten.sub.Tensor(aten.mul.Tensor(x1, cos), aten.mul.Tensor(x2, sin))
    )
    odd = aten.copy_.default(
        aten.slice.Tensor(out, dim, 1, _END, 2), aten.add.Tensor(aten.mul.Tensor(x1, sin), aten.mul.Tensor(x2, cos))
    )
    # The copies are outputs too, so that the match holds them (nothing else reads them).
    return aten.type_as.default(out, x), even, odd


def _rotate_half(x_cast, back):
    # transformers' rotate_half rotary: ``x.float()`` (absent for fp32 x), the halves of the last dim
    # (``dim``, ``start``, ``half``, ``end`` bound here and checked by the guard: export writes the
    # slices as (0, half), (half, maxsize) or, with a symbolic half, (None, half), (half, None)), the
    # sum cast back (absent likewise).
    def rotated(x, cos, sin, dim, start, half, end):
        xf = x_cast(x, torch.float32) if x_cast is not None else x
        x1 = aten.slice.Tensor(xf, dim, start, half)
        x2 = aten.slice.Tensor(xf, dim, half, end)
        turned = aten.cat.default([aten.neg.default(x2), x1], -1)
        return aten.add.Tensor(aten.mul.Tensor(xf, cos), aten.mul.Tensor(turned, sin))

    def cast_back(x, cos, sin, dim, start, half, end, dtype):
        return back(rotated(x, cos, sin, dim, start, half, end), dtype)

    return rotated if back is None else cast_back


# --- guards -------------------------------------------------------------------------------------------


def _broadcasts(p, x, width) -> bool:
    """``p`` broadcasts to ``x``'s leading dims with ``width`` as its own last dim, for every size of
    a dynamic capture (sizes are compared symbolically)."""
    pv, xv = val(p), val(x)
    if not isinstance(pv, torch.Tensor) or not 1 <= pv.dim() <= xv.dim():
        return False
    if not statically_known_true(pv.shape[-1] == width):
        return False
    return all(
        statically_known_true(a == 1) or statically_known_true(a == b)
        for a, b in zip(reversed(pv.shape[:-1]), reversed(xv.shape[:-1]))
    )


def _shape(p) -> str:
    v = val(p)
    return str(tuple(v.shape)) if isinstance(v, torch.Tensor) else repr(p)


def _dtype_refusal(match: Match, operands: tuple[str, ...]) -> str | None:
    for name in operands:
        if match[name] is not None and not isinstance(val(match[name]), torch.Tensor):
            return f"{name} is {match[name]!r}, not a tensor (the op reads a tensor)"
    dtypes = {name: dtype_of(match[name]) for name in ("x", *operands) if match[name] is not None}
    if any(d not in DTYPES for d in dtypes.values()):
        return f"dtypes {dtypes} have no kernel (fp32 or bf16 only)"
    return None


def _broadcast_refusal(match: Match, operands: tuple[str, ...], width) -> str | None:
    for name in operands:
        if not _broadcasts(match[name], match["x"], width):
            return f"{name} {_shape(match[name])} does not broadcast along the last dim to x {_shape(match['x'])}"
    return None


def _modulate_refusal(match: Match) -> str | None:
    x, shape = match["x"], match["shape"]
    d = val(x).shape[-1]
    if not normalizes_last_dim(shape, x):
        return f"normalizes over {list(shape)}, not just the last dim of {_shape(x)}"
    params = tuple(p for p in ("weight", "bias") if p in match.values)
    return _dtype_refusal(match, (*params, "scale", "shift")) or _broadcast_refusal(match, ("scale", "shift"), d)


def _residual_refusal(match: Match) -> str | None:
    x, y = val(match["x"]), val(match["y"])
    if (
        y.dtype != x.dtype
        or y.dim() != x.dim()
        or not all(statically_known_true(a == b) for a, b in zip(y.shape, x.shape))
    ):
        return (
            f"y {y.dtype} {tuple(y.shape)} differs from x {x.dtype} {tuple(x.shape)} (the sum would broadcast or cast)"
        )
    return _dtype_refusal(match, ("gate",)) or _broadcast_refusal(match, ("gate",), x.shape[-1])


def _rotary_refusal(match: Match) -> str | None:
    xv = val(match["x"])
    if match["dim"] != xv.dim() - 1:
        return f"slices dim {match['dim']}, not the last of x {tuple(xv.shape)}"
    reason = _dtype_refusal(match, ("freqs_cos", "freqs_sin"))
    return reason or _broadcast_refusal(match, ("freqs_cos", "freqs_sin"), xv.shape[-1])


def _rotate_half_refusal(match: Match) -> str | None:
    xv = val(match["x"])
    out = dtype_of(match.out)
    if out != xv.dtype:
        return f"gives {out} for x {xv.dtype} (the op returns x's dtype)"
    d = xv.shape[-1]
    half = val(match["half"]) if hasattr(match["half"], "meta") else match["half"]  # an int or a SymInt node
    halves = (
        match["dim"] in (-1, xv.dim() - 1)
        and match["start"] in (None, 0)
        and match["end"] in (None, _END)
        and isinstance(half, (int, torch.SymInt))
        and statically_known_true(2 * half == d)
    )
    if not halves:
        return (
            f"slices x {tuple(xv.shape)} along dim {match['dim']} at ({match['start']}, {half}) and ({half}, "
            f"{match['end']}), not provably into the last dim's halves"
        )
    reason = _dtype_refusal(match, ("cos", "sin"))
    return reason or _broadcast_refusal(match, ("cos", "sin"), d)


# --- timing: the amxopt op against the matched ATen ops themselves ----------------------------------


def _timing(kind: str, pattern, match: Match, fn, config) -> _autotune.Timing | None:
    def setup():
        real = {name: _autotune.materialize(val(v)) for name, v in match.values.items()}
        args = [real[name] for name in _INPUTS[kind]]
        return lambda: fn(*args), lambda: pattern(**real)

    tensors = [val(v) for v in match.values.values() if isinstance(val(v), torch.Tensor)]
    return _autotune.compare(f"{kind} [{_autotune.describe(*tensors)}]", config, setup)


# --- the rules ------------------------------------------------------------------------------------------

_INPUTS = {
    "modulate layer_norm": ("x", "weight", "bias", "scale", "shift"),
    "modulate rms_norm": ("x", "weight", "scale", "shift"),
    "residual": ("x", "y", "gate"),
    "rotary": ("x", "freqs_cos", "freqs_sin"),
    "rotate_half": ("x", "cos", "sin"),
}


def _modulate_options(match: Match, config) -> dict:
    return {"eps": rms_eps(match["eps"]), "provider": config.provider}


def _rule(name, kind, inputs_key, pattern, replacement, guard, root, options=None, applies=None, extent=None) -> Rule:
    return Rule(
        name=name,
        kind=kind,
        pattern=pattern,
        replacement=replacement,
        inputs=_INPUTS[inputs_key],
        options=options or (lambda match, config: {"provider": config.provider}),
        guard=guard,
        timing=functools.partial(_timing, inputs_key, pattern),
        root=root,
        applies=applies or (lambda match, config: True),
        extent=extent or (lambda match: []),
    )


def _over_casts(name, kind, inputs_key, make, replacement, guard, root) -> tuple[Rule, ...]:
    """One rule per pair of optional casts, ``make(outer, inner)`` building each pattern; a cast is one
    of ``CASTS`` or absent (``None``), so the patterns with both casts, the longer ones, come first."""
    return tuple(
        _rule(name, kind, inputs_key, make(outer, inner), replacement, guard, root)
        for outer in (*CASTS, None)
        for inner in (*CASTS, None)
    )


_MODULATED = {
    "layer_norm": (_modulate_layer_norm, layer_norm_modulate_replacement, aten.layer_norm.default),
    "rms_norm": (_modulate_rms_norm, rms_norm_modulate_replacement, aten.rms_norm.default),
}


@functools.cache
def rules() -> tuple[Rule, ...]:
    modulate = tuple(
        _rule(
            f"aten.{norm} * (1 + scale) + shift",
            "modulate",
            f"modulate {norm}",
            make(back, upcast),
            replacement,
            _modulate_refusal,
            (norm_op,),
            _modulate_options,
            applies=_upcast_of,
            extent=upcast_extent,
        )
        for norm, (make, replacement, norm_op) in _MODULATED.items()
        for back in (*CASTS, None)  # with FP32LayerNorm's cast back first: the longer pattern
        for upcast in (True, False)
    )
    # y's own cast, then x's.
    residual = _over_casts(
        "x + y * gate",
        "residual",
        "residual",
        lambda y_cast, x_cast: _gated_residual(x_cast, y_cast),
        gated_residual_replacement,
        _residual_refusal,
        (aten.add.Tensor,),
    )
    rotary = _rule(
        "interleaved rotary (x1 cos - x2 sin, x1 sin + x2 cos)",
        "rotary",
        "rotary",
        _rotary_interleaved,
        rotary_replacement,
        _rotary_refusal,
        (aten.empty_like.default,),
    )
    # The cast back, then x's.
    rotate_half = _over_casts(
        "rotate_half rotary (x cos + cat(-x2, x1) sin)",
        "rotary",
        "rotate_half",
        lambda back, x_cast: _rotate_half(x_cast, back),
        rotate_half_replacement,
        _rotate_half_refusal,
        (aten.cat.default,),
    )
    return (*modulate, *residual, rotary, *rotate_half)
