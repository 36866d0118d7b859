"""The ``sgl_kernel`` provider: amxopt's ops mapped onto SGLang's CPU kernels.

Two backends run the same tests:

- ``installed``: the real ``sgl_kernel`` package, where it is installed and the CPU has AMX (a skip
  naming what is missing elsewhere; it is not on the package registries).
- ``stand-in``: a plain-ATen ``sgl_kernel`` library written here from the documented op contracts
  (DESIGN.md): the packed weight keeps its [N, K] shape but is VNNI-blocked, the Linear takes an fp32
  bias and has no activation, attention takes int32 bounds and may lack ``sm_scale``. It checks
  amxopt's side of the mapping (layouts, dtypes, which calls reach sgl_kernel and which fall back) on
  every CPU; it cannot say anything about sgl_kernel's own numerics.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import amxopt
from amxopt.ops import providers, reference, sgl
from tests.strategies import assert_close_dtype

ops = torch.ops.amxopt
P = "sgl_kernel"


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """The stand-in's VNNI layout undone: per block of up to 32 rows, [K/2, rows, 2] -> [rows, K]."""
    n, k = packed.shape
    flat, rows = packed.reshape(-1), []
    for r0 in range(0, n, 32):
        nb = min(32, n - r0)
        block = flat[r0 * k : (r0 + nb) * k].view(k // 2, nb, 2).permute(1, 0, 2)
        rows.append(block.reshape(nb, k))
    return torch.cat(rows)


class StandIn:
    """sgl_kernel's CPU ops in plain ATen, with the contract checks the real ones make."""

    def __init__(self, sm_scale: bool) -> None:
        self.calls: dict[str, int] = {}
        self.lib = torch.library.Library("sgl_kernel", "DEF")
        scale_arg = ", float sm_scale=-1.0" if sm_scale else ""
        for schema, fn in (
            ("convert_weight_packed(Tensor weight) -> Tensor", self.convert_weight_packed),
            (
                "weight_packed_linear(Tensor mat1, Tensor mat2, Tensor? bias, bool is_vnni, "
                "ScalarType? out_dtype=None) -> Tensor",
                self.weight_packed_linear,
            ),
            (
                "flash_attn_varlen_func(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                f"int max_seqlen_q, int max_seqlen_k, bool causal{scale_arg}) -> Tensor",
                self.flash_attn_varlen_func,
            ),
            ("layernorm_cpu(Tensor input, Tensor weight, Tensor? bias, float eps) -> Tensor", self.layernorm_cpu),
            ("rmsnorm_cpu(Tensor input, Tensor weight, float eps) -> Tensor", self.rmsnorm_cpu),
        ):
            self.lib.define(schema)
            self.lib.impl(schema.split("(")[0], fn, "CPU")

    def _count(self, name):
        self.calls[name] = self.calls.get(name, 0) + 1

    def convert_weight_packed(self, w):
        self._count("convert_weight_packed")
        n, k = w.shape
        assert w.dtype == torch.bfloat16 and n % 16 == 0 and k % 32 == 0 and w.is_contiguous()
        blocks = [w[r0 : r0 + 32].reshape(-1, k // 2, 2).permute(1, 0, 2).reshape(-1) for r0 in range(0, n, 32)]
        return torch.cat(blocks).view(n, k)

    def weight_packed_linear(self, mat1, mat2, bias, is_vnni, out_dtype=None):
        self._count("weight_packed_linear")
        assert mat1.dim() == 2 and mat1.stride(-1) == 1 and mat1.dtype == torch.bfloat16 and is_vnni
        assert bias is None or bias.dtype == torch.float32
        y = mat1.float() @ _unpack(mat2).float().t()
        if bias is not None:
            y = y + bias
        return y.to(out_dtype or mat1.dtype)

    def flash_attn_varlen_func(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, sm_scale=-1.0):
        self._count("flash_attn_varlen_func")
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v))
        assert int((cu_q[1:] - cu_q[:-1]).max()) <= max_q and int((cu_k[1:] - cu_k[:-1]).max()) <= max_k
        scale = sm_scale if sm_scale > 0 else q.shape[-1] ** -0.5
        return reference.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, scale, causal)

    def layernorm_cpu(self, x, w, b, eps):
        self._count("layernorm_cpu")
        assert x.dim() == 2 and w.dtype == x.dtype
        return F.layer_norm(x.float(), (x.shape[-1],), w.float(), None if b is None else b.float(), eps).to(x.dtype)

    def rmsnorm_cpu(self, x, w, eps):
        self._count("rmsnorm_cpu")
        assert x.dim() == 2 and w.dtype == x.dtype
        return F.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


