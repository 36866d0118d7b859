"""One copy of each weight: packed once, shared by every graph, the source released.

``pack_weights`` tags each source parameter it packs with the packed tensor (``PACKED_ATTR``,
keyed by provider). A later capture of the same model (a re-capture for another input signature)
finds the tag and reuses the packed tensor instead of packing again, so all graphs share one set.

:func:`release` then swaps every packed source parameter for a meta-device placeholder that keeps
its shape, dtype and tag: the unpacked weights are freed, and calling the original model eagerly
fails loudly (meta tensors cannot compute) instead of computing with missing weights. torch.export
cannot trace meta parameters next to CPU inputs, so :func:`exportable` puts a CPU stand-in of the
same shape (one element, broadcast) in their place while a re-capture traces.
"""

from __future__ import annotations

import contextlib
import ctypes
import weakref

import torch
from torch import nn

from amxopt.ops import DTYPES
from amxopt.ops.packed import (
    RELEASED_ATTR,
    flat_shape,
    is_derived,
    is_released,
    is_sharded,
    packed_for,
    packings,
    remember,
    transfer,
)

_OWN_STORAGE = "amxopt_own_storage"  # on a kept tensor: the data release gave a storage of its own


def packable(module: nn.Module, attr: str) -> bool:
    """A weight amxopt's passes turn into a packed GEMM operand: a Linear's, or a patch embedding's."""
    if attr != "weight":
        return False
    if isinstance(module, nn.Linear):
        return True
    if isinstance(module, (nn.Conv2d, nn.Conv3d)):
        padding_free = module.padding == "valid" or not any(module.padding)
        return (
            list(module.stride) == list(module.kernel_size)
            and padding_free
            and all(d == 1 for d in module.dilation)
            and module.groups == 1
        )
    return False


def pack(weight: torch.Tensor, provider: str) -> torch.Tensor:
    """``weight`` packed for ``provider`` as its ``[N, K]`` flattening (what ``pack_weights`` shares)."""
    with torch.no_grad():
        return torch.ops.amxopt.pack_linear_weight(weight.reshape(flat_shape(weight)), provider)


def unpacked(model: nn.Module, provider: str) -> list[nn.Parameter]:
    """The packable weights of ``model`` that have no packing for ``provider`` yet (each once)."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        p = module._parameters.get("weight")
        if p is None or p.device.type == "meta" or p.dtype not in DTYPES or not packable(module, "weight"):
            continue
        if packed_for(p, provider) is None:
            found.setdefault(id(p), p)
    return list(found.values())


def plan_packings(model: nn.Module, provider: str) -> None:
    """Give every packable weight of ``model`` without a packing for ``provider`` a meta one (its
    shape and dtype, no data): a capture takes it as it takes any earlier packing, without
    computing one, and a stored graph names it by its source weight (``amxopt/runtime/isolated.py``)."""
    for p in unpacked(model, provider):
        remember(p, provider, pack(p.to("meta"), provider))


def release(model: nn.Module, keep: set[int]) -> int:
    """Replace every packed (or tp-sharded) parameter of ``model`` by a meta placeholder, except ids in ``keep``.

    Returns the bytes freed. Tied parameters (one tensor under several names) are replaced once
    and stay tied. A first call under ``torch.inference_mode`` releases: what this puts in the
    model is made outside it (an inference tensor in the source fails every later capture).
    """
    with torch.inference_mode(False):
        return _release(model, keep)


def _release(model: nn.Module, keep: set[int]) -> int:
    freed, done = 0, {}
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or not (packings(p) or is_sharded(p)) or is_released(p) or id(p) in keep:
                continue
            if is_derived(p):  # a graph packs a value computed from it: a re-capture computes it again
                continue
            if id(p) not in done:
                done[id(p)] = placeholder(p, packings(p))
                freed += p.numel() * p.element_size()
            module._parameters[name] = done[id(p)]
    if freed:
        # Checkpoint loaders (transformers, diffusers) hand out tensors whose storage lies in one
        # memory-mapped file per shard: while any lives, every page packing read stays resident.
        # Give the tensors that remain (norms, biases, embeddings) storage of their own, in place so
        # graphs sharing them follow; one this did already (a later release) is left as it is.
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                if t.device.type != "meta" and getattr(t, _OWN_STORAGE, None) != t.data_ptr():
                    fresh = packings(t)  # a kept weight's packings stay fresh: the values are the same
                    t.data = t.data.clone()
                    setattr(t, _OWN_STORAGE, t.data_ptr())
                    for provider, done_packing in fresh.items():
                        remember(t, provider, done_packing)
        _return_freed_heap()
    if freed:
        guard(model)
    return freed


def has_released(module: nn.Module) -> bool:
    """Whether any of ``module``'s weights is a released placeholder (its values exist only packed)."""
    return any(is_released(p) for p in module.parameters())


