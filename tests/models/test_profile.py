"""``OptimizedModule.profile`` and ``amxopt profile``: every node counted once, FLOPs from the shapes."""

from __future__ import annotations

import collections
import json
import re
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import amxopt
from amxopt import cli
from amxopt.passes._graph import op_name
from amxopt.runtime.profile import _FLOPS, Profile, Row, profile_graph
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
    placeholders = [n.target for n in opt.graphs[0].graph.nodes if n.op == "placeholder"]
    with pytest.raises(ValueError, match=rf"3 inputs for the graph's placeholders {re.escape(str(placeholders))}"):
        profile_graph(opt.graphs[0], {"xs": [*xs, xs[0]]})  # one leaf too many


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


aten = torch.ops.aten
_QKV = (torch.empty(2, 3, 5, 8), torch.empty(2, 3, 7, 8), torch.empty(2, 3, 7, 4))  # batch 2, heads 3, L 5, S 7


@pytest.mark.parametrize(
    "op, args, kwargs, flops",
    [
        # 2 x (Cin / groups) x kernel per output element: out (1, 6, 8)
        (aten.conv1d.default, (torch.empty(1, 4, 10), torch.empty(6, 4, 3)), {}, 2 * 48 * 4 * 3),
        (
            aten.conv1d.default,
            (torch.empty(1, 4, 10), torch.empty(6, 2, 3), None, [1], [0], [1], 2),
            {},
            2 * 48 * 2 * 3,
        ),
        (
            aten.convolution.default,
            (torch.empty(1, 4, 5, 5), torch.empty(6, 4, 3, 3), None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1),
            {},
            2 * 6 * 9 * 4 * 9,
        ),
        # a transposed convolution is not counted
        (
            aten.convolution.default,
            (torch.empty(1, 6, 3, 3), torch.empty(6, 4, 3, 3), None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1),
            {},
            0,
        ),
        # 2 K per output element, K the second operand's rows
        (aten.mm.default, (torch.empty(8, 12), torch.empty(12, 6)), {}, 2 * 8 * 6 * 12),
        (aten.bmm.default, (torch.empty(2, 8, 12), torch.empty(2, 12, 6)), {}, 2 * 2 * 8 * 6 * 12),
        (aten.matmul.default, (torch.empty(8, 12), torch.empty(12)), {}, 2 * 8 * 12),
        (aten.addmm.default, (torch.empty(6), torch.empty(8, 12), torch.empty(12, 6)), {}, 2 * 8 * 6 * 12),
        # 2 (Dq + Dv) = 2 (8 + 4) per (query, key) pair and batch x head
        (aten.scaled_dot_product_attention.default, _QKV, {}, 2 * 6 * 35 * 12),
        # causal, top-left aligned: query i sees i + 1 keys (1 + 2 + 3 + 4 + 5 pairs)
        (aten.scaled_dot_product_attention.default, _QKV, {"is_causal": True}, 2 * 6 * 15 * 12),
        (aten.scaled_dot_product_attention.default, (*_QKV, None, 0.0, True), {}, 2 * 6 * 15 * 12),
    ],
)
def test_aten_ops_count_the_flops_of_their_arithmetic(op, args, kwargs, flops):
    out = op(*args, **kwargs)
    assert _FLOPS[op](args, kwargs, out) == flops


def test_a_profile_reads_its_rows_as_shares_and_tflops():
    profile = Profile([Row("mm", "", 2, 0.003, 6e9), Row("mul", "", 1, 0.001, 0.0)], 0.002, 0.005)
    assert profile.node_seconds == pytest.approx(0.004)
    assert profile.rows[0].tflops == pytest.approx(2.0) and profile.rows[1].tflops is None
    lines = str(profile).splitlines()
    assert lines[0] == "graph call 2.0 ms; timed run 5.0 ms, of it in nodes 4.0 ms"
    assert lines[2].split() == ["3.00", "75.0%", "2", "6.0", "2.000", "mm"]
    assert lines[3].split() == ["1.00", "25.0%", "1", "mul"]
    rows = json.loads(json.dumps(profile.to_json()))["rows"]
    assert [(r["calls"], r["tflops"]) for r in rows] == [(2, pytest.approx(2.0)), (1, None)]


