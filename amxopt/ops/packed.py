"""Tags that tie a source weight to its packed copies (see amxopt/runtime/weights.py).

A source parameter that ``pack_weights`` packed carries ``{provider: packed}`` under
``PACKED_ATTR``; a placeholder left after the source was released also carries ``RELEASED_ATTR``.
"""

from __future__ import annotations

import math

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.weak import WeakIdKeyDictionary

PACKED_ATTR = "amxopt_packed"  # on a source tensor: {provider: (its _stamp, packed W.reshape(N, -1))}
RELEASED_ATTR = "amxopt_released"  # on a placeholder: the unpacked weight is gone
SHARDED_ATTR = "amxopt_sharded"  # on a source tensor: a tensor-parallel graph keeps only its rank's slice
DERIVED_ATTR = "amxopt_derived"  # on a source tensor: a graph packs a value computed from it (w.t(), w.bfloat16())


class StorageRef:
    """A weak reference to a tensor's storage, equal to another only while both storages live and are
    the same one: an address alone is not enough (``w.data = w.data.half(); w.data = w.data.float()``
    can put the new data where the freed data was). Copied, it is expired: a copy's tensors have
    storages of their own. (Never pickled: kept in ``_STORAGES`` beside a packing's tag, and in an
    optimized module, which refuses pickling.)"""

    __slots__ = ("ref",)

    def __init__(self, tensor: torch.Tensor | None) -> None:
        self.ref = None if tensor is None else StorageWeakRef(tensor.untyped_storage())

    def expired(self) -> bool:
        return self.ref is None or self.ref.expired()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StorageRef) or self.expired() or other.expired():
            return False
        return self.ref.cdata == other.ref.cdata

    __hash__ = None

    def __deepcopy__(self, memo: dict) -> StorageRef:
        return StorageRef(None)


def _stamp(tensor: torch.Tensor) -> tuple:
    """What a packing was made from: an in-place update (``load_state_dict``), new data under the same
    parameter (``param.data = ...``, as ``model.to(dtype)`` and LoRA fusing do) or another shape makes
    it stale. (An in-place update through ``param.data``, which has a version counter of its own, is
    not seen: optimize again from a fresh model after one.) The storage is compared too, by
    :func:`_fresh`."""
    data = 0 if tensor.device.type == "meta" else tensor.data_ptr()
    return (version(tensor), tensor.dtype, tuple(tensor.shape), tensor.device.type, data)


def version(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter (0 for an inference tensor, which counts none)."""
    return 0 if tensor.is_inference() else tensor._version


# A source tensor -> {provider: the storage it was packed from}. Beside the tag, not in it: the tag
# is pickled with a parameter (torch.save), and torch.load's weights_only refuses other classes.
_STORAGES = WeakIdKeyDictionary()


def _fresh(tensor: torch.Tensor, provider: str, stamp: tuple) -> bool:
    if stamp != _stamp(tensor):
        return False
    if tensor.device.type == "meta":
        return True
    ref = _STORAGES.get(tensor, {}).get(provider)  # none for a copy: its storage is its own
    return ref is not None and ref == StorageRef(tensor)


def packed_for(tensor: torch.Tensor, provider: str) -> torch.Tensor | None:
    """The packing of ``tensor`` (a source weight) for ``provider``, if one was made from its
    current values (see ``_stamp``)."""
    stamp, packed = getattr(tensor, PACKED_ATTR, {}).get(provider, (None, None))
    return packed if stamp is not None and _fresh(tensor, provider, stamp) else None


def remember(tensor: torch.Tensor, provider: str, packed: torch.Tensor) -> None:
    if not hasattr(tensor, PACKED_ATTR):
        setattr(tensor, PACKED_ATTR, {})
    getattr(tensor, PACKED_ATTR)[provider] = (_stamp(tensor), packed)
    if tensor.device.type != "meta":
        _STORAGES.setdefault(tensor, {})[provider] = StorageRef(tensor)


def forget(tensor: torch.Tensor, provider: str) -> None:
    """Drop ``tensor``'s packing for ``provider`` (one no graph reads)."""
    getattr(tensor, PACKED_ATTR, {}).pop(provider, None)


def forget_all(tensor: torch.Tensor) -> None:
    """Drop every packing of ``tensor`` (its values were written where no stamp sees it: ``.data``)."""
    tensor.__dict__.pop(PACKED_ATTR, None)


def mark_derived(tensor: torch.Tensor) -> None:
    """``tensor`` (a source weight) has a packing of a value computed from it, which is not its own
    (no stamp): it is kept, not released, and watched for writes like a kept packed weight."""
    setattr(tensor, DERIVED_ATTR, True)


def is_derived(tensor: torch.Tensor) -> bool:
    return getattr(tensor, DERIVED_ATTR, False)


def packings(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every fresh packing of ``tensor``, by provider."""
    return {p: t for p, (s, t) in getattr(tensor, PACKED_ATTR, {}).items() if _fresh(tensor, p, s)}


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