def placeholder(like: torch.Tensor, packed: dict[str, torch.Tensor]) -> nn.Parameter:
    """A released weight: meta, ``like``'s shape and dtype, carrying its packings by provider."""
    p = nn.Parameter(torch.empty(like.shape, dtype=like.dtype, device="meta"), requires_grad=False)
    for provider, t in packed.items():
        remember(p, provider, t)
    setattr(p, RELEASED_ATTR, True)
    return p


def guard(model: nn.Module) -> None:
    """Make eager calls of ``model``, whose packed weights are meta placeholders, fail with the
    reason; and of each of its modules that holds one itself (:func:`_guard_holder`)."""
    if "_amxopt_guard" not in model.__dict__:
        model.__dict__["_amxopt_guard"] = model.register_forward_pre_hook(_refuse_eager_call)
    for module in model.modules():
        if any(p is not None and is_released(p) for p in module._parameters.values()):
            _guard_holder(module)


def _guard_holder(module: nn.Module) -> None:
    """Make eager calls of a module that holds a placeholder itself fail: a submodule of the source
    (``model.fc1``, ``opt.blocks[0].mlp`` through the optimized module) is callable on its own, and
    ATen's CPU ``linear`` of a meta weight and a real bias returns uninitialized memory, no error."""
    if module not in _HOLDER_GUARDS:
        _HOLDER_GUARDS[module] = module.register_forward_pre_hook(_refuse_placeholder_call)


# A guarded module -> its hook's handle: kept out of the module's attributes, which tell stacked
# blocks apart (amxopt/capture/repeated.py: a handle per block made every released stack unstackable).
_HOLDER_GUARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refuse_placeholder_call(module: nn.Module, args) -> None:
    # While a capture traces, exportable() has put CPU stand-ins in the placeholders' place.
    params = module._parameters.items()
    released = [n for n, p in params if p is not None and is_released(p) and p.device.type == "meta"]
    if released:
        raise RuntimeError(
            f"amxopt: {type(module).__name__}'s {', '.join(released)} was released by amxopt.optimize (its values "
            "exist only packed, in the optimized graphs); call the optimized module, or optimize with "
            "AmxConfig(keep_source=True) to keep the original's modules callable"
        )


_refuse_placeholder_call.amxopt_own = True  # not a user's hook (amxopt/capture/repeated.py: hooked)


def _return_freed_heap() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them for reuse, and RSS counts them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _refuse_eager_call(model: nn.Module, args) -> None:
    # Meta parameters would make the original return meta tensors: refuse with the reason instead.
    if not model.__dict__.get("_amxopt_tracing"):
        raise RuntimeError(
            f"amxopt: {type(model).__name__}'s packed weights were released by amxopt.optimize (one copy in memory); "
            "call the optimized module, or optimize with AmxConfig(keep_source=True) to keep the original callable"
        )


_refuse_eager_call.amxopt_own = True  # not a user's hook (amxopt/capture/repeated.py: hooked)


@contextlib.contextmanager
def exportable(model: nn.Module):
    """While tracing ``model``, released placeholders become CPU stand-ins carrying the same tags."""
    swapped = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None and is_released(p) and p.device.type == "meta":
                with torch.inference_mode(False):  # (a call under it captures: export refuses inference tensors)
                    stand_in = nn.Parameter(torch.zeros((), dtype=p.dtype).expand(p.shape), requires_grad=False)
                transfer(p, stand_in)
                module._parameters[name] = stand_in
                swapped.append((module, name, p))
    model.__dict__["_amxopt_tracing"] = True
    try:
        yield
    finally:
        model.__dict__["_amxopt_tracing"] = False
        for module, name, p in swapped:
            module._parameters[name] = p
