"""fuse_rotary: q's and k's rotary embeddings move into the attention that reads them, bit for bit;
a pair it cannot take stays as it was (with the reason where the pair feeds an attention)."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb_vision

from amxopt.passes import DEFAULT_PASSES, fuse_rotary, replace_attention, replace_glue
from amxopt.passes._graph import LEFT
from tests.helpers import CONFIG, captured, count
from tests.passes.test_glue_rules import Block, _inputs

amx = torch.ops.amxopt
fuse_rotary_module = importlib.import_module("amxopt.passes.fuse_rotary")  # (the package's fuse_rotary is the pass)
NATIVE = dataclasses.replace(CONFIG, provider="native")


def _rotaries(gm) -> int:
    return count(gm, amx.rotary_embedding.default)


def _fused_attentions(gm) -> list:
    return [n for n in gm.graph.nodes if n.target == amx.varlen_attention.default and "rotary_cos" in n.kwargs]


def _rewrite(model, inputs, config, dynamic=True):
    gm, gi = captured(model, inputs, dynamic)
    for p in (replace_attention, replace_glue):
        p(gm, config)
    gm.recompile()
    return gm, gi


@pytest.mark.parametrize("config", [CONFIG, NATIVE], ids=["reference", "native"])
@pytest.mark.parametrize("batch", [1, 2])
def test_fuse_rotary_on_wan_block_is_bit_equal(config, batch):
    # diffusers' own block: q / k rotated after the q / k RMSNorm (interleaved pairs), read through a
    # permute that also gives cu_seqlens its size and the output its dtype (type_as); cos / sin sliced
    # apart for q and for k; with a guidance batch of 2 the tokens are [B, S] and cos broadcasts over B.
    inputs = _inputs(torch.bfloat16, batch=batch)
    gm, gi = _rewrite(Block(torch.bfloat16).eval(), inputs, config)
    assert _rotaries(gm) == 2
    with torch.no_grad():
        before = gm(**gi)
    assert fuse_rotary(gm, config).modified
    gm.recompile()
    assert _rotaries(gm) == 0 and len(_fused_attentions(gm)) == 1
    assert not fuse_rotary(gm, config).modified  # idempotent
    with torch.no_grad():
        assert torch.equal(gm(**gi), before)


class _TwoBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(torch.bfloat16), Block(torch.bfloat16)

    def forward(self, hidden_states, latents, encoder_hidden_states, temb):
        hidden_states = self.first(hidden_states, latents, encoder_hidden_states, temb)
        return self.second(hidden_states, latents, encoder_hidden_states, temb)


def test_fuse_rotary_traces_its_replacement_once_for_attentions_alike(monkeypatch):
    # The fused attention takes max_seqlen as a number the graph computes (a SymInt under a dynamic
    # capture): the second block's attention reuses the first one's trace (Wan2.1 traced all 30, 0.1 s
    # each), and each still computes with its own inputs.
    traced = []

    def counted(*args, **kwargs):
        traced.append(args)
        return attention_with_rotary(*args, **kwargs)

    attention_with_rotary = fuse_rotary_module._attention_with_rotary
    monkeypatch.setattr(fuse_rotary_module, "_attention_with_rotary", counted)
    gm, gi = _rewrite(_TwoBlocks().eval(), _inputs(torch.bfloat16), NATIVE)
    with torch.no_grad():
        before = gm(**gi)
    assert fuse_rotary(gm, NATIVE).modified
    gm.recompile()
    assert len(_fused_attentions(gm)) == 2 and len(traced) == 1
    assert any(isinstance(a, torch.SymInt) for a in traced[0])
    with torch.no_grad():
        assert torch.equal(gm(**gi), before)


class VisionAttention(nn.Module):
    """Qwen3-VL's vision attention as its block runs it: q, k, v from one qkv, rotate_half with D-wide
    cos / sin, then SDPA on [1, H, T, D]; ``leak`` also returns the rotated q (a second reader), ``causal``
    makes the SDPA causal."""

    def __init__(self, leak: bool = False, k_angle: float = 1.0, causal: bool = False):
        super().__init__()
        self.leak, self.k_angle, self.causal = leak, k_angle, causal

    def forward(self, qkv, freqs):
        q, k, v = qkv.unbind(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.k_angle == 1.0:
            q, k = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
        else:
            q, _ = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
            _, k = apply_rotary_pos_emb_vision(q, k, (emb * self.k_angle).cos(), (emb * self.k_angle).sin())
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), is_causal=self.causal)
        return (o, q) if self.leak else o


def _vision_inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return {"qkv": torch.randn(12, 3, 2, 16, generator=g).to(dtype), "freqs": torch.randn(12, 8, generator=g)}


@pytest.mark.parametrize("causal", [False, True])  # the fused attention keeps the SDPA's causal flag
def test_fuse_rotary_on_qwen3_vl_attention_is_bit_equal(causal):
    # Static: a head dim that varies with the input leaves an SDPA without a scale (the model's comes from its weights).
    gm, gi = _rewrite(VisionAttention(causal=causal).eval(), _vision_inputs(), NATIVE, dynamic=False)
    assert _rotaries(gm) == 2 and count(gm, amx.varlen_attention.default) == 1
    with torch.no_grad():
        before = gm(**gi)
    assert fuse_rotary(gm, NATIVE).modified
    gm.recompile()
    assert _rotaries(gm) == 0 and len(_fused_attentions(gm)) == 1
    with torch.no_grad():
        assert torch.equal(gm(**gi), before)


def test_fuse_rotary_leaves_a_rotary_read_elsewhere():
    gm, gi = _rewrite(VisionAttention(leak=True).eval(), _vision_inputs(), NATIVE, dynamic=False)
    assert not fuse_rotary(gm, NATIVE).modified
    assert _rotaries(gm) == 2 and not _fused_attentions(gm)


def test_fuse_rotary_leaves_different_angles_with_the_reason():
    gm, gi = _rewrite(VisionAttention(k_angle=2.0).eval(), _vision_inputs(), NATIVE, dynamic=False)
    assert not fuse_rotary(gm, NATIVE).modified
    assert _rotaries(gm) == 2
    reasons = [n.meta[LEFT] for n in gm.graph.nodes if LEFT in n.meta]
    assert reasons == [
        "its rotary embedding stays a separate op: q and k are rotated by different cos / sin, or pair their values otherwise"
    ]


class SequenceFirst(nn.Module):
    """q / k / v [S, B, H, D] rotated, then made token-major by a reshape that copies (and reorders
    the tokens to b-major): the attention does not read the rotary's output in its own order."""

    def forward(self, q, k, v, freqs):
        s, b, h, d = q.shape
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [S, 1, D]: the rotary unsqueezes the heads
        q, k = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
        q, k, v = (t.transpose(0, 1).reshape(b * s, h, d) for t in (q, k, v))
        return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))


