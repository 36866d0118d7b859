"""transformers attention implementation that routes packed varlen attention to amxopt.

transformers hands an attention implementation whose registered name contains "flash" the packed
q/k/v of all segments plus ``cu_seq_lens_q/k`` in one call (instead of a Python loop over
``torch.split(lengths.tolist())``), so the captured graph holds one attention node per layer.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

# The name must contain "flash" for transformers to pass cu_seqlens (is_flash_attention_requested).
ATTN_IMPLEMENTATION = "amxopt_flash_varlen"
# Attention is routed with the reference provider; replace_attention re-targets it.
_CAPTURE_PROVIDER = "reference"


def varlen_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``[1, H, T, D]`` q/k/v packed over segments -> ``[1, T, H, D]``, like flash-attention."""
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"amxopt varlen attention in {name}: an attention mask is not supported")
    if dropout:
        raise ValueError(f"amxopt varlen attention in {name}: dropout {dropout} is not supported")
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise ValueError(
            f"amxopt varlen attention in {name}: expected packed [1, H, T, D] inputs with cu_seqlens, "
            f"got query {tuple(query.shape)} and cu_seq_lens_q={cu_seq_lens_q}"
        )
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    out = torch.ops.amxopt.varlen_attention(
        q,
        k,
        v,
        cu_seq_lens_q,
        cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q,
        _hint(max_length_q),
        _hint(max_length_k),
        scale,
        bool(is_causal if is_causal is not None else getattr(module, "is_causal", False)),
        _CAPTURE_PROVIDER,
    )
    return out.unsqueeze(0), None


def _hint(n) -> int:
    return n if isinstance(n, int) else 0


def _register() -> None:
    from transformers import AttentionInterface

    if ATTN_IMPLEMENTATION not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)


@contextlib.contextmanager
def routed_attention(model: nn.Module):
    """While tracing, make every sub-config of ``model`` use amxopt's varlen attention."""
    _register()
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    saved = {k: c._attn_implementation for k, c in configs.items()}
    try:
        for c in configs.values():
            c._attn_implementation = ATTN_IMPLEMENTATION
        yield
    finally:
        for k, c in configs.items():
            c._attn_implementation = saved[k]
