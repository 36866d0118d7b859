"""The native ops' pool of large outputs (csrc/cpu.cpp, new_output): an output of 32 MB or more, once
freed, serves the next output of the same size, so a model's repeated calls fault in its pages once."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

from amxopt.ops import native

ops = torch.ops.amxopt
ONE = 2048 * 8448 * 2  # bytes of a 2048 x 8448 bf16 output: 33 MB

_CAP_MB = os.environ.get("AMXOPT_OUTPUT_POOL_MB")
pytestmark = [
    pytest.mark.skipif(not native.available()[0], reason="the pool is the native kernels'"),
    pytest.mark.skipif(
        _CAP_MB is not None and (not _CAP_MB.isdigit() or int(_CAP_MB) < 70),
        reason=f"AMXOPT_OUTPUT_POOL_MB={_CAP_MB} holds fewer than two of these outputs in this run",
    ),
]


@pytest.fixture
def empty_pool():
    gc.collect()  # earlier tests' outputs back first
    native.release_output_pool()
    yield
    native.release_output_pool()


def _linear_33mb(x, packed):
    return ops.linear(x, packed, None, "gelu", 8448)


def test_a_freed_large_output_serves_the_next_one(empty_pool):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 64, generator=g).bfloat16()
    w = (torch.randn(8448, 64, generator=g) * 0.125).bfloat16()
    packed = ops.pack_linear_weight(w)
    first = _linear_33mb(x, packed)
    expected, ptr = first.clone(), first.data_ptr()
    assert native.output_pool_bytes() == 0
    first.fill_(float("nan"))  # so that the next output must write every element
    del first  # back to the pool
    assert native.output_pool_bytes() == ONE
    again = _linear_33mb(x, packed)
    assert again.data_ptr() == ptr and native.output_pool_bytes() == 0
    assert torch.equal(again, expected)
    small = ops.linear(x[:64], packed, None, "gelu", 8448)  # 1 MB: glibc's heap, not the pool
    del again, small
    assert native.output_pool_bytes() == ONE
    native.release_output_pool()
    assert native.output_pool_bytes() == 0


def test_pooled_channels_last_output(empty_pool):
    # conv2d's direct kernel writes channels-last: 12 x 480 x 64 x 50 bf16 is 35 MB
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 1, 128, 100, generator=g).bfloat16()
    w, b = torch.randn(480, 1, 3, 3, generator=g).bfloat16(), torch.randn(480, generator=g).bfloat16()
    args = (x, w, b, [2, 2], [1, 1], [1, 1], 1, "gelu")
    first = ops.conv2d(*args)
    expected, ptr = first.clone(), first.data_ptr()
    first.fill_(float("nan"))
    del first
    out = ops.conv2d(*args)
    assert out.data_ptr() == ptr
    assert out.is_contiguous(memory_format=torch.channels_last) and out.shape == (12, 480, 64, 50)
    assert torch.equal(out, expected)
    torch.testing.assert_close(out.float(), ops.conv2d(*args, provider="reference").float(), atol=0.05, rtol=0.02)


def test_pool_switched_off_and_on(empty_pool):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2048, 64, generator=g).bfloat16()
    packed = ops.pack_linear_weight((torch.randn(8448, 64, generator=g) * 0.125).bfloat16())
    expected = _linear_33mb(x, packed)  # from the pool, alive across the switch
    _linear_33mb(x, packed)  # freed at once: back to the pool
    assert native.output_pool_enabled() and native.output_pool_bytes() == ONE
    with native.use_output_pool(False):
        assert not native.output_pool_enabled() and native.output_pool_bytes() == ONE  # kept for later
        off = _linear_33mb(x, packed)  # ATen's allocator, not the pool's block
        assert torch.equal(off, expected) and native.output_pool_bytes() == ONE
        del off
        assert native.output_pool_bytes() == ONE
        del expected  # the pool's own output comes back to it
        assert native.output_pool_bytes() == 2 * ONE
    assert native.output_pool_enabled()
    again = _linear_33mb(x, packed)
    assert native.output_pool_bytes() == ONE
    del again
    assert native.output_pool_bytes() == 2 * ONE
    native.use_output_pool(False)  # a bare call switches it off for good
    try:
        assert not native.output_pool_enabled()
        with native.use_output_pool(False):  # a block that switches it off while off leaves it off
            pass
        assert not native.output_pool_enabled()
    finally:
        native.use_output_pool(True)
    assert native.output_pool_enabled()


# ids as the provider fixture's: native-amx also runs on software tiles (test_providers.py)
@pytest.mark.parametrize("tier", native.TIERS, ids=lambda t: f"native-{t}")
def test_attention_packs_k_and_v_into_a_pooled_buffer(empty_pool, tier):
    """The attention's packed K and V (here 8 kv heads x 8224 keys x 128, 34 or 67 MB) come from the
    pool and go back to it: a reused buffer full of NaN must not reach the result, so the packing
    writes every element, the padding of 8200 keys to whole chunks included."""
    ok, why = native.tier_supported(tier)
    if not ok:
        pytest.skip(f"tier {tier} cannot run here: {why}")
    g = torch.Generator().manual_seed(3)
    q = torch.randn(16, 8, 128, generator=g).bfloat16()
    k, v = (torch.randn(8200, 8, 128, generator=g).bfloat16() for _ in range(2))
    cu_q, cu_k = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([0, 8200], dtype=torch.int32)
    with native.max_tier(tier):
        first = ops.varlen_attention(q, k, v, cu_q, cu_k, 16, 8200, 0.09, False)
        held = native.output_pool_bytes()  # the packed K and V, freed at the call's end
        assert held >= 8 * 8224 * 256 * 2
        poison = ops.rms_norm(torch.ones(held // 512, 256, dtype=torch.bfloat16), None, 1e-6)  # takes that block
        assert native.output_pool_bytes() == 0
        poison.fill_(float("nan"))
        del poison
        again = ops.varlen_attention(q, k, v, cu_q, cu_k, 16, 8200, 0.09, False)
        assert native.output_pool_bytes() == held  # the packing took the NaN block and gave it back
        assert torch.equal(again, first)
        reference = ops.varlen_attention(q, k, v, cu_q, cu_k, 16, 8200, 0.09, False, provider="reference")
        torch.testing.assert_close(again.float(), reference.float(), atol=0.02, rtol=0.02)


def test_pooled_outputs_behave_as_tensors(empty_pool):
    x = torch.randn(2048, 64).bfloat16()
    packed = ops.pack_linear_weight(torch.randn(8448, 64).bfloat16())
    out = _linear_33mb(x, packed)
    expected = out.clone()
    assert torch.equal(torch._lazy_clone(out), expected)  # copy-on-write takes only a plain DataPtr
    out.resize_(16)  # a small storage through the pool's allocator: ATen's memory, never pooled
    assert torch.equal(out, expected.view(-1)[:16])
    del out
    assert native.output_pool_bytes() == ONE  # the large buffer, freed by the resize


def _fresh(code: str, pool_mb: str | None) -> str:
    env = dict(os.environ)
    env.pop("AMXOPT_OUTPUT_POOL_MB", None)
    if pool_mb is not None:
        env["AMXOPT_OUTPUT_POOL_MB"] = pool_mb
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout + done.stderr


_SETUP = (
    "import os, threading, torch\n"
    "from amxopt.ops import native\n"
    "x = torch.randn(2048, 64).bfloat16()\n"
    "packed = torch.ops.amxopt.pack_linear_weight(torch.randn(8448, 64).bfloat16())\n"
    "f = lambda: torch.ops.amxopt.linear(x, packed, None, 'none', 8448)\n"
)
_HOLD_TWO = _SETUP + (
    "a, b = f(), f()\ndel a, b\nassert native.output_pool_bytes() == {expected}, native.output_pool_bytes()\n"
)


def test_pool_holds_at_most_its_cap():
    _fresh(_HOLD_TWO.format(expected=ONE), pool_mb="40")  # room for one of the two
    _fresh(_HOLD_TWO.format(expected=2 * ONE), pool_mb="100")
    _fresh(_HOLD_TWO.format(expected=0), pool_mb="0")  # no pool
    out = _fresh(_HOLD_TWO.format(expected=2 * ONE), pool_mb="lots")  # not a size: the default, and a warning
    assert "AMXOPT_OUTPUT_POOL_MB='lots' is not a size in MB" in out


def test_pool_gives_back_the_oldest_outputs_first():
    code = _SETUP + (
        "y = torch.ops.amxopt.linear(torch.randn(2100, 64).bfloat16(), packed, None, 'none', 8448)\n"
        "a = f()\n"
        "pa, py = a.data_ptr(), y.data_ptr()\n"
        "del y, a  # y first: the older one\n"
        "assert native.output_pool_bytes() == {one}, native.output_pool_bytes()\n"
        "assert f().data_ptr() == pa  # the newer one stayed\n"
    ).format(one=ONE)
    _fresh(code, pool_mb="40")


def test_outputs_freed_on_another_thread_and_after_a_fork():
    code = _SETUP + (
        "a = f()\n"
        "box = [f()]\n"
        "t = threading.Thread(target=box.clear)\n"  # the last reference dies on another thread
        "t.start(); t.join()\n"
        "assert native.output_pool_bytes() == {one}\n"
        "pid = os.fork()\n"
        "if pid == 0:  # one thread: the parent's OpenMP pool does not exist in a forked child\n"
        "    torch.set_num_threads(1)\n"
        "    c = f(); d = f(); del c, d\n"  # the child's copy of the pool works (and its lock is free)
        "    os._exit(0 if native.output_pool_bytes() == {two} else 3)\n"
        "_, status = os.waitpid(pid, 0)\n"
        "assert os.waitstatus_to_exitcode(status) == 0, status\n"
    ).format(one=ONE, two=2 * ONE)
    _fresh(code, pool_mb="100")
