"""Rewrite rules as data, the replacement functions they point to, and the shared vocabulary.

A :class:`Rule` names an aten-level *pattern* (a function whose parameters are wildcards, traced
once into an fx graph and matched by torch.fx's ``SubgraphMatcher``), a *guard* that reads the
match and returns why it refuses (reported) or ``None``, and a *replacement* taking the matched
tensors (everything else is bound from ``options`` with ``functools.partial``), traced by
``amxopt.passes._graph.insert_traced`` on the matched nodes' fake values so its output shapes stay
symbolic where the capture was dynamic. ``amxopt/passes/_rewrite.py`` applies a list of rules; a
pass is such a list. The rule tables live in this package's modules (``linear``, ``norms``);
nothing here touches a graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amxopt.ops.library import DTYPES  # noqa: F401 - the rule tables' dtypes, re-exported

aten = torch.ops.aten
amx = torch.ops.amxopt


@dataclasses.dataclass(frozen=True)
class Match:
    """One match of a rule: each pattern parameter's value (a node or a literal), the node of the
    rule's kind (``root``: it carries the report's notes) and the node whose value is replaced."""

    values: dict[str, Any]
    root: Any
    out: Any

    def __getitem__(self, name: str) -> Any:
        return self.values[name]


@dataclasses.dataclass(frozen=True)
class Rule:
    """One rewrite: ``pattern`` -> ``replacement``, applied when ``guard`` finds nothing to refuse.

    Args:
        name: what the replaced nodes were, as the report says it (``aten.linear + gelu``).
        kind: the report's kind (a key of ``KIND_TARGETS``); the matched node of that kind is the root.
        pattern: aten-level function; its parameters are the wildcards (nodes or literals).
        replacement: takes the tensors named by ``inputs`` plus the keyword ``options``.
        inputs: the pattern parameters passed to ``replacement``, in order.
        options: ``(match, config) -> dict`` of keyword arguments for ``replacement``.
        applies: ``(match, config) -> bool``: whether this rule is the one for the match at all
            (a silent filter, e.g. an upcast window whose down-cast is to another dtype, after which
            a shorter rule may match the same nodes; or a node already in the wanted form).
        guard: ``match -> reason`` to refuse (left as ATen, with the reason), or ``None``.
        timing: ``(match, fn, config) -> Timing | None``: the autotune comparison (None: not timed).
        when: name of a boolean ``AmxConfig`` field that must be set for the rule to apply.
        root: the aten ops of the pattern that mark its root, for kinds with no aten op of their own
            (the glue's ``add``, ``empty_like``); default: the kind's ``KIND_TARGETS``.
        aliases: ``(name, same_as)`` pairs: a name the guard, options and inputs read, bound to the
            same value as the pattern parameter ``same_as`` (a variant of a pattern that takes one
            tensor twice, such as ``sdpa(x, x, x)``: torch.fx's matcher binds distinct wildcards
            to distinct nodes only).
        extent: ``match -> nodes`` outside the pattern that the replacement stands for too: where the
            pattern reads a cast of ``x`` and the replacement reads ``x`` itself, the casts (an
            in-place write after the first of them changes what the replacement reads).
    """

    name: str
    kind: str
    pattern: Callable
    replacement: Callable
    inputs: tuple[str, ...]
    options: Callable[[Match, Any], dict] = lambda match, config: {}
    applies: Callable[[Match, Any], bool] = lambda match, config: True
    guard: Callable[[Match], str | None] = lambda match: None
    timing: Callable | None = None
    when: str | None = None
    root: tuple = ()
    aliases: tuple[tuple[str, str], ...] = ()
    extent: Callable[[Match], list] = lambda match: []


@dataclasses.dataclass(frozen=True)
class ActivationRule:
    """An elementwise op that ``amxopt.linear`` and ``amxopt.conv2d`` can fuse into their output."""

    target: object
    activation: str
    approximate: str | None = None  # gelu's ``approximate`` kwarg that this rule matches

    def __call__(self, y):
        """The activation of y as a pattern spells it."""
        return self.target(y, **({"approximate": self.approximate} if self.approximate is not None else {}))


ACTIVATION_RULES = (
    ActivationRule(aten.gelu.default, "gelu", "none"),
    ActivationRule(aten.gelu.default, "gelu_tanh", "tanh"),
    ActivationRule(aten.silu.default, "silu"),
)

# Kinds of node amxopt replaces, and the aten ops of each kind a captured graph may hold.
KIND_TARGETS = {
    "linear": (aten.linear.default,),
    "attention": (aten.scaled_dot_product_attention.default,),
    "patch_embed": (aten.conv3d.default, aten.conv3d.padding),
    "conv2d": (aten.conv2d.default, aten.conv2d.padding),
    "layer_norm": (aten.layer_norm.default,),
    "rms_norm": (aten.rms_norm.default,),
    # Glue (amxopt/patterns/glue.py): chains of elementwise ops; none of their aten ops is one of
    # these kinds by itself (an add is not a residual): a chain a rule matched and kept is counted as
    # left by its root (the pass marks it).
    "modulate": (),
    "residual": (),
    "rotary": (),
}
AMX_KINDS = {
    amx.linear.default: "linear",
    amx.varlen_attention.default: "attention",
    amx.patch_embed.default: "patch_embed",
    amx.conv2d.default: "conv2d",
    amx.layer_norm.default: "layer_norm",
    amx.rms_norm.default: "rms_norm",
    amx.norm_modulate.default: "modulate",
    amx.gated_residual.default: "residual",
    amx.rotary_embedding.default: "rotary",
}


def _to_dtype(x, dtype):
    return aten.to.dtype(x, dtype)


def _to_copy(x, dtype):
    return aten._to_copy.default(x, dtype=dtype)


# The two ways export records a cast, as pattern pieces (one rule per form), and as targets.
CASTS = (_to_dtype, _to_copy)
_FP32_CASTS = (aten.to.dtype, aten._to_copy.default)


def upcast_chain(xf: Any, x: Any) -> list | None:
    """The casts from ``x`` to ``xf`` (empty where ``xf`` is ``x``), if ``xf`` is ``x`` cast to fp32
    once or more (each cast exact: to fp32 only); else None.

    Wan casts a block's input up, then ``FP32LayerNorm`` casts it again: a pattern binds the norm's
    input and ``x`` to two wildcards and checks the chain here, rather than spelling each length.
    """
    chain = []
    while xf is not x:
        if getattr(xf, "op", None) != "call_function" or xf.target not in _FP32_CASTS:
            return None
        if getattr(xf.meta.get("val"), "dtype", None) != torch.float32:
            return None
        chain.append(xf)
        xf = xf.args[0]
    return chain


def upcast_of(xf: Any, x: Any) -> bool:
    return upcast_chain(xf, x) is not None


def upcast_extent(match: Match) -> list:
    """A rule's ``extent`` where the pattern reads ``xf``, a cast of ``x``, and the replacement ``x``."""
    return (upcast_chain(match["xf"], match["x"]) or []) if "xf" in match.values else []


def normalizes_last_dim(shape: Any, x: Any) -> bool:
    """A norm's ``normalized_shape`` is ``x``'s last dim alone (a size may be a symbolic node)."""
    if len(shape) != 1:
        return False
    size = shape[0].meta.get("val") if hasattr(shape[0], "meta") else shape[0]
    return statically_known_true(size == x.meta["val"].shape[-1])


def rms_eps(eps: float | None) -> float:
    """An rms_norm's epsilon; ``None`` is aten's default, the epsilon of its accumulation type (fp32
    for bf16 input too: bf16's own epsilon, 0.0078, would be a different norm)."""
    return float(torch.finfo(torch.float32).eps if eps is None else eps)


def _schedule(amx_schedule: str) -> dict:
    """linear's amx_schedule where autotune chose one (a graph without a choice reads as before)."""
    return {} if amx_schedule == "default" else {"amx_schedule": amx_schedule}


def linear_replacement(x, weight, bias, *, activation: str, provider: str, amx_schedule: str = "default"):
    packed = amx.pack_linear_weight(weight, provider)
    return amx.linear(x, packed, bias, activation, weight.shape[0], provider, **_schedule(amx_schedule))


def linear_residual_replacement(
    x, weight, bias, residual, *, activation: str, provider: str, amx_schedule: str = "default"
):
    packed = amx.pack_linear_weight(weight, provider)
    return amx.linear(
        x, packed, bias, activation, weight.shape[0], provider, residual=residual, **_schedule(amx_schedule)
    )


def sdpa_replacement(q, k, v, *, scale: float | None, causal: bool, provider: str):
    """``[B, H, S, D]`` dense attention as varlen attention over B equal segments."""
    b, h, s, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    qp = q.transpose(1, 2).reshape(b * s, h, d)
    kp = k.transpose(1, 2).reshape(b * sk, hk, d)
    vp = v.transpose(1, 2).reshape(b * sk, hk, v.shape[3])
    steps = torch.arange(b + 1, dtype=torch.int32, device=q.device)
    out = amx.varlen_attention(
        qp, kp, vp, steps * s, steps * sk, s, sk, d**-0.5 if scale is None else scale, causal, provider
    )
    return out.reshape(b, s, h, v.shape[3]).transpose(1, 2)


def patch_embed_replacement(x, weight, bias, *, provider: str, crop: bool = False):
    """``crop``: cut each spatial size down to a multiple of the kernel (what a convolution with
    stride == kernel reads), for sizes not known to be one."""
    out_channels, kernel = weight.shape[0], list(weight.shape[2:])
    if crop:
        x = crop_to_kernel(x, kernel)
    packed = amx.pack_linear_weight(weight.reshape(out_channels, -1), provider)
    return amx.patch_embed(x, packed, bias, kernel, out_channels, provider)


def crop_to_kernel(x, kernel: list):
    """``x``'s last ``len(kernel)`` sizes cut down to multiples of ``kernel`` (a view)."""
    return x[(..., *(slice(0, size // k * k) for size, k in zip(x.shape[-len(kernel) :], kernel)))]


def patch_embed_2d_replacement(x, weight, bias, *, provider: str, crop: bool = False):
    """Conv2d patch embedding (CLIP, SigLIP) as the Conv3d one over a time axis of one."""
    x, weight = x.unsqueeze(2), weight.unsqueeze(2)
    return patch_embed_replacement(x, weight, bias, provider=provider, crop=crop).squeeze(2)


def conv2d_replacement(x, weight, bias, *, stride, padding, dilation, groups, activation: str, provider: str):
    return amx.conv2d(x, weight, bias, stride, padding, dilation, groups, activation, provider)


def layer_norm_replacement(x, weight, bias, *, eps: float, provider: str):
    return amx.layer_norm(x, weight, bias, eps, provider)


def rms_norm_replacement(x, weight, *, eps: float, provider: str):
    return amx.rms_norm(x, weight, eps, provider)


def layer_norm_modulate_replacement(x, weight, bias, scale, shift, *, eps: float, provider: str):
    return amx.norm_modulate(x, weight, bias, scale, shift, eps, False, provider)


def rms_norm_modulate_replacement(x, weight, scale, shift, *, eps: float, provider: str):
    return amx.norm_modulate(x, weight, None, scale, shift, eps, True, provider)


def gated_residual_replacement(x, y, gate, *, provider: str):
    return amx.gated_residual(x, y, gate, provider)


def rotate_half_replacement(x, cos, sin, *, provider: str):
    """rotate_half's ``x * cos + rotate_half(x) * sin`` with D-wide cos / sin (Qwen3-VL's vision rotary):
    the op reads the first half's factors, then the second half's."""
    return amx.rotary_embedding(x, cos, sin, False, provider)


def rotary_replacement(x, freqs_cos, freqs_sin, *, provider: str):
    """Wan's interleaved rotary: pair i turns by the angle whose cos is ``freqs_cos[..., 2i]`` and sin
    ``freqs_sin[..., 2i + 1]`` (diffusers stores each angle twice, and reads them so)."""
    return amx.rotary_embedding(x, freqs_cos[..., 0::2], freqs_sin[..., 1::2], True, provider)
