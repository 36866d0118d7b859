"""Kernel providers behind the amxopt ops, and how one is chosen.

``native`` is amxopt's C++ library (``amxopt/ops/csrc``), usable wherever it builds and loads (every
x86-64 Linux CPU); within it each op runs on the best tier the CPU has (``amxopt.ops.native``).
``reference`` is plain ATen (``amxopt.ops.reference``), the test oracle, usable everywhere.
``sgl_kernel`` is SGLang's CPU kernels (``amxopt.ops.sgl``), usable where that package is installed
and the CPU has AMX; only on request (never ``auto``), to compare against. The
graph records the provider on every op, so passes never depend on which kernels exist.
"""

from __future__ import annotations

import logging

from amxopt.ops import library, native, sgl

logger = logging.getLogger(__name__)

PROVIDERS = ("native", "reference", "sgl_kernel")  # "auto" picks the first usable of the first two


# Each provider's check, run only when asked: sgl_kernel's imports a large optional extension, which
# resolving another provider (every optimize()) must not pay for.
_CHECKS = {  # looked up at call time (tests stand in for a module's check)
    "native": lambda: native.available(),
    "reference": lambda: (True, "plain ATen, runs on any CPU"),
    "sgl_kernel": lambda: sgl.available(),
}


def available_providers() -> dict[str, tuple[bool, str]]:
    """Every known provider with (usable here?, why)."""
    return {name: check() for name, check in _CHECKS.items()}


def resolve(requested: str) -> str:
    """Turn ``AmxConfig.provider`` into a concrete, usable provider name."""
    if requested != "auto":
        if requested not in _CHECKS:
            raise ValueError(f"amxopt: unknown provider {requested!r}; known: {list(PROVIDERS)}")
        ok, why = _CHECKS[requested]()
        if not ok:
            raise ValueError(f"amxopt: provider {requested!r} is not usable here: {why}")
        return requested
    name = library.resolve_provider("auto")
    logger.info("amxopt: using provider %r (%s)", name, _CHECKS[name]()[1])
    return name


def packed_linear_shape(provider: str, n: int, k: int, dtype) -> tuple[int, ...]:
    return library.packed_linear_shape(n, k, dtype, provider)