def test_merged_profiles_sum_rows_of_the_same_op_and_shapes():
    one = Profile([Row("mm", "", 1, 0.003, 6e9), Row("mul", "4x6", 2, 0.002, 0.0)], 0.004, 0.006)
    two = Profile([Row("mul", "4x6", 3, 0.004, 0.0), Row("mul", "8x6", 1, 0.001, 0.0)], 0.010, 0.012, parts=2)
    merged = Profile.merged([one, two])
    assert [(r.op, r.shapes, r.calls) for r in merged.rows] == [("mul", "4x6", 5), ("mm", "", 1), ("mul", "8x6", 1)]
    assert [r.seconds for r in merged.rows] == pytest.approx([0.006, 0.003, 0.001])
    assert (merged.graph_seconds, merged.timed_seconds, merged.parts) == pytest.approx((0.014, 0.018, 3))


def _spend(x):
    """A node that takes the time the running test's clock is told to (see ``_Clock``)."""
    return _Clock.running.spend(x)


class _Clock:
    """``time.perf_counter`` for profile_graph: each reading 1 ms after the last, plus what ``_spend``
    nodes take: ``graph[i]`` seconds in the i-th plain graph call, ``timed[i]`` in the i-th node-timed run
    (the first of each kind is profile_graph's warm-up)."""

    running: _Clock | None = None

    def __init__(self, graph: list[float], timed: list[float]):
        self.now, self.graph, self.timed, self.timing = 0.0, list(graph), list(timed), False

    def perf_counter(self) -> float:
        self.now += 1e-3
        return self.now

    def spend(self, x):
        self.now += (self.timed if self.timing else self.graph).pop(0)
        return x


def _profile_with_clock(monkeypatch, graph, timed, repeats, by_shape=False):
    """The profile of mm -> _spend -> mul by a 0-d tensor -> mm, timed by a ``_Clock``."""
    from torch import fx

    from amxopt.runtime import profile

    g = fx.Graph()
    x, w, t = g.placeholder("x"), g.placeholder("w"), g.placeholder("t")
    y = g.call_function(aten.mm.default, (x, w))
    y = g.call_function(aten.mul.Tensor, (g.call_function(_spend, (y,)), t))
    g.output(g.call_function(aten.mm.default, (y, w)))
    gm = fx.GraphModule(nn.Module(), g)

    clock = _Clock(graph, timed)
    run = profile._NodeTimer.run

    def timed_run(self, *args, **kwargs):
        clock.timing = True
        try:
            return run(self, *args, **kwargs)
        finally:
            clock.timing = False

    monkeypatch.setattr(_Clock, "running", clock)
    monkeypatch.setattr(profile, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    monkeypatch.setattr(profile._NodeTimer, "run", timed_run)
    inputs = dict(x=torch.randn(4, 6), w=torch.randn(6, 6), t=torch.tensor(2.0))
    result = profile_graph(gm, inputs, repeats=repeats, by_shape=by_shape)
    assert not clock.graph and not clock.timed  # every call and run as many times as the test expects
    return result


def test_profile_sums_each_ops_calls_in_its_row(monkeypatch):
    profile = _profile_with_clock(monkeypatch, [0.0, 0.0], [0.0, 0.006], repeats=1, by_shape=True)
    rows = {(r.op, r.shapes): r for r in profile.rows}
    mm = rows["aten.mm.default", "4x6, 6x6 -> 4x6"]
    assert mm.calls == 2 and mm.seconds == pytest.approx(0.002) and mm.flops == 2 * 2 * 4 * 6 * 6
    assert rows["aten.mul.Tensor", "4x6, scalar -> 4x6"].seconds == pytest.approx(0.001)
    assert [r.seconds for r in profile.rows] == pytest.approx([0.007, 0.002, 0.001])  # _spend first


def test_profile_reports_the_run_of_median_total_after_a_warm_up(monkeypatch):
    # The warm-ups (here 10 s, as the process's first node-timed run pays ~40 ms once) are not reported.
    one = _profile_with_clock(monkeypatch, [10, 0.5], [10, 0.5], repeats=1)
    assert (one.graph_seconds, one.timed_seconds) == pytest.approx((0.5, 0.5), abs=0.02)
    # Odd: the middle run (rows and total from the same run), the median graph call.
    three = _profile_with_clock(monkeypatch, [10, 5, 7, 6], [10, 3, 1, 2], repeats=3)
    spend = next(r for r in three.rows if "_spend" in r.op)
    assert (spend.seconds, three.timed_seconds, three.graph_seconds) == pytest.approx((2, 2, 6), abs=0.02)
    # Even: the lower middle.
    two = _profile_with_clock(monkeypatch, [10, 5, 7], [10, 2, 1], repeats=2)
    spend = next(r for r in two.rows if "_spend" in r.op)
    assert (spend.seconds, two.timed_seconds) == pytest.approx((1, 1), abs=0.02)
