"""The native ops' pool of large outputs (csrc/cpu.cpp, new_output): an output of 32 MB or more, once
freed, serves the next output of the same size, so a model's repeated calls fault in its pages once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from amxopt.ops import native

ops = torch.ops.amxopt
MB = 1 << 20

pytestmark = pytest.mark.skipif(not native.available()[0], reason="the pool is the native kernels'")


def _linear_33mb(x, packed):
    return ops.linear(x, packed, None, "gelu", 8448)  # 2048 x 8448 bf16: 33 MB


def test_a_freed_large_output_serves_the_next_one():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=g).bfloat16()
    w = (torch.randn(8448, 64, generator=g) * 0.125).bfloat16()
    packed = ops.pack_linear_weight(w)
    native.release_output_pool()
    first = _linear_33mb(x, packed)
    expected, ptr = first.clone(), first.data_ptr()
    assert native.output_pool_bytes() == 0
    del first  # back to the pool
    assert native.output_pool_bytes() == 2048 * 8448 * 2
    again = _linear_33mb(x, packed)
    assert again.data_ptr() == ptr and native.output_pool_bytes() == 0
    assert torch.equal(again, expected)  # every element written again
    small = ops.linear(x[:64], packed, None, "gelu", 8448)  # 1 MB: glibc's heap, not the pool
    del again, small
    assert native.output_pool_bytes() == 2048 * 8448 * 2
    native.release_output_pool()
    assert native.output_pool_bytes() == 0


def test_pooled_channels_last_output():
    # conv2d's direct kernel writes channels-last: 12 x 480 x 64 x 50 bf16 is 35 MB
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 1, 128, 100, generator=g).bfloat16()
    w, b = torch.randn(480, 1, 3, 3, generator=g).bfloat16(), torch.randn(480, generator=g).bfloat16()
    args = (x, w, b, [2, 2], [1, 1], [1, 1], 1, "gelu")
    first = ops.conv2d(*args)
    expected = first.clone()
    del first
    out = ops.conv2d(*args)
    assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == (12, 480, 64, 50)
    assert torch.equal(out, expected)
    expected_ref = ops.conv2d(*args, provider="reference")
    torch.testing.assert_close(out.float(), expected_ref.float(), atol=0.05, rtol=0.02)
    del out
    native.release_output_pool()


def _fresh(code: str, pool_mb: str) -> None:
    env = dict(os.environ, AMXOPT_OUTPUT_POOL_MB=pool_mb)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


_HOLD_TWO = (
    "import torch\n"
    "from amxopt.ops import native\n"
    "x = torch.randn(2048, 64).bfloat16()\n"
    "packed = torch.ops.amxopt.pack_linear_weight(torch.randn(8448, 64).bfloat16())\n"
    "a = torch.ops.amxopt.linear(x, packed, None, 'none', 8448)\n"
    "b = torch.ops.amxopt.linear(x, packed, None, 'none', 8448)\n"
    "del a, b\n"
    "print(native.output_pool_bytes())\n"
    "assert native.output_pool_bytes() == {expected}, native.output_pool_bytes()\n"
)


def test_pool_holds_at_most_its_cap():
    one = 2048 * 8448 * 2
    _fresh(_HOLD_TWO.format(expected=one), pool_mb="40")  # room for one of the two
    _fresh(_HOLD_TWO.format(expected=2 * one), pool_mb="100")
    _fresh(_HOLD_TWO.format(expected=0), pool_mb="0")  # no pool
