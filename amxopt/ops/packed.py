"""Tags that tie a source weight to its packed copies (see amxopt/runtime/weights.py).

A source parameter that ``pack_weights`` packed carries ``{provider: packed}`` under
``PACKED_ATTR``; a placeholder left after the source was released also carries ``RELEASED_ATTR``.
"""

from __future__ import annotations

import math

import torch

PACKED_ATTR = "amxopt_packed"  # on a source tensor: {provider: (its _version, packed W.reshape(N, -1))}
RELEASED_ATTR = "amxopt_released"  # on a placeholder: the unpacked weight is gone
SHARDED_ATTR = "amxopt_sharded"  # on a source tensor: a tensor-parallel graph keeps only its rank's slice


def packed_for(tensor: torch.Tensor, provider: str) -> torch.Tensor | None:
    """The packing of ``tensor`` (a source weight) for ``provider``, if one was made from its
    current values (an in-place update since, e.g. ``load_state_dict``, makes it stale)."""
    version, packed = getattr(tensor, PACKED_ATTR, {}).get(provider, (None, None))
    return packed if version == tensor._version else None


def remember(tensor: torch.Tensor, provider: str, packed: torch.Tensor) -> None:
    if not hasattr(tensor, PACKED_ATTR):
        setattr(tensor, PACKED_ATTR, {})
    getattr(tensor, PACKED_ATTR)[provider] = (tensor._version, packed)


def forget(tensor: torch.Tensor, provider: str) -> None:
    """Drop ``tensor``'s packing for ``provider`` (one no graph reads)."""
    getattr(tensor, PACKED_ATTR, {}).pop(provider, None)


def packings(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every fresh packing of ``tensor``, by provider."""
    return {p: t for p, (v, t) in getattr(tensor, PACKED_ATTR, {}).items() if v == tensor._version}


def transfer(source: torch.Tensor, target: torch.Tensor) -> None:
    """Give ``target`` (a placeholder standing for ``source``) ``source``'s fresh packings and release tag."""
    for provider, t in packings(source).items():
        remember(target, provider, t)
    if is_released(source):
        setattr(target, RELEASED_ATTR, True)


def is_released(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, RELEASED_ATTR, False))


def flat_shape(tensor: torch.Tensor) -> tuple[int, int]:
    """The ``[N, K]`` matrix a weight is packed as (a conv kernel ``[O, C, ...]`` flattens to ``[O, C*...]``)."""
    return tensor.shape[0], math.prod(tensor.shape[1:])


def mark_sharded(tensor: torch.Tensor) -> None:
    """Tag ``tensor`` as read only through a tp shard (the source may be released like a packed one)."""
    setattr(tensor, SHARDED_ATTR, True)


def is_sharded(tensor: torch.Tensor) -> bool:
    return bool(getattr(tensor, SHARDED_ATTR, False))
