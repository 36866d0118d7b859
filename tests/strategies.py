"""Hypothesis strategies and tolerances shared by the op tests.

Every strategy draws shapes/flags plus a seed and returns a ``Case`` holding concrete tensors
(generated from the seed, so examples are reproducible and hypothesis prints only shapes).
"""

from __future__ import annotations

import types

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from amxopt.ops import ACTIVATIONS, DTYPES

# --- tolerances: stated once per dtype ----------------------------------------------------------

# Outputs are O(1) by construction. fp32 leaves room for a kernel's different summation order;
# bf16 covers rounding the output (and, for attention/activations, an intermediate) to 8 bits.
TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.bfloat16: dict(atol=3e-2, rtol=2e-2),
}


def assert_close_dtype(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (an op output of ``dtype``) matches ``expected`` (an oracle, any float dtype)."""
    assert actual.dtype == dtype, f"output dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected.shape, f"output shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    torch.testing.assert_close(actual.double(), expected.double(), **TOLERANCES[dtype])


# --- hypothesis profiles (loaded by tests/conftest.py; HYPOTHESIS_PROFILE overrides "ci") ---------

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=25,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "nightly",  # make proptest: whole-model properties at 300 examples per family
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
settings.register_profile(
    "dev",
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

# --- cases -------------------------------------------------------------------------------------

HEAD_DIMS = (8, 16, 40, 64, 72, 80, 128)
PATCH_KERNELS = ((2, 16, 16), (1, 2, 2), (2, 4, 4))


class Case(types.SimpleNamespace):
    """A drawn example; its repr shows tensors as shape:dtype so failures stay readable."""

    def __repr__(self) -> str:
        def short(v):
            if isinstance(v, torch.Tensor):
                return f"<{tuple(v.shape)}:{str(v.dtype).removeprefix('torch.')}>"
            return repr(v)

        return f"{type(self).__name__}({', '.join(f'{k}={short(v)}' for k, v in vars(self).items())})"


def _seeds():
    return st.integers(0, 2**31 - 1)


def _randn(gen: torch.Generator, shape, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return (torch.randn(tuple(shape), generator=gen) * scale + shift).to(dtype)


@st.composite
def linear_cases(draw, dtypes=DTYPES, even_k: bool = False) -> Case:
    """``x [*lead, K]``, weight ``[N, K]``, optional bias, an activation; K and N unaligned (K even
    where asked: the packed bf16 layout takes pairs)."""
    m = draw(st.one_of(st.integers(1, 3), st.integers(1, 300)))
    n = draw(st.integers(1, 200))
    k = 2 * draw(st.integers(1, 100)) if even_k else draw(st.integers(1, 200))
    lead = draw(st.sampled_from(["flat", "batched", "vector"]))
    lead_shape = {"flat": (m,), "batched": (draw(st.integers(2, 3)), m), "vector": ()}[lead]
    dtype = draw(st.sampled_from(dtypes))
    has_bias = draw(st.booleans())
    activation = draw(st.sampled_from(ACTIVATIONS))
    gen = torch.Generator().manual_seed(draw(_seeds()))
    return Case(
        x=_randn(gen, (*lead_shape, k), dtype),
        weight=_randn(gen, (n, k), dtype, scale=k**-0.5),
        bias=_randn(gen, (n,), dtype, scale=0.5) if has_bias else None,
        activation=activation,
        dtype=dtype,
    )


@st.composite
def varlen_cases(draw, dtypes=DTYPES) -> Case:
    """Packed q/k/v with 1..6 segments (lengths 1..40), self or cross attention, GQA, causal or not."""
    nseg = draw(st.integers(1, 6))
    lens_q = draw(st.lists(st.integers(1, 40), min_size=nseg, max_size=nseg))
    cross = draw(st.booleans())
    lens_k = draw(st.lists(st.integers(1, 40), min_size=nseg, max_size=nseg)) if cross else list(lens_q)
    hk = draw(st.integers(1, 3))
    hq = hk * draw(st.integers(1, 3))
    d = draw(st.sampled_from(HEAD_DIMS))
    causal = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    scale = d**-0.5 * draw(st.sampled_from([1.0, 0.5, 2.0]))
    hint_max = draw(st.booleans())
    cu_dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    gen = torch.Generator().manual_seed(draw(_seeds()))
    tq, tk = sum(lens_q), sum(lens_k)
    return Case(
        q=_randn(gen, (tq, hq, d), dtype),
        k=_randn(gen, (tk, hk, d), dtype),
        v=_randn(gen, (tk, hk, d), dtype),
        cu_seqlens_q=torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=cu_dtype),
        cu_seqlens_k=torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=cu_dtype),
        max_seqlen_q=max(lens_q) if hint_max else 0,
        max_seqlen_k=max(lens_k) if hint_max else 0,
        scale=scale,
        causal=causal,
        dtype=dtype,
    )


@st.composite
def patch_cases(draw, dtypes=DTYPES) -> Case:
    """``x [B, C, T, H, W]`` with 1..3 patches per axis, weight ``[O, C*kt*kh*kw]``, optional bias."""
    b = draw(st.integers(1, 2))
    c = draw(st.integers(1, 4))
    kernel = list(draw(st.sampled_from(PATCH_KERNELS)))
    npatch = draw(st.tuples(st.integers(1, 3), st.integers(1, 3), st.integers(1, 3)))
    o = draw(st.integers(1, 40))
    has_bias = draw(st.booleans())
    channels_last = draw(st.booleans())
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(_seeds()))
    k_total = c * kernel[0] * kernel[1] * kernel[2]
    x = _randn(gen, (b, c, *(n * k for n, k in zip(npatch, kernel))), dtype)
    if channels_last:
        x = x.to(memory_format=torch.channels_last_3d)
    return Case(
        x=x,
        weight=_randn(gen, (o, k_total), dtype, scale=k_total**-0.5),
        bias=_randn(gen, (o,), dtype, scale=0.5) if has_bias else None,
        kernel_size=kernel,
        out_channels=o,
        dtype=dtype,
    )


@st.composite
def norm_cases(draw, dtypes=DTYPES) -> Case:
    """``x [*rows, D]`` (possibly offset/scaled), optional weight/bias in fp32 or ``x.dtype``."""
    rows = draw(st.integers(1, 50))
    d = draw(st.integers(1, 300))
    lead = draw(st.sampled_from([(rows,), (1, rows), (rows, 1)]))
    dtype = draw(st.sampled_from(dtypes))
    param_dtype = draw(st.sampled_from([torch.float32, dtype]))
    has_weight = draw(st.booleans())
    has_bias = draw(st.booleans())
    x_scale = draw(st.sampled_from([1.0, 0.1, 10.0]))
    x_shift = draw(st.sampled_from([0.0, 3.0]))
    eps = draw(st.sampled_from([1e-5, 1e-6]))
    gen = torch.Generator().manual_seed(draw(_seeds()))
    return Case(
        x=_randn(gen, (*lead, d), dtype, scale=x_scale, shift=x_shift),
        weight=_randn(gen, (d,), param_dtype, scale=0.5, shift=1.0) if has_weight else None,
        bias=_randn(gen, (d,), param_dtype, scale=0.5) if has_bias else None,
        eps=eps,
        dtype=dtype,
    )


@st.composite
def glue_cases(draw, dtypes=DTYPES) -> Case:
    """Wan's glue operands: ``x [B, S, H?, D]`` with per-batch (``[B, 1, D]``) or per-token operands.

    ``mod`` (scale, shift, gate) broadcasts to ``x``; ``cos``/``sin`` ``[1, S, 1?, D/2]`` to its rows,
    or, not interleaved, ``[1, S, 1?, D]`` with independent halves (rotate_half's own factors, as
    Qwen3-VL's vision rotary passes them). Operands stay fp32 (Wan keeps them so) or take ``x``'s dtype.
    """
    b, s, h = draw(st.integers(1, 3)), draw(st.integers(1, 40)), draw(st.sampled_from([None, 1, 3]))
    d = 2 * draw(st.integers(1, 80))
    dtype = draw(st.sampled_from(dtypes))
    op_dtype = draw(st.sampled_from([torch.float32, dtype]))
    per_token = draw(st.booleans())
    lead = (b, s) if h is None else (b, s, h)
    mod_lead = (b, s if per_token else 1) if h is None else (b, s if per_token else 1, 1)
    rot_lead = (1, s) if h is None else (1, s, 1)
    interleaved = draw(st.booleans())
    rot_width = d // 2 if interleaved or not draw(st.booleans()) else d
    gen = torch.Generator().manual_seed(draw(_seeds()))
    angles = _randn(gen, (*rot_lead, rot_width), torch.float32, scale=3.0)
    return Case(
        x=_randn(
            gen, (*lead, d), dtype, scale=draw(st.sampled_from([1.0, 10.0])), shift=draw(st.sampled_from([0.0, 2.0]))
        ),
        y=_randn(gen, (*lead, d), dtype),
        weight=_randn(gen, (d,), op_dtype, scale=0.5, shift=1.0) if draw(st.booleans()) else None,
        bias=_randn(gen, (d,), op_dtype, scale=0.5) if draw(st.booleans()) else None,
        scale=_randn(gen, (*mod_lead, d), op_dtype, scale=0.5),
        shift=_randn(gen, (*mod_lead, d), op_dtype, scale=0.5),
        gate=_randn(gen, (*mod_lead, d), op_dtype),
        cos=angles.cos().to(op_dtype),
        sin=angles.sin().to(op_dtype),
        interleaved=interleaved,
        eps=draw(st.sampled_from([1e-5, 1e-6])),
        dtype=dtype,
    )
