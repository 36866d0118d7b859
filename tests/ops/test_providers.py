"""Provider selection: native is built and chosen wherever the CPU allows; fp32 runs the reference ops."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from amxopt.ops import native, providers


def test_native_builds_where_the_cpu_allows():
    missing = [f for f in native._REQUIRED_FLAGS if f not in native.cpu_flags()]
    ok, why = native.available()
    if missing:
        assert not ok and "lacks" in why
    else:  # a broken build must fail the tests, not silently fall back to the reference kernels
        assert ok, why


def test_auto_prefers_native_when_available():
    expected = "native" if native.available()[0] else "reference"
    assert providers.resolve("auto") == expected


def test_unavailable_provider_is_refused_with_reason(monkeypatch):
    unusable = dataclasses.replace(providers._PROVIDERS["native"], available=lambda: (False, "CPU lacks avx512_bf16"))
    monkeypatch.setitem(providers._PROVIDERS, "native", unusable)
    with pytest.raises(ValueError, match="not usable here: CPU lacks avx512_bf16"):
        providers.resolve("native")
    assert providers.resolve("auto") == "reference"


@pytest.mark.skipif(not native.available()[0], reason="native kernels unavailable on this CPU")
def test_native_fp32_is_the_reference():
    x, w, b = torch.randn(5, 24), torch.randn(7, 24), torch.randn(7)
    packed = torch.ops.amxopt.pack_linear_weight(w, "native")
    assert packed.shape == (7, 24)  # fp32 keeps the plain layout
    got = torch.ops.amxopt.linear(x, packed, b, "silu", 7, "native")
    want = torch.ops.amxopt.linear(x, torch.ops.amxopt.pack_linear_weight(w, "reference"), b, "silu", 7, "reference")
    torch.testing.assert_close(got, want, atol=0, rtol=0)
