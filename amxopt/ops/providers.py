"""Kernel providers behind the amxopt ops, and how one is chosen.

A provider is a namespace of functions with the signatures of ``amxopt.ops.reference`` plus two
layout queries for packed Linear weights (a provider may pad or block the weight). The graph
records the provider's name on every op, so passes never depend on which kernels exist.

Providers: ``native`` (amxopt's C++ kernels, ``amxopt/ops/csrc``) where the CPU and the build
allow, else ``reference`` (plain ATen, runs everywhere); ``resolve`` picks one and logs why.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from types import ModuleType

import torch

from amxopt.ops import native, reference

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Provider:
    """One kernel family: the op implementations and the packed-weight layout it uses."""

    name: str
    impl: ModuleType
    packed_linear_shape: Callable[[int, int, torch.dtype], tuple[int, ...]]  # (N, K, dtype) -> packed shape
    available: Callable[[], tuple[bool, str]]

    def __getattr__(self, op: str):
        return getattr(self.impl, op)


def _always() -> tuple[bool, str]:
    return True, "plain ATen, runs on any CPU"


_PROVIDERS: dict[str, Provider] = {
    "reference": Provider(
        name="reference",
        impl=reference,
        packed_linear_shape=lambda n, k, dtype: (n, k),
        available=_always,
    ),
    "native": Provider(
        name="native",
        impl=native,
        packed_linear_shape=native.packed_linear_shape,
        available=native.available,
    ),
}

# Preference order for provider="auto": fastest first.
_PREFERENCE = ("native", "reference")


def get(name: str) -> Provider:
    try:
        return _PROVIDERS[name]
    except KeyError:
        raise ValueError(f"amxopt: unknown provider {name!r}; known: {sorted(_PROVIDERS)}") from None


def available_providers() -> dict[str, tuple[bool, str]]:
    """Every known provider with (usable here?, why)."""
    return {name: p.available() for name, p in _PROVIDERS.items()}


def resolve(requested: str) -> str:
    """Turn ``AmxConfig.provider`` into a concrete, usable provider name."""
    if requested != "auto":
        ok, why = get(requested).available()
        if not ok:
            raise ValueError(f"amxopt: provider {requested!r} is not usable here: {why}")
        return requested
    for name in _PREFERENCE:
        ok, why = _PROVIDERS[name].available()
        if ok:
            logger.info("amxopt: using provider %r (%s)", name, why)
            return name
        logger.info("amxopt: provider %r skipped: %s", name, why)
    raise AssertionError("the reference provider is always available")