@pytest.fixture(params=["installed", "stand-in", "stand-in-no-sm-scale"])
def backend(request, monkeypatch):
    """Where sgl_kernel's ops come from; yields the stand-in (for its call counts) or None."""
    if request.param == "installed":
        usable, why = sgl.available()
        if not usable:
            pytest.skip(f"sgl_kernel provider not usable here: {why}")
        yield None
        return
    if hasattr(torch.ops.sgl_kernel, "convert_weight_packed"):
        pytest.skip("a real sgl_kernel is loaded; the stand-in would clash with it")
    stand_in = StandIn(sm_scale=request.param == "stand-in")
    monkeypatch.setattr(sgl, "available", lambda: (True, "test stand-in"))
    try:
        yield stand_in
    finally:
        stand_in.lib._destroy()


def _called(backend, name: str, expected: bool = True) -> None:
    if backend is not None:
        assert (backend.calls.get(name, 0) > 0) == expected, (name, backend.calls)


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).bfloat16()


@pytest.mark.parametrize("activation", ["none", "gelu", "silu"])
@pytest.mark.parametrize("lead", [(7,), (2, 3), (1,), (0,)])
def test_linear_on_sgl_matches_reference(backend, activation, lead):
    torch.manual_seed(0)
    w, b, x = _bf16(48, 64, scale=0.1), torch.randn(48), _bf16(*lead, 64)
    packed = ops.pack_linear_weight(w, P)
    assert packed.shape == (48, 64, 1)  # told apart from the plain weight; the fake must agree
    assert ops.pack_linear_weight(w.to("meta"), P).shape == packed.shape
    out = ops.linear(x, packed, b, activation, 48, P)
    expected = reference.linear(x, w, b, activation, 48)
    assert out.shape == (*lead, 48) and out.dtype == torch.bfloat16
    assert_close_dtype(out, expected.double(), torch.bfloat16)
    _called(backend, "convert_weight_packed")
    _called(backend, "weight_packed_linear", expected=x.numel() > 0)


@pytest.mark.parametrize("n, k, dtype", [(40, 64, torch.bfloat16), (48, 40, torch.bfloat16), (48, 64, torch.float32)])
def test_linear_sgl_cannot_pack_runs_aten(backend, n, k, dtype):
    torch.manual_seed(0)
    w, x = torch.randn(n, k).to(dtype), torch.randn(5, k).to(dtype)
    packed = ops.pack_linear_weight(w, P)
    assert torch.equal(packed, w)  # left plain
    out = ops.linear(x, packed, None, "gelu_tanh", n, P)
    assert_close_dtype(out, reference.linear(x, w, None, "gelu_tanh", n).double(), dtype)
    _called(backend, "convert_weight_packed", expected=False)
    _called(backend, "weight_packed_linear", expected=False)


def test_linear_sgl_refuses_a_weight_packed_for_other_features(backend):
    packed = ops.pack_linear_weight(_bf16(48, 64), P)
    with pytest.raises(ValueError, match="amxopt.linear: .*should have shape"):
        ops.linear(_bf16(3, 64), packed, None, "none", 32, P)


def test_linear_sgl_and_plain_weights_are_not_taken_for_each_other(backend):
    # sgl_kernel's VNNI packing has the plain matrix's [N, K] values: shaped alike, each was taken
    # for the other, silently (3.1 off).
    w, x = _bf16(48, 64), _bf16(3, 64)
    with pytest.raises(ValueError, match=r"amxopt.linear: .*should have shape \(48, 64, 1\)"):
        ops.linear(x, w, None, "none", 48, P)
    with pytest.raises(ValueError, match=r"amxopt.linear: .*should have shape \(48, 64\)"):
        ops.linear(x, ops.pack_linear_weight(w, P), None, "none", 48, "reference")


@pytest.mark.parametrize("kernel, channels", [((2, 16, 16), 3), ((1, 2, 2), 16)])
def test_patch_embed_on_sgl_matches_conv3d(backend, kernel, channels):
    torch.manual_seed(0)
    conv = torch.nn.Conv3d(channels, 64, kernel, stride=kernel).bfloat16()
    kt, kh, kw = kernel
    x = _bf16(2, channels, 2 * kt, 2 * kh, 3 * kw)
    packed = ops.pack_linear_weight(conv.weight.detach().flatten(1), P)
    out = ops.patch_embed(x, packed, conv.bias.detach(), list(kernel), 64, P)
    expected = F.conv3d(x.double(), conv.weight.double(), conv.bias.double(), stride=kernel)
    assert out.shape == expected.shape
    assert_close_dtype(out, expected, torch.bfloat16)
    _called(backend, "weight_packed_linear")