def test_fuse_rotary_leaves_a_reordering_reshape():
    g = torch.Generator().manual_seed(0)
    inputs = {n: torch.randn(6, 2, 2, 16, generator=g).to(torch.bfloat16) for n in "qkv"}
    inputs["freqs"] = torch.randn(6, 8, generator=g)
    gm, gi = _rewrite(SequenceFirst().eval(), inputs, NATIVE, dynamic=False)  # q and k: one S, one B
    assert _rotaries(gm) == 2 and count(gm, amx.varlen_attention.default) == 1
    with torch.no_grad():
        before = gm(**gi)
    assert not fuse_rotary(gm, NATIVE).modified
    gm.recompile()
    with torch.no_grad():
        assert torch.equal(gm(**gi), before)


def test_fuse_rotary_off_by_config():
    gm, _ = _rewrite(VisionAttention().eval(), _vision_inputs(), NATIVE)
    assert not fuse_rotary(gm, dataclasses.replace(NATIVE, fuse_rotary=False)).modified
    assert _rotaries(gm) == 2


def test_fuse_rotary_runs_after_attention_and_glue():
    names = [p.__name__ for p in DEFAULT_PASSES]
    assert names.index("replace_attention") < names.index("fuse_rotary")
    assert names.index("replace_glue") < names.index("fuse_rotary") < names.index("shard_tensor_parallel")


