"""fuse_rotary: q's and k's rotary embeddings move into the attention that reads them, bit for bit;
a pair it cannot take stays as it was (with the reason where the pair feeds an attention)."""

from __future__ import annotations

import dataclasses

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


class VisionAttention(nn.Module):
    """Qwen3-VL's vision attention as its block runs it: q, k, v from one qkv, rotate_half with D-wide
    cos / sin, then SDPA on [1, H, T, D]; ``leak`` also returns the rotated q (a second reader)."""

    def __init__(self, leak: bool = False, k_angle: float = 1.0):
        super().__init__()
        self.leak, self.k_angle = leak, k_angle

    def forward(self, qkv, freqs):
        q, k, v = qkv.unbind(1)
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.k_angle == 1.0:
            q, k = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
        else:
            q, _ = apply_rotary_pos_emb_vision(q, k, emb.cos(), emb.sin())
            _, k = apply_rotary_pos_emb_vision(q, k, (emb * self.k_angle).cos(), (emb * self.k_angle).sin())
        o = F.scaled_dot_product_attention(*(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)))
        return (o, q) if self.leak else o


def _vision_inputs(dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return {"qkv": torch.randn(12, 3, 2, 16, generator=g).to(dtype), "freqs": torch.randn(12, 8, generator=g)}


def test_fuse_rotary_on_qwen3_vl_attention_is_bit_equal():
    # Static: a head dim that varies with the input leaves an SDPA without a scale (the model's comes from its weights).
    gm, gi = _rewrite(VisionAttention().eval(), _vision_inputs(), NATIVE, dynamic=False)
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
    assert reasons == ["its rotary embedding stays a separate op: q and k are rotated by different cos / sin"]


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
    ],
    ids=["shifted-slices-of-one-table", "cross-attention", "angle-per-head", "written-between"],
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
