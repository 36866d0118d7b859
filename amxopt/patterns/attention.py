"""Rules for attention: dense SDPA -> ``amxopt.varlen_attention`` over equal segments, and the
adapter-routed ``amxopt.varlen_attention`` (captured with the reference provider) re-targeted to
the configured provider.

SDPA refuses attention masks, dropout > 0, inputs that are not ``[B, H, S, D]``, dtypes without a
kernel, GQA without ``enable_gqa``, and causal attention between query/key lengths that may differ
(SDPA aligns that mask top-left, varlen kernels bottom-right).
"""

from __future__ import annotations

import functools

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amxopt.passes import _autotune
from amxopt.passes._graph import dtype_of, hint, val
from amxopt.patterns import DTYPES, Match, Rule, sdpa_replacement

aten = torch.ops.aten
amx = torch.ops.amxopt

ADAPTER_ROUTED = "adapter-routed varlen attention"


def _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return aten.scaled_dot_product_attention.default(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
    )


# One tensor passed twice or thrice (sdpa(x, x, x)), as the matcher needs it spelled: each with
# the aliases that name the parameters it stands for.
def _sdpa_qkv_one(q, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _sdpa(q, q, q, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa_kv_one(q, k, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _sdpa(q, k, k, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa_qk_one(q, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _sdpa(q, q, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


def _sdpa_qv_one(q, k, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    return _sdpa(q, k, q, attn_mask, dropout_p, is_causal, scale, enable_gqa)


_SDPA_PATTERNS = (
    (_sdpa, ()),
    (_sdpa_qkv_one, (("k", "q"), ("v", "q"))),
    (_sdpa_kv_one, (("v", "k"),)),
    (_sdpa_qk_one, (("k", "q"),)),
    (_sdpa_qv_one, (("v", "q"),)),
)


def _sdpa_refusal(match: Match) -> str | None:
    q, k, v = (val(match[n]) for n in ("q", "k", "v"))
    if match["attn_mask"] is not None:
        # A padding mask, or an additive bias such as UMT5's relative positions: no amxopt op takes one yet.
        return "has an attention mask (amxopt.varlen_attention takes none; causal is a flag)"
    if match["dropout_p"] != 0.0:
        return f"dropout_p={match['dropout_p']}"
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return "q/k/v are not [B, H, S, D]"
    if dtype_of(match["q"]) not in DTYPES:
        return f"dtype {dtype_of(match['q'])} has no kernel"

    # Sizes equal in the example: separate dynamic inputs get separate symbols, and a later call
    # where they differ is refused by the op's own checks (k/v alike, bounds in range), never wrong.
    def same(a, b) -> bool:
        return statically_known_true(a == b) or (hint(a) is not None and hint(a) == hint(b))

    if not (same(q.shape[0], k.shape[0]) and same(k.shape[0], v.shape[0])):
        return f"q/k/v batches {q.shape[0]}/{k.shape[0]}/{v.shape[0]} may differ (SDPA broadcasts them)"
    if not (same(q.shape[3], k.shape[3]) and same(k.shape[3], v.shape[3]) and same(k.shape[2], v.shape[2])):
        return f"k {tuple(k.shape)} and v {tuple(v.shape)} are not alike (amxopt.varlen_attention needs one head dim)"
    if q.shape[1] != k.shape[1] and not match["enable_gqa"]:
        return "query and key head counts differ without enable_gqa"
    if not (same(k.shape[1], v.shape[1]) and same(q.shape[1] % k.shape[1], 0)):
        return f"head counts q {q.shape[1]}, k {k.shape[1]}, v {v.shape[1]} are not a grouping"
    if match["is_causal"] and not statically_known_true(q.shape[2] == k.shape[2]):
        return "causal with query/key lengths that may differ (SDPA aligns the mask top-left)"
    if match["scale"] is None and isinstance(q.shape[3], torch.SymInt):
        # The op takes its scale as a number: 1/sqrt(D) of the example would serve every head dim.
        # (Scaling q in the graph instead hid a rotary embedding from fuse_rotary.) A model's head
        # dim comes from its weights and is static.
        return f"no scale, and a head dim {q.shape[3]} that varies with the input (SDPA's default scale follows it)"
    return None


def _sdpa_timing(match: Match, fn, config) -> _autotune.Timing | None:
    """Dense attention: amxopt's varlen op against the aten SDPA call it replaces."""
    node = match.root

    def setup():
        q, k, v = (_autotune.materialize(val(match[n])) for n in ("q", "k", "v"))
        rest = [_autotune.materialize(val(a)) for a in node.args[3:]]
        kwargs = {n: _autotune.materialize(val(a)) for n, a in node.kwargs.items()}
        return lambda: fn(q, k, v), lambda: node.target(q, k, v, *rest, **kwargs)

    causal = " causal" if match["is_causal"] else ""
    qkv = (val(match[n]) for n in ("q", "k", "v"))
    return _autotune.compare(f"attention [{_autotune.describe(*qkv)}]{causal}", config, setup)


def _varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, provider):
    return amx.varlen_attention.default(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, provider)


def _varlen_self(q, k, v, cu_q, max_q, max_k, scale, causal, provider):
    # Self-attention passes one bounds tensor twice (the rule aliases cu_k to it).
    return amx.varlen_attention.default(q, k, v, cu_q, cu_q, max_q, max_k, scale, causal, provider)


def _retarget(q, k, v, cu_q, cu_k, *, max_q, max_k, scale, causal, provider):
    return amx.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, provider)


@functools.cache
def rules() -> tuple[Rule, ...]:
    # Adapter-routed attention replaces the model's per-segment Python loop: nothing to time.
    def retarget(pattern, aliases):
        return Rule(
            name=ADAPTER_ROUTED,
            kind="attention",
            pattern=pattern,
            replacement=_retarget,
            inputs=("q", "k", "v", "cu_q", "cu_k"),
            aliases=aliases,
            options=lambda match, config: {
                "max_q": match["max_q"],
                "max_k": match["max_k"],
                "scale": match["scale"],
                "causal": match["causal"],
                "provider": config.provider,
            },
            applies=lambda match, config: match["provider"] != config.provider,
        )

    def sdpa(pattern, aliases):
        return Rule(
            name="aten.scaled_dot_product_attention",
            kind="attention",
            pattern=pattern,
            replacement=sdpa_replacement,
            inputs=("q", "k", "v"),
            options=lambda match, config: {
                "scale": match["scale"],
                "causal": bool(match["is_causal"]),
                "provider": config.provider,
            },
            guard=_sdpa_refusal,
            timing=_sdpa_timing,
            aliases=aliases,
        )

    return (
        retarget(_varlen_self, (("cu_k", "cu_q"),)),
        retarget(_varlen, ()),
        *(sdpa(pattern, aliases) for pattern, aliases in _SDPA_PATTERNS),
    )