def _rotate(x, cos, sin):
    return x * cos + torch.cat((-x[..., 8:], x[..., :8]), -1) * sin


class _ShiftedKeys(nn.Module):
    """q at positions 0..S-1, k at 1..S: slices of one angle table at different offsets."""

    def forward(self, q, k, v, freqs):
        s, emb = q.shape[0], torch.cat((freqs, freqs), dim=-1)
        cq, ck = emb[0:s], emb[1 : s + 1]
        q, k = _rotate(q, cq.cos()[:, None], cq.sin()[:, None]), _rotate(k, ck.cos()[:, None], ck.sin()[:, None])
        return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=0.25)


class _CrossPerSampleAngle(nn.Module):
    """Cross-attention [B, S, H, D], q and k rotated by one angle per sample."""

    def forward(self, q, k, v, angle):
        cos, sin = angle.cos()[:, None, None], angle.sin()[:, None, None]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=0.25)


class _PerHeadAngle(nn.Module):
    """[T, H, D] with another angle for every head."""

    def forward(self, q, k, v, freqs):
        emb = torch.cat((freqs, freqs), dim=-1)
        q, k = _rotate(q, emb.cos(), emb.sin()), _rotate(k, emb.cos(), emb.sin())
        return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=0.25)


class _WrittenBetween(nn.Module):
    """q's input written in place after its rotary read it: the fused attention would read it after."""

    def forward(self, q, k, v, freqs):
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        q0 = q * 1.0
        q, k = _rotate(q0, cos, sin), _rotate(k, cos, sin)
        q0.mul_(3.0)
        return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=0.25)


class _PairedOtherwise(nn.Module):
    """q rotated with interleaved pairs, k with halves, by the same cos / sin (amxopt's own op)."""

    def forward(self, q, k, v, angle):
        cos, sin = angle.cos(), angle.sin()
        q = torch.ops.amxopt.rotary_embedding(q, cos, sin, True, "native")
        k = torch.ops.amxopt.rotary_embedding(k, cos, sin, False, "native")
        return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=0.25)


def _r(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(
    "model, inputs, reason",
    [
        (_ShiftedKeys(), {"q": _r(6, 2, 16), "k": _r(6, 2, 16, seed=1), "v": _r(6, 2, 16, seed=2), "freqs": _r(8, 8)},
         "q and k are rotated by different cos / sin"),
        (_CrossPerSampleAngle(), {"q": _r(2, 3, 2, 16), "k": _r(2, 5, 2, 16, seed=1), "v": _r(2, 5, 2, 16, seed=2),
                                  "angle": _r(2, 16)},
         "are not the same tokens (not a self-attention)"),
        (_PerHeadAngle(), {"q": _r(6, 2, 16), "k": _r(6, 2, 16, seed=1), "v": _r(6, 2, 16, seed=2),
                           "freqs": _r(6, 2, 8)}, "is not one angle per token for every head"),
        (_WrittenBetween(), {"q": _r(6, 2, 16), "k": _r(6, 2, 16, seed=1), "v": _r(6, 2, 16, seed=2),
                             "freqs": _r(6, 8)}, "writes a tensor in place between them"),
        (_PairedOtherwise(), {"q": _r(6, 2, 16), "k": _r(6, 2, 16, seed=1), "v": _r(6, 2, 16, seed=2),
                              "angle": _r(6, 1, 8)}, "pair their values otherwise"),
    ],
    ids=["shifted-slices-of-one-table", "cross-attention", "angle-per-head", "written-between", "pairing"],
)  # fmt: skip
def test_fuse_rotary_leaves_pairs_it_cannot_take_with_the_reason(model, inputs, reason):
    # Each survived a mutation of its check (stop 50): k rotated by q's angles (2.0 off), or a crash.
    gm, gi = _rewrite(model.eval(), inputs, NATIVE, dynamic=False)
    assert _rotaries(gm) == 2
    assert not fuse_rotary(gm, NATIVE).modified
    reasons = [n.meta[LEFT] for n in gm.graph.nodes if LEFT in n.meta]
    assert len(reasons) == 1 and reason in reasons[0], reasons
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(**gi), model(**inputs))