def _segments(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_on_sgl_matches_reference(backend, kv_heads, causal):
    torch.manual_seed(0)
    cu = _segments([5, 17, 9])
    q, k, v = _bf16(31, 4, 32), _bf16(31, kv_heads, 32), _bf16(31, kv_heads, 32)
    scale = 32**-0.5
    out = ops.varlen_attention(q, k, v, cu, cu.long(), 0, 17, scale, causal, P)
    expected = reference.varlen_attention(q.double(), k.double(), v.double(), cu, cu, 17, 17, scale, causal)
    assert_close_dtype(out, expected, torch.bfloat16)
    _called(backend, "flash_attn_varlen_func")


def test_attention_scale_sgl_may_not_take_runs_native(backend):
    torch.manual_seed(0)
    cu = _segments([6, 10])
    q, k, v = _bf16(16, 2, 16), _bf16(16, 2, 16), _bf16(16, 2, 16)
    for scale in (0.3, -0.25):
        out = ops.varlen_attention(q, k, v, cu, cu, 10, 10, scale, False, P)
        expected = reference.varlen_attention(q.double(), k.double(), v.double(), cu, cu, 10, 10, scale, False)
        assert_close_dtype(out, expected, torch.bfloat16)
    # A negative scale never reaches sgl_kernel (it reads <= 0 as "1/sqrt(D)"); 0.3 does only
    # where the installed version takes sm_scale.
    if backend is not None:
        takes_scale = sgl._has_arg(torch.ops.sgl_kernel.flash_attn_varlen_func, "sm_scale")
        assert backend.calls.get("flash_attn_varlen_func", 0) == (1 if takes_scale else 0)


@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_on_sgl_matches_reference(backend, causal):
    # Segments of other lengths in q and k (Wan's text keys): on sgl_kernel (a mapping that swapped
    # their bounds passed every other test here), and causal, bottom-right aligned, native.
    torch.manual_seed(0)
    cu_q, cu_k = _segments([5, 9]), _segments([16, 3])
    q, k, v = _bf16(14, 2, 16), _bf16(19, 2, 16), _bf16(19, 2, 16)
    out = ops.varlen_attention(q, k, v, cu_q, cu_k, 9, 16, 0.25, causal, P)
    expected = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k, 9, 16, 0.25, causal)
    assert_close_dtype(out, expected, torch.bfloat16)
    _called(backend, "flash_attn_varlen_func", expected=not causal)


@pytest.mark.parametrize("rms", [False, True])
def test_norms_on_sgl_match_reference(backend, rms):
    torch.manual_seed(0)
    x, w, b = _bf16(2, 5, 64), _bf16(64), _bf16(64)
    if rms:
        out, expected = ops.rms_norm(x, w, 1e-6, P), reference.rms_norm(x.double(), w.double(), 1e-6)
    else:
        out = ops.layer_norm(x, w, b, 1e-6, P)
        expected = reference.layer_norm(x.double(), w.double(), b.double(), 1e-6)
    assert out.shape == x.shape
    assert_close_dtype(out, expected, torch.bfloat16)
    _called(backend, "rmsnorm_cpu" if rms else "layernorm_cpu")
    # Without a weight, or with an fp32 one, sgl_kernel cannot take it: native runs it.
    out = ops.layer_norm(x, w.float(), None, 1e-6, P)
    assert_close_dtype(out, reference.layer_norm(x.double(), w.double(), None, 1e-6), torch.bfloat16)


def test_whole_model_on_sgl_matches_eager(backend):
    from amxopt import models
    from amxopt.runtime.compare import max_abs_error

    model = models.build_model("tiny-qwen3-vl-vision", torch.bfloat16)
    fp32 = models.build_model("tiny-qwen3-vl-vision", torch.float32)
    inputs = models.example_inputs("tiny-qwen3-vl-vision", torch.bfloat16)
    with torch.no_grad():
        want = fp32(**models.example_inputs("tiny-qwen3-vl-vision", torch.float32))
        eager = model(**inputs)  # before optimize() releases the source weights
        got = amxopt.optimize(model, inputs, amxopt.AmxConfig(provider=P, autotune=False))(**inputs)
    assert max_abs_error(got, want) <= 1.5 * max_abs_error(eager, want) + 1e-2
    _called(backend, "weight_packed_linear")
    _called(backend, "flash_attn_varlen_func")


def test_unusable_provider_is_a_clear_error():
    usable, why = sgl.available()
    if usable:
        pytest.skip("sgl_kernel is usable here")
    assert providers.available_providers()[P] == (False, why)
    with pytest.raises(ValueError, match=f"provider 'sgl_kernel' is not usable here: {why[:20]}"):
        providers.resolve(P)
    with pytest.raises(RuntimeError, match="provider 'sgl_kernel' is not usable here"):
        ops.pack_linear_weight(_bf16(32, 64), P)
    # Ops sgl_kernel has no counterpart for run amxopt's own kernels under this provider name.
    x, y, gate = _bf16(3, 8), _bf16(3, 8), _bf16(8)
    assert_close_dtype(ops.gated_residual(x, y, gate, P), x.double() + y.double() * gate.double(), torch.bfloat16)
