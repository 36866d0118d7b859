"""``OptimizedModule.profile`` and ``amxopt profile``: every node counted once, FLOPs from the shapes."""

from __future__ import annotations

import collections
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amxopt
from amxopt import cli
from amxopt.passes._graph import op_name
from amxopt.runtime.profile import _FLOPS, profile_graph
from tests.helpers import CONFIG

B, L, H, D = 2, 24, 2, 16
E = H * D


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.qkv = nn.Linear(E, 3 * E)
        self.out = nn.Linear(E, E)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(B, L, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, L, E)
        return x + self.out(a)


def _optimized():
    model, inputs = _Block().eval(), (torch.randn(B, L, E),)
    return amxopt.optimize(model, inputs, CONFIG), inputs


def test_profile_counts_every_node_once_with_its_flops(caplog):
    opt, inputs = _optimized()
    assert opt.report.counts()["attention"] == 1 and opt.report.counts()["linear"] == 2, str(opt.report)
    profile = opt.profile(inputs, repeats=2)
    assert "grad enabled" not in caplog.text  # it calls the model itself: under no_grad, as it times it

    gm = opt.graphs[0]
    nodes = collections.Counter(op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")
    assert {r.op: r.calls for r in profile.rows} == dict(nodes)
    flops = {r.op: r.flops for r in profile.rows}
    assert flops["amxopt.linear.default"] == 2 * B * L * E * (3 * E + E)
    assert flops["amxopt.varlen_attention.default"] == 4 * B * H * L * L * D
    assert flops["amxopt.layer_norm.default"] == 0  # memory-bound: no FLOPs counted
    assert all(r.seconds > 0 for r in profile.rows)
    assert [r.seconds for r in profile.rows] == sorted((r.seconds for r in profile.rows), reverse=True)
    assert profile.node_seconds <= profile.timed_seconds
    assert "amxopt.varlen_attention.default" in str(profile)


def test_profile_by_shape_splits_rows_by_activation_shapes():
    opt, inputs = _optimized()
    rows = opt.profile(inputs, repeats=1, by_shape=True).rows
    linears = sorted(r.shapes for r in rows if r.op == "amxopt.linear.default")
    # The packed weights are not listed: activation in -> activation out (the residual is an input too).
    assert linears == [f"{B}x{L}x{E} -> {B}x{L}x{3 * E}", f"{B}x{L}x{E}, {B}x{L}x{E} -> {B}x{L}x{E}"], linears
    assert sum(r.calls for r in rows if r.op == "amxopt.linear.default") == 2


def test_causal_attention_counts_the_pairs_it_computes():
    q = torch.empty(7, 3, 8)
    cu = torch.tensor([0, 3, 7])  # segments of 3 and 4: 6 + 10 causal pairs, 9 + 16 in all
    args = (q, q, q, cu, cu, 4, 4, 1.0)
    count = _FLOPS[torch.ops.amxopt.varlen_attention.default]
    assert count((*args, True), {}, q) == 4 * 16 * 3 * 8
    assert count(args, {"causal": True}, q) == 4 * 16 * 3 * 8
    assert count((*args, False), {}, q) == 4 * 25 * 3 * 8
    # More queries than keys (bottom-right): 4 queries over 2 keys see 0, 0, 1 and 2 of them.
    q4, cu_q, cu_k = torch.empty(4, 3, 8), torch.tensor([0, 4]), torch.tensor([0, 2])
    out = torch.empty(4, 3, 6)  # v's head dim 6: P V counts 2 x 6 per pair
    assert count((q4, q4, q4, cu_q, cu_k, 4, 2, 1.0, True), {}, out) == 2 * 3 * 3 * (8 + 6)


def test_patch_embed_counts_one_kernel_per_output():
    x = torch.empty(1, 16, 5, 32, 32)  # Wan's latent, kernel 1x2x2 -> 1536 channels at 5 x 16 x 16
    out = torch.empty(1, 1536, 5, 16, 16)
    count = _FLOPS[torch.ops.amxopt.patch_embed.default]
    assert count((x, None, None, [1, 2, 2], 1536), {}, out) == 2 * 1536 * 1280 * 16 * 4


def test_profile_refuses_what_it_cannot_time():
    opt, inputs = _optimized()
    gm = opt.graphs[0]
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        profile_graph(gm, {}, repeats=0)
    with pytest.raises(ValueError, match=r"0 inputs for the graph's placeholders \['x'\]"):
        profile_graph(gm, {})


class Pair(nn.Module):
    """A list argument: the graph has one placeholder per element."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, xs, scale=1.0):
        return self.a(xs[0]) + self.b(xs[1]) * scale


def test_profile_of_a_model_taking_a_list():
    xs = [torch.randn(4, 16), torch.randn(4, 16)]
    opt = amxopt.optimize(Pair().eval(), (xs,), CONFIG)
    rows = {r.op: r.calls for r in opt.profile((xs, 0.5)).rows}
    assert rows["amxopt.linear.default"] == 2


def test_cli_profile_prints_and_writes_the_table(tmp_path, capsys):
    out = tmp_path / "profile.json"
    args = ["profile", "tests.test_cli:build_tiny", "--dtype", "fp32", "--no-autotune", "--repeats", "1"]
    assert cli.main([*args, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "amxopt.linear.default" in text and "amxopt.layer_norm.default" in text
    written = json.loads(out.read_text())
    assert written["repeats"] == 1 and written["threads"] == torch.get_num_threads() and not written["by_shape"]
    rows = written["rows"]
    (linear,) = [r for r in rows if r["op"] == "amxopt.linear.default"]
    assert linear["calls"] == 1 and linear["flops"] == 2 * 4 * 16 * 32


def test_profile_of_a_call_in_parts_sums_every_part():
    # The Omni audio tower runs a call of more than conv_chunksize chunks in parts: the profile
    # showed the first part's time and FLOPs as the call's, and did not say so.
    from amxopt import models

    inputs = {"input_features": torch.randn(128, 3000), "feature_lens": torch.tensor([3000])}  # 30 chunks
    profiles = []
    for chunks in (500, 9):
        model = models.build_model("tiny-qwen3-omni-audio", torch.float32, conv_chunksize=chunks)
        profiles.append(amxopt.optimize(model, inputs, CONFIG).profile(inputs, repeats=1))
    whole, cut = profiles
    assert whole.parts == 1 and cut.parts == 4, (whole.parts, cut.parts)
    flops = {r.op: r.flops for r in whole.rows if r.flops}
    assert {r.op: r.flops for r in cut.rows if r.flops} == pytest.approx(flops)
    assert str(cut).startswith("a call in 4 parts, summed: graph call") and "parts" not in str(whole)
    assert json.loads(json.dumps(cut.to_json()))["parts"] == 4