def _turn(x, cos, sin):  # (split at the computed half: provably the halves in a dynamic graph too)
    h = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., h:], x[..., :h]), -1) * sin


def _attend(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)), scale=0.25)


class _TableWrittenThroughAView(nn.Module):
    """The angle table scaled in place through a view between q's cos / sin and k's: export reads it
    through one node before and after, so the two cos(e) looked like one value (k got q's angles)."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None].clone()
        cq, sq = e.cos(), e.sin()
        e.view(-1).mul_(2.0)
        return _attend(_turn(q, cq, sq), _turn(k, e.cos(), e.sin()), v)


class _TableSliceAssigned(nn.Module):
    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None].clone()
        cq, sq = e.cos(), e.sin()
        e[:, :, 4:8] = 0.0
        return _attend(_turn(q, cq, sq), _turn(k, e.cos(), e.sin()), v)


class _TwoWritesAlike(nn.Module):
    """Two views of one table, each written in place by the same op: k's angles are q's + 1."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None].clone()
        a = e[:].add_(1.0)
        cq, sq = a.cos(), a.sin()
        b = e[:].add_(1.0)
        return _attend(_turn(q, cq, sq), _turn(k, b.cos(), b.sin()), v)


class _TablesFilledLater(nn.Module):
    """Two tables made alike (torch.zeros), then each filled in place with its own angles after both
    exist: nothing is written between the two zeros, and k got q's angles."""

    def forward(self, q, k, v, freqs):
        eq, ek = torch.zeros(q.shape[0], 1, 16), torch.zeros(q.shape[0], 1, 16)
        eq[:] = torch.cat((freqs, freqs), -1)[:, None]
        ek[:] = torch.cat((freqs, freqs), -1)[:, None] * 2
        return _attend(_turn(q, eq.cos(), eq.sin()), _turn(k, ek.cos(), ek.sin()), v)


class _RoundedOtherwise(nn.Module):
    """The same op on the same input, with another keyword (floor and trunc differ below zero)."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None] * 4
        aq, ak = e.div(3, rounding_mode="floor"), e.div(3, rounding_mode="trunc")
        return _attend(_turn(q, aq.cos(), aq.sin()), _turn(k, ak.cos(), ak.sin()), v)


class _SignedZero(nn.Module):
    """q rotated by |e|, k by -|e|: copysign by 0.0 and by -0.0, which compare equal."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None]
        aq, ak = e.copysign(0.0), e.copysign(-0.0)
        return _attend(_turn(q, aq.cos(), aq.sin()), _turn(k, ak.cos(), ak.sin()), v)


class _IntAndFloatFactor(nn.Module):
    """16777217 == 16777217.0 in Python, but a float32 product rounds it to 16777216."""

    def forward(self, q, k, v, pos):
        aq, ak = (pos * 16777217) % 1000, (pos * 16777217.0) % 1000
        return _attend(_turn(q, aq.cos(), aq.sin()), _turn(k, ak.cos(), ak.sin()), v)


class _RandomAngles(nn.Module):
    """q and k rotated by two draws of torch.rand: the same op on the same arguments, two values."""

    def forward(self, q, k, v, freqs):
        aq, ak = (torch.rand(q.shape[0], 1, q.shape[2]) * 6 for _ in range(2))
        return _attend(_turn(q, aq.cos(), aq.sin()), _turn(k, ak.cos(), ak.sin()), v)


class _HeadsFirstRegrouped(nn.Module):
    """q, k given [H, T, D], rotated in a token-major view, regrouped by a view eager takes on the
    transposed layout."""

    def forward(self, q, k, v, freqs):
        h, t, d = q.shape
        e = torch.cat((freqs, freqs), -1)[:, None]
        q, k = (_turn(x.transpose(0, 1), e.cos(), e.sin()).transpose(0, 1).view(t, h, d) for x in (q, k))
        return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v[None], scale=0.25)


