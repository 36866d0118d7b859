"""The ``native`` provider: amxopt's own C++ kernels (``csrc/``), bf16 on AVX-512-BF16 CPUs.

The extension is compiled from the project's sources into ``amxopt/ops/_build/`` the first time the
provider is asked whether it is available (the Makefile's install step does that by running
``amxopt info``); later loads find it there and rebuild only if a source changed. It is never loaded
on a CPU without the instructions it uses. fp32 tensors go to the reference implementations (ATen's fp32 GEMMs are
already at the hardware limit; the kernels here are for bf16).

Kernel availability is a CPU question: the kernels use AVX-512F/BW and AVX-512-BF16 instructions.
"""

from __future__ import annotations

import functools
import logging
import pathlib

import torch

from amxopt.ops import reference

logger = logging.getLogger(__name__)

_CSRC = pathlib.Path(__file__).parent / "csrc"
_BUILD = pathlib.Path(__file__).parent / "_build"
_SOURCES = ("gemm.cpp", "norm.cpp", "attention.cpp")
_FLAGS = [
    "-O3",
    "-march=x86-64-v4",
    "-mavx512bf16",
    "-DCPU_CAPABILITY=AVX512",
    "-DCPU_CAPABILITY_AVX512",
    # at::parallel_for is OpenMP in these wheels; the extension then links libgomp.so.1, which
    # resolves to the copy torch already loaded, so there is one thread pool, set by torch.set_num_threads.
    "-fopenmp",
]
_NB = 32  # output columns per packed block (csrc/gemm.cpp kNB)
_REQUIRED_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo") as f:
            return frozenset(next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), ()))
    except OSError:
        return frozenset()


def build(verbose: bool = False) -> None:
    """Compile (or find up to date) and load the extension; registers ``torch.ops.amxopt_native``."""
    from torch.utils.cpp_extension import load

    _BUILD.mkdir(exist_ok=True)
    load(
        name="amxopt_native",
        sources=[str(_CSRC / s) for s in _SOURCES],
        extra_cflags=_FLAGS,
        extra_ldflags=["-fopenmp"],
        build_directory=str(_BUILD),
        is_python_module=False,
        verbose=verbose,
    )


@functools.cache
def available() -> tuple[bool, str]:
    missing = [f for f in _REQUIRED_FLAGS if f not in cpu_flags()]
    if missing:
        return False, f"CPU lacks {', '.join(missing)}"
    try:
        build()
    except Exception as e:  # noqa: BLE001 - any build/load failure means "not available"
        logger.warning("amxopt: native kernels unavailable: %s", e)
        return False, f"extension did not build/load: {str(e).strip().splitlines()[-1][:200]}"
    amx = "amx_bf16" in cpu_flags()
    return True, "amxopt C++ kernels: bf16 on AVX-512-BF16" + ("" if amx else " (this CPU has no AMX)")


def _ops():
    return torch.ops.amxopt_native


def packed_linear_shape(n: int, k: int, dtype: torch.dtype) -> tuple[int, ...]:
    if dtype != torch.bfloat16:
        return (n, k)
    return ((n + _NB - 1) // _NB, (k + 1) // 2, _NB, 2)


def _bf16_kernel(op: str):
    """``op`` on the C++ kernel for bf16 inputs (the first argument decides), the reference otherwise."""
    fallback = getattr(reference, op)

    def run(first, *args):
        return getattr(_ops(), op)(first, *args) if first.dtype == torch.bfloat16 else fallback(first, *args)

    run.__name__ = run.__qualname__ = op
    return run


pack_linear_weight = _bf16_kernel("pack_linear_weight")
linear = _bf16_kernel("linear")
patch_embed = _bf16_kernel("patch_embed")
layer_norm = _bf16_kernel("layer_norm")
rms_norm = _bf16_kernel("rms_norm")
varlen_attention = _bf16_kernel("varlen_attention")
