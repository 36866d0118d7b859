"""Provider and tier selection: the native kernels build on every x86-64 CPU; tiers follow the CPU."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from amxopt.ops import library, native, providers


def test_native_builds_and_loads_on_every_x86_64_cpu():
    # A broken build must fail the tests, not silently fall back to the reference kernels.
    ok, why = native.available()
    assert ok, why


def test_cpu_tier_matches_cpu_flags():
    expected = next(t for t in native.TIERS if native.tier_supported(t)[0])
    assert native.cpu_tier() == expected
    flags = native.cpu_flags()
    if os.environ.get("AMXOPT_VEC_ISA"):  # a cap on the table (the smaller CPUs' runs below)
        assert native.vec_isa() == os.environ["AMXOPT_VEC_ISA"]
    elif {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        assert native.vec_isa() == ("avx512_bf16" if "avx512_bf16" in flags else "avx512")
    else:
        assert native.vec_isa() == ("avx2" if {"avx2", "fma"} <= flags else "default")


def test_max_tier_caps_and_restores():
    best = native.active_tier()
    with native.max_tier("fp32"):
        assert native.active_tier() == "fp32"
        assert native.capped() == (native.cpu_tier() != "fp32")
    assert native.active_tier() == best
    native.max_tier("fp32")  # a bare call, as torch.set_grad_enabled: for the rest of the process
    try:
        assert native.active_tier() == "fp32"
    finally:
        native.max_tier(best)
    assert native.active_tier() == best
    with native.max_tier("avx512_bf16"):  # nested caps: the inner one restores the outer one's
        with native.max_tier("fp32"):
            assert native.active_tier() == "fp32"
        assert native._cap == "avx512_bf16" and native.active_tier() == max(best, "avx512_bf16", key=native.TIERS.index)
    assert native.active_tier() == best
    with pytest.raises(ValueError, match="unknown tier 'avx9'"):
        with native.max_tier("avx9"):
            pass


def test_auto_prefers_native():
    assert providers.resolve("auto") == "native"


def test_unknown_or_unusable_provider_is_refused_with_reason(monkeypatch):
    with pytest.raises(ValueError, match="unknown provider 'sgl'"):
        providers.resolve("sgl")
    monkeypatch.setattr(native, "available", lambda: (False, "C++ kernels did not build/load: no g++"))
    with pytest.raises(ValueError, match=re.escape("not usable here: C++ kernels did not build/load: no g++")):
        providers.resolve("native")
    assert providers.resolve("auto") == "reference"


def test_ops_callable_without_provider():
    x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)
    packed = torch.ops.amxopt.pack_linear_weight(w)
    # native bf16: one VNNI block of 32 x 8 (27 padding columns), shaped [N, K/2 + ceil(27 (K + 1) / 2N), 2]
    assert packed.shape == (5, 4 + 25, 2)
    torch.testing.assert_close(torch.ops.amxopt.linear(x, packed, None, "none", 5), x @ w.T, atol=2e-2, rtol=2e-2)
    y = torch.randn(4, 8)
    torch.testing.assert_close(torch.ops.amxopt.rms_norm(y, None, 1e-6), torch.nn.functional.rms_norm(y, (8,)))


@pytest.mark.parametrize("name", ["fast", ""])
def test_unknown_provider_in_an_op_call_raises(name):
    with pytest.raises(ValueError, match=f"amxopt.rms_norm: unknown provider '{name}'"):
        torch.ops.amxopt.rms_norm(torch.randn(2, 4), None, 1e-6, name)
    # the Python side's check too (the fakes', and the ops' where the C++ library is not loaded)
    with pytest.raises(ValueError, match=f"amxopt.rms_norm: unknown provider '{name}'"):
        library.resolve_provider(name, "rms_norm")


def _run_in_fresh_process(code: str, **env: str) -> None:
    """Run ``code`` in a new Python with ``env`` added (for settings read once per process)."""
    env = dict(os.environ, **env)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]


_SOFTWARE_TILES = native.amx_emulated()
# A bf16 varlen attention (GQA, two segments, causal) against the reference, in a fresh process's code.
_BF16_ATTENTION = (
    "q, k, v = torch.randn(90, 4, 64).bfloat16(), torch.randn(90, 2, 64).bfloat16(), torch.randn(90, 2, 64).bfloat16()\n"
    "cu = torch.tensor([0, 40, 90], dtype=torch.int32)\n"
    "args = (q, k, v, cu, cu, 50, 50, 0.125, True)\n"
    "o = torch.ops.amxopt.varlen_attention(*args)\n"
    "ref = torch.ops.amxopt.varlen_attention(*args, provider='reference')\n"
    "torch.testing.assert_close(o.float(), ref.float(), atol=0.03, rtol=0.02)\n"
)


@pytest.mark.skipif(
    native.cpu_tier() != "amx" or _SOFTWARE_TILES,
    reason=f"needs an AMX CPU (best tier here: {native.cpu_tier()}{' on software tiles' if _SOFTWARE_TILES else ''})",
)
def test_onednn_capped_below_amx_runs_the_avx512_tier():
    # oneDNN reads ONEDNN_MAX_CPU_ISA once per process: run the check in a fresh one.
    code = (
        "import torch, amxopt.ops\n"
        "from amxopt.ops import native\n"
        "assert native.cpu_tier() == 'avx512_bf16', native.cpu_tier()\n"
        "x, w = torch.randn(100, 64).bfloat16(), torch.randn(96, 64).bfloat16()\n"
        "y = torch.ops.amxopt.linear(x, torch.ops.amxopt.pack_linear_weight(w), None, 'none', 96)\n"
        "torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=0.1, rtol=0.02)\n" + _BF16_ATTENTION
        # attention: oneDNN's AVX-512-BF16 brgemm, not amxopt's tile kernel
    )
    _run_in_fresh_process(code, ONEDNN_MAX_CPU_ISA="AVX512_CORE_BF16")


def test_onednn_capped_below_bf16_runs_the_fp32_tier():
    # The CPU has AVX-512-BF16, oneDNN may not use it: the avx512_bf16 tier's bf16 attention (oneDNN's
    # bf16 brgemm) failed at every call with "could not generate a kernel".
    if not native.tier_supported("avx512_bf16")[0]:
        pytest.skip("this CPU runs no bf16 tier to cap")
    code = (
        "import torch, amxopt.ops\n"
        "from amxopt.ops import native\n"
        "assert native.cpu_tier() == 'fp32', native.cpu_tier()\n"
        "ok, why = native.tier_supported('avx512_bf16')\n"
        "assert not ok and 'oneDNN does not run its avx512_bf16 kernels' in why, why\n" + _BF16_ATTENTION
    )
    _run_in_fresh_process(code, ONEDNN_MAX_CPU_ISA="AVX512_CORE")


@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_vector_tables_of_smaller_cpus_pass_the_op_tests(isa):
    # AMXOPT_VEC_ISA caps the vector kernels' table (read once per process): the fp32 tier's op tests
    # run again in a fresh process on the table of an AVX2-only CPU (Zen 3) and of one without AVX2.
    if isa == "avx2" and not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX2 / FMA")
    if isa == "avx2" and native.vec_isa() == "avx2" and "avx512f" not in native.cpu_flags():
        # ATen's and oneDNN's caps below are this CPU's own: the same run as this session's
        pytest.skip("this CPU's own table is avx2 (no AVX-512): this run's fp32-tier op tests ran on it")
    _run_in_fresh_process(f"from amxopt.ops import native\nassert native.vec_isa() == {isa!r}", AMXOPT_VEC_ISA=isa)
    tests = pathlib.Path(__file__).parent
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "native-fp32"]
    cmd += [str(tests / "test_ops.py"), str(tests / "test_glue_ops.py")]
    # avx2: ATen's kernels and oneDNN's (the fp32 attention's brgemm) capped as on such a CPU too
    capped = dict(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2") if isa == "avx2" else {}
    env = dict(os.environ, AMXOPT_VEC_ISA=isa, **capped)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _skip_unless_tiles_can_be_emulated() -> None:
    if _SOFTWARE_TILES:
        pytest.skip("AMXOPT_EMULATE_AMX=1 is set for this run: the amx tier already runs on software tiles here")
    if native.cpu_tier() == "amx":
        pytest.skip("this CPU has AMX: the amx tier's tests run on its own tiles")
    if native.cpu_tier() != "avx512_bf16":
        pytest.skip("the amx tier needs AVX-512-BF16 besides the tiles, even on software tiles; this CPU lacks it")


def test_amx_tier_on_software_tiles_passes_the_op_and_equivalence_tests():
    # AMXOPT_EMULATE_AMX=1 (read once per process) makes the amx tier run on a CPU without AMX, its tile
    # kernel on software tiles: the tier's drivers and the kernel's addressing are tested here too.
    _skip_unless_tiles_can_be_emulated()
    code = (
        "import torch\n"
        "from amxopt.ops import native\n"
        "assert native.cpu_tier() == 'amx' and native.amx_emulated()\n"
        "assert native.tier_supported('amx') == (True, '')\n"
        "x, w = torch.randn(100, 64).bfloat16(), torch.randn(96, 64).bfloat16()\n"
        "y = torch.ops.amxopt.linear(x, torch.ops.amxopt.pack_linear_weight(w), None, 'none', 96)\n"
        "torch.testing.assert_close(y.float(), x.float() @ w.float().T, atol=0.1, rtol=0.02)\n"
        # 4 row tiles (the last one padded: 16 rows on the 16-row kernel) x 3 column blocks
        "assert native.amx_emulated_blocks() == 12, native.amx_emulated_blocks()\n"
        # attention's tile path (head dim 64): both block GEMMs on the software tiles
        "q, k, v = torch.randn(90, 4, 64).bfloat16(), torch.randn(90, 2, 64).bfloat16(), torch.randn(90, 2, 64).bfloat16()\n"
        "cu = torch.tensor([0, 40, 90], dtype=torch.int32)\n"
        "args = (q, k, v, cu, cu, 50, 50, 0.125, True)\n"
        "o = torch.ops.amxopt.varlen_attention(*args)\n"
        "assert native.amx_emulated_blocks() > 12, native.amx_emulated_blocks()\n"
        "ref = torch.ops.amxopt.varlen_attention(*args, provider='reference')\n"
        "torch.testing.assert_close(o.float(), ref.float(), atol=0.03, rtol=0.02)\n"
    )
    _run_in_fresh_process(code, AMXOPT_EMULATE_AMX="1")
    tests = pathlib.Path(__file__).parent
    # Its own options (not pyproject's -q, nor PYTEST_ADDOPTS), so that its last line is the summary.
    cmd = [sys.executable, "-m", "pytest", "-o", "addopts=", "-p", "no:cacheprovider", "-k", "native-amx"]
    cmd += [
        str(tests / "test_ops.py"),
        str(tests / "test_glue_ops.py"),
        str(tests / "test_output_pool.py"),
        str(tests.parent / "models" / "test_equivalence.py"),
    ]
    # nor the parent's pool cap (test_output_pool.py skips under a small one)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "AMXOPT_OUTPUT_POOL_MB")}
    done = subprocess.run(cmd, env=dict(env, AMXOPT_EMULATE_AMX="1"), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    summary = done.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "skipped" not in summary, done.stdout[-2000:]


def test_software_tiles_refused_where_the_amx_tier_cannot_run():
    if native.cpu_tier() != "fp32":
        pytest.skip(f"this CPU runs the {native.cpu_tier()} tier; the refusal is for CPUs without AVX-512-BF16")
    code = (
        "try:\n"
        "    from amxopt.ops import native\n"
        "    native.amx_emulated()\n"
        "except Exception as e:\n"
        "    assert 'AMXOPT_EMULATE_AMX=1: the amx tier needs AVX-512-BF16' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('software tiles accepted without AVX-512-BF16')\n"
    )
    _run_in_fresh_process(code, AMXOPT_EMULATE_AMX="1")


def test_amx_schedule_from_the_environment():
    # AMXOPT_AMX_SCHEDULE (read when the library loads, on every CPU) pins the amx tier's GEMM order.
    _run_in_fresh_process(
        "from amxopt.ops import native\nassert native.amx_schedule() == 'rows' and native.amx_schedule_pinned()",
        AMXOPT_AMX_SCHEDULE="rows",
    )
    code = (
        "try:\n"
        "    from amxopt.ops import native\n"
        "    native.load()\n"
        "except ValueError as e:\n"
        "    assert \"unknown AMX GEMM schedule 'cols' (AMXOPT_AMX_SCHEDULE)\" in str(e), e\n"
        "else:\n"
        "    raise AssertionError('AMXOPT_AMX_SCHEDULE=cols accepted')\n"
    )
    _run_in_fresh_process(code, AMXOPT_AMX_SCHEDULE="cols")


def test_without_the_native_library_every_op_runs_the_reference():
    # Where the C++ library cannot load, Python registers the reference as the ops' CPU kernels.
    code = (
        "import torch, amxopt\n"
        "from amxopt.ops import providers\n"
        "assert providers.resolve('auto') == 'reference'\n"
        "x, w = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(5, 8, dtype=torch.bfloat16)\n"
        "packed = torch.ops.amxopt.pack_linear_weight(w)\n"
        "assert packed.shape == (5, 8)\n"
        "y = torch.ops.amxopt.linear(x, packed, None, 'gelu', 5)\n"
        "torch.testing.assert_close(y, torch.nn.functional.gelu(x @ w.T))\n"
        "try:\n"
        "    torch.ops.amxopt.linear(x, packed, None, 'relu', 5)\n"
        "except ValueError as e:\n"
        "    assert 'activation must be one of' in str(e)\n"
        "else:\n"
        "    raise AssertionError('relu accepted')\n"
        "try:\n"
        "    torch.ops.amxopt.rms_norm(torch.randn(2, 4), None, 1e-6, 'fast')\n"
        "except ValueError as e:\n"
        "    assert \"amxopt.rms_norm: unknown provider 'fast'\" in str(e), str(e)\n"
        "else:\n"
        "    raise AssertionError('provider fast accepted')\n"
        "y = torch.ops.amxopt.linear(x.float().requires_grad_(), packed.float(), None, 'none', 5)\n"
        "try:\n"
        "    y.sum().backward()\n"
        "except RuntimeError as e:\n"
        "    assert 'amxopt.linear: has no backward' in str(e), str(e)\n"
        "else:\n"
        "    raise AssertionError('a backward through amxopt.linear ran')\n"
    )
    _run_in_fresh_process(code, AMXOPT_NATIVE="0")