class _AcrossHeads(nn.Module):
    """[T, H, D] rotated per token, then attention across the heads (T == H: the sizes cannot tell)."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None]
        q, k = _turn(q, e.cos(), e.sin()), _turn(k, e.cos(), e.sin())
        return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=0.25)


class _HeadsMerged(nn.Module):
    """Rotary on [T, 2, 16], attention on one head of 32."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None]
        q, k = (_turn(x, e.cos(), e.sin()).view(x.shape[0], 1, 32) for x in (q, k))
        return _attend(q, k, v)


class _OneAngle(nn.Module):
    """cos [D]: one angle for every token."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs[0], freqs[0]), -1)
        return _attend(_turn(q, e.cos(), e.sin()), _turn(k, e.cos(), e.sin()), v)


class _MergedSizeRead(nn.Module):
    """q, k, v of one qkv [B, S, 3, H, D], flattened to [B*S, H, D] and that size read for the output."""

    def forward(self, qkv, freqs):
        q, k, v = qkv.unbind(2)
        e = torch.cat((freqs, freqs), -1)[:, None]
        q, k = _turn(q, e.cos(), e.sin()), _turn(k, e.cos(), e.sin())
        qf, kf, vf = (t.flatten(0, 1) for t in (q, k, v))
        n = qf.shape[0]
        return _attend(qf, kf, vf).transpose(1, 2).reshape(n, -1) * n


class _RotatedQAlsoCast(nn.Module):
    """The rotated q also read as data by a type_as (not its dtype read): it must stay computed."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None]
        q, k = _turn(q, e.cos(), e.sin()), _turn(k, e.cos(), e.sin())
        return _attend(q, k, v), q.type_as(freqs.half())


class _RotatedQCastAsItself(nn.Module):
    """q.type_as(q): q is type_as's data as well as its dtype."""

    def forward(self, q, k, v, freqs):
        e = torch.cat((freqs, freqs), -1)[:, None]
        q, k = _turn(q, e.cos(), e.sin()), _turn(k, e.cos(), e.sin())
        return _attend(q, k, v), q.type_as(q)


_QKV = {"q": _r(6, 2, 16), "k": _r(6, 2, 16, seed=1), "v": _r(6, 2, 16, seed=2), "freqs": _r(6, 8, seed=3)}


@pytest.mark.parametrize(
    "model, inputs, dynamic, reason",
    [
        (_TableWrittenThroughAView(), _QKV, False, "q and k are rotated by different cos / sin"),
        (_TableWrittenThroughAView(), _QKV, True, "q and k are rotated by different cos / sin"),
        (_TableSliceAssigned(), _QKV, False, "q and k are rotated by different cos / sin"),
        (_TwoWritesAlike(), _QKV, False, "q and k are rotated by different cos / sin"),
        (_RandomAngles(), _QKV, False, "q and k are rotated by different cos / sin"),
        (_TablesFilledLater(), _QKV, True, "q and k are rotated by different cos / sin"),
        (_RoundedOtherwise(), _QKV, False, "q and k are rotated by different cos / sin"),
        (_SignedZero(), _QKV, True, "q and k are rotated by different cos / sin"),
        (_IntAndFloatFactor(), {**{n: _QKV[n] for n in "qkv"}, "pos": torch.arange(1, 97).view(6, 1, 16)}, False,
         "q and k are rotated by different cos / sin"),
        (_HeadsFirstRegrouped(), {**_QKV, **{n: _r(2, 6, 16, seed=i) for i, n in enumerate("qkv")}}, False,
         "laid out otherwise than export saw it"),
        (_AcrossHeads(), {**{n: _r(4, 4, 16, seed=i) for i, n in enumerate("qkv")}, "freqs": _r(4, 8)}, False,
         "the attention reads q in another order"),
        (_HeadsMerged(), {**_QKV, "v": _r(6, 1, 32, seed=2)}, False, "is not the rotary's input"),
        (_OneAngle(), _QKV, False, "is not one angle per token"),
        (_MergedSizeRead(), {"qkv": _r(2, 6, 3, 2, 16), "freqs": _r(6, 8, seed=3)}, True, "a size read from a view"),
        (_RotatedQAlsoCast(), _QKV, False, None),  # (no pair: q's rotary has another reader)
        (_RotatedQCastAsItself(), _QKV, False, None),
    ],
    ids=["table-view-write", "table-view-write-dynamic", "table-slice-assigned", "two-writes-alike", "random-angles",
         "tables-filled-later", "rounded-otherwise", "signed-zero", "int-and-float-factor", "heads-first-regrouped",
         "across-heads", "heads-merged", "one-angle", "merged-size-read", "q-also-cast", "q-cast-as-itself"],
)  # fmt: skip
def test_fuse_rotary_leaves_what_its_checks_guard_and_matches_eager(model, inputs, dynamic, reason):
    # A helper's review: each was fused wrongly (1.0-2.1 off) or crashed the pass with its check
    # removed; the table writes (the first four, and tables-filled-later) were fused wrongly by the
    # code itself.
    gm, gi = _rewrite(model.eval(), inputs, NATIVE, dynamic=dynamic)
    assert not fuse_rotary(gm, NATIVE).modified
    reasons = [n.meta[LEFT] for n in gm.graph.nodes if LEFT in n.meta]
    assert reason is None or any(reason in r for r in reasons), reasons
    gm.recompile()
    if not isinstance(model, _RandomAngles):
        with torch.no_grad():
            torch.testing.assert_close(gm(**gi), model(**inputs))


class _RotatedTwice(nn.Module):
    def forward(self, q, k, v, freqs):
        e1, e2 = torch.cat((freqs, freqs), -1)[:, None], torch.cat((freqs, -freqs), -1)[:, None]
        q, k = _turn(q, e1.cos(), e1.sin()), _turn(k, e1.cos(), e1.sin())
        return _attend(_turn(q, e2.cos(), e2.sin()), _turn(k, e2.cos(), e2.sin()), v)


def test_fuse_rotary_run_again_leaves_an_attention_it_fused():
    # The second run fused q's and k's first rotations into the attention in place of the second.
    model = _RotatedTwice().eval()
    gm, gi = _rewrite(model, _QKV, NATIVE, dynamic=False)
    assert fuse_rotary(gm, NATIVE).modified and not fuse_rotary(gm, NATIVE).modified
    assert len(_fused_attentions(gm)) == 1 and _rotaries(gm) == 2
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(**gi), model(**_QKV))


class _SegmentedApart(nn.Module):
    """q and k of the same tokens, in segments of their own (q 1 + 5, k 3 + 3)."""

    def forward(self, q, k, v, angle, cu_q, cu_k):
        cos, sin = angle.cos(), angle.sin()
        q = torch.ops.amxopt.rotary_embedding(q, cos, sin, False, "native")
        k = torch.ops.amxopt.rotary_embedding(k, cos, sin, False, "native")
        return torch.ops.amxopt.varlen_attention(q, k, v, cu_q, cu_k, 5, 5, 0.25, False, "native")


def test_fuse_rotary_keeps_q_and_k_segments_apart():
    model = _SegmentedApart().eval()
    inputs = {
        **{n: _r(6, 2, 16, seed=i) for i, n in enumerate("qkv")},
        "angle": _r(6, 1, 8, seed=3),
        "cu_q": torch.tensor([0, 1, 6], dtype=torch.int32),
        "cu_k": torch.tensor([0, 3, 6], dtype=torch.int32),
    }
    gm, gi = _rewrite(model, inputs, NATIVE, dynamic=False)
    assert fuse_rotary(gm, NATIVE).modified and len(_fused_attentions(gm)) == 1
    gm.recompile()
    with torch.no_grad():
        torch.testing.assert_close(gm(**gi), model(**inputs))
