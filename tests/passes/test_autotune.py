"""Autotune: each distinct op shape is timed against the ATen code it replaces; the faster runs.

Timing itself is stubbed where a test needs a given winner (a shared 2-core machine cannot promise
one); the real timer runs in the first test, on shapes small enough to be quick.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
import time

import pytest
import torch

import amxopt
from amxopt.ops import native
from amxopt.passes import _autotune
from tests.models.test_equivalence import _PlainBlock

KINDS_TIMED = ("linear", "attention", "layer_norm", "rms_norm")


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return _PlainBlock().to(dtype).eval()


def _optimize(model, tmp_path, **kw):
    x = torch.randn(2, 9, 32, dtype=next(model.parameters()).dtype)
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path), keep_source=True, **kw)
    return amxopt.optimize(model, (x,), config), x


def test_every_decision_is_reported_with_both_timings_and_cached(tmp_path, monkeypatch):
    opt, _ = _optimize(_model(), tmp_path)
    choices = opt.report.choices
    # linear 32->96 and 32->64 (+silu) and 64->32, attention, layer_norm, rms_norm: six distinct shapes
    assert len(choices) == 6, str(opt.report)
    for winner, timing in choices:
        assert winner in ("amxopt", "ATen") and " ms, ATen " in timing and "amxopt " in timing
    assert "kernel choices" in str(opt.report)
    assert (tmp_path / "kernel_choices.json").exists()
    # A second capture of the same model reads every decision from disk: nothing is timed, and no
    # random inputs are made (they cost seconds at real sizes).
    monkeypatch.setattr(_autotune, "_time", lambda *a: pytest.fail("timed a cached shape"))
    monkeypatch.setattr(_autotune, "materialize", lambda *a, **k: pytest.fail("made inputs for a cached shape"))
    again, _ = _optimize(_model(), tmp_path, graph_cache=False)
    assert [w for w, _ in again.report.choices] == [w for w, _ in choices]
    assert all(t.endswith("[cached]") for _, t in again.report.choices)
    # A graph restored from the graph cache was timed in the process that stored it, not in this one.
    restored, _ = _optimize(_model(), tmp_path)
    assert any("graph restored" in n for n in restored.report.notes), restored.report.notes
    assert len(restored.report.choices) == 6 and all(t.endswith("[cached]") for _, t in restored.report.choices)


def _glue_block():
    from tests.passes.test_glue_rules import Block, _inputs

    return Block(torch.bfloat16).eval(), _inputs(torch.bfloat16)


def _patchify():
    from tests.passes.test_passes import Patchify

    return Patchify().to(torch.bfloat16).eval(), {"x": torch.randn(1, 4, 2, 8, 8, dtype=torch.bfloat16)}


def _audio_convs():
    from tests.passes.test_passes import AudioConvs

    return AudioConvs().eval(), {"x": torch.randn(1, 1, 16, 10)}


@pytest.mark.parametrize(
    "build,kinds",
    [(_glue_block, {"modulate", "residual", "rotary"}), (_patchify, {"patch_embed"}), (_audio_convs, {"conv2d"})],
    ids=["glue", "patch_embed", "conv2d"],
)
def test_every_kind_is_timed_on_real_inputs_and_read_back_without_them(tmp_path, monkeypatch, build, kinds):
    # The first optimize makes random inputs and times both sides on them (the real timer: each kind's
    # runs are called); the second reads each decision from disk, making no input at all.
    model, inputs = build()
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path), keep_source=True, graph_cache=False)
    first = amxopt.optimize(model, inputs, config).report
    assert kinds <= {t.split(" ")[0] for _, t in first.choices}, str(first)
    monkeypatch.setattr(_autotune, "_time", lambda *a: pytest.fail("timed a cached shape"))
    monkeypatch.setattr(_autotune, "materialize", lambda *a, **k: pytest.fail("made inputs for a cached shape"))
    again = amxopt.optimize(model, inputs, config).report
    ops = [t.split(": amxopt ")[0] for _, t in first.choices]
    assert [t.split(": amxopt ")[0] for _, t in again.choices] == ops, str(again)
    assert all(t.endswith("[cached]") for _, t in again.choices), str(again)


def test_decisions_are_timed_again_at_another_thread_count(tmp_path, monkeypatch):
    _autotune.context()  # as after any earlier optimize() in this process: the count is read per lookup
    _optimize(_model(), tmp_path)
    # (The capture runs in a forked child: the stub's timings show in the report, not in a list here.)
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (1.0, 3.0))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        again, _ = _optimize(_model(), tmp_path)
    finally:
        torch.set_num_threads(threads)
    choices = [t for _, t in again.report.choices]
    assert len(choices) == 6 and all(t.endswith(": amxopt 1 ms, ATen 3 ms (3.00x)") for t in choices), choices


def test_aten_is_kept_where_it_is_faster(tmp_path, monkeypatch):
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (2.0, 1.0))
    model = _model(torch.float32)
    opt, x = _optimize(model, tmp_path)
    assert sum(opt.report.counts().values()) == 0, str(opt.report)
    assert {e.kind for e in opt.report.left} == set(KINDS_TIMED)
    for entry in opt.report.left:
        assert "ATen is faster here" in entry.detail and "amxopt 2 ms, ATen 1 ms (0.50x)" in entry.detail
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_amxopt_is_kept_where_it_is_faster(tmp_path, monkeypatch):
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (1.0, 3.0))
    opt, _ = _optimize(_model(), tmp_path)
    assert opt.report.counts() == dict(
        linear=3, attention=1, patch_embed=0, conv2d=0, layer_norm=1, rms_norm=1, modulate=0, residual=0, rotary=0
    )
    assert all(w == "amxopt" for w, _ in opt.report.choices)
    # Every rewritten node keeps its own decision and source, also when its consumer (the qkv Linear
    # reads the LayerNorm, the down projection the fused up projection) is rewritten after it.
    assert len(opt.report.choices) == 6, str(opt.report)
    for entry in opt.report.replaced:
        assert entry.source.startswith(
            {"attention": "aten.scaled_dot_product_attention"}.get(entry.kind, "aten." + entry.kind)
        )


def test_aten_must_win_by_a_margin_and_twice(tmp_path, monkeypatch):
    # A near-tie stays amxopt's, and says so.
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (1.05, 1.0))
    opt, _ = _optimize(_model(), tmp_path / "tie")
    assert not opt.report.left and all(w == "amxopt" for w, _ in opt.report.choices)
    assert all("within 10%: amxopt kept" in t for _, t in opt.report.choices), str(opt.report)
    # A lead in the first timing only (a burst of noise on amxopt's samples) is timed again and lost.
    timings = iter([(2.0, 1.0), (1.0, 1.02)] * 6)
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: next(timings))
    opt, _ = _optimize(_model(), tmp_path / "burst")
    assert not opt.report.left and len(opt.report.choices) == 6, str(opt.report)
    assert all("amxopt 1 ms, ATen 1.02 ms" in t for _, t in opt.report.choices)
    # Two leads: ATen kept, reported with the timing less favourable to it.
    timings = iter([(2.0, 1.0), (1.5, 1.0)] * 6)
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: next(timings))
    opt, _ = _optimize(_model(), tmp_path / "twice")
    assert len(opt.report.left) == 6 and all("amxopt 1.5 ms, ATen 1 ms (0.67x)" in e.detail for e in opt.report.left)


def test_a_fused_linear_aten_keeps_is_not_rewritten_without_its_activation(tmp_path, monkeypatch):
    # The Linear + silu root autotune kept on ATen is settled: the plain Linear rule, which amxopt
    # would win, does not take the Linear out of it (the report would count a rewrite autotune refused).
    def compare(op, config, setup, schedule=None):
        return _autotune.Timing(op, *((10.0, 1.0) if "silu" in op else (1.0, 10.0)))

    monkeypatch.setattr(_autotune, "compare", compare)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.SiLU()).eval()
    x = torch.randn(3, 16)
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path), keep_source=True, graph_cache=False)
    opt = amxopt.optimize(model, (x,), config)
    assert sum(opt.report.counts().values()) == 0 and len(opt.report.left) == 1, str(opt.report)
    assert "silu" in opt.report.left[0].detail
    calls = {str(n.target) for n in opt.graph_module.graph.nodes if n.op == "call_function"}
    assert {"aten.linear.default", "aten.silu.default"} <= calls and not any("amxopt" in c for c in calls)


def test_a_modulate_aten_keeps_is_among_the_kernel_choices(tmp_path, monkeypatch):
    # A modulate's root is its layer_norm, which replace_norms then takes: autotune's decision to keep
    # the modulate on ATen rides on the norm's replacement, and the report lists it with the others.
    from tests.passes.test_glue_rules import Block, _inputs

    def compare(op, config, setup, schedule=None):
        return _autotune.Timing(op, *((10.0, 1.0) if op.startswith("modulate") else (1.0, 10.0)))

    monkeypatch.setattr(_autotune, "compare", compare)
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path), keep_source=True, graph_cache=False)
    opt = amxopt.optimize(Block(torch.bfloat16).eval(), _inputs(torch.bfloat16), config)
    assert opt.report.counts()["modulate"] == 0 and opt.report.counts()["layer_norm"] > 0, str(opt.report)
    kept = [timing for winner, timing in opt.report.choices if timing.startswith("modulate")]
    assert kept and all(w == "ATen" for w, t in opt.report.choices if t in kept), str(opt.report)
    assert all("amxopt 10 ms, ATen 1 ms" in t for t in kept)
    assert "modulate" in str(opt.report).split("kernel choices")[1]


def _schedules(opt) -> dict[int, str | None]:
    """out_features -> amx_schedule of each amxopt.linear of the graph (None: the default)."""
    return {
        n.args[4]: n.kwargs.get("amx_schedule")
        for n in opt.graph_module.graph.nodes
        if n.target == torch.ops.amxopt.linear.default
    }


def test_amx_schedule_is_chosen_per_linear_shape(tmp_path, monkeypatch):
    # On the amx tier, where a Linear's shape runs the two GEMM schedules differently, autotune times
    # them first: the faster becomes the node's amx_schedule, and amxopt's side of the ATen comparison
    # runs in it. Here: the shapes with K = 32 (qkv; the up projection + silu) "differ"; Rows is 3x
    # faster at the first (in both orders), 1.02x (within the margin: the default stays) at the second.
    monkeypatch.setattr(native, "amx_schedule_matters", lambda rows, k: k == 32)

    def timer(run_a, run_b):  # (the capture's child process runs it; a failed assert fails its capture)
        if not isinstance(run_a, functools.partial):  # attention, norms: amxopt ahead
            return (1.0, 3.0)
        a, out = run_a.keywords["amx_schedule"], run_a.args[4]
        if isinstance(run_b, functools.partial):  # groups against rows, in either order
            times = {"groups": 3.0 if out == 96 else 1.02, "rows": 1.0}
            return times[a], times[run_b.keywords["amx_schedule"]]
        assert a == ("rows" if out == 96 else "default"), (a, out)  # amxopt against ATen, in its schedule
        return (1.0, 3.0)

    monkeypatch.setattr(_autotune, "_time", timer)
    model = _model()
    opt, x = _optimize(model, tmp_path)
    assert _schedules(opt) == {96: "rows", 64: None, 32: None}, str(opt.report)
    text = "\n".join(t for _, t in opt.report.choices)
    assert "AMX rows schedule (groups 3 ms, rows 1 ms)" in text and "AMX groups schedule (groups 1.02 ms" in text
    assert ", AMX rows schedule: amxopt 1 ms" in text, text  # the ATen comparison in Rows, keyed apart
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), atol=0.05, rtol=0.05)
    # The decisions are cached with the others: a second capture times nothing and decides alike.
    monkeypatch.setattr(_autotune, "_time", lambda *a: pytest.fail("timed a cached shape"))
    again, _ = _optimize(_model(), tmp_path, graph_cache=False)
    assert _schedules(again) == {96: "rows", 64: None, 32: None}
    assert "rows 1 ms, cached)" in "\n".join(t for _, t in again.report.choices)

    # A process that pins a schedule runs it everywhere: no schedule is timed, no node chooses one,
    # and the graph cached above (whose node chose Rows) is not the one restored.
    def pinned_timer(run_a, run_b):
        assert not isinstance(run_b, functools.partial), "timed the schedules of a pinned process"
        return (1.0, 3.0)

    monkeypatch.setattr(_autotune, "_time", pinned_timer)
    with native.use_amx_schedule("rows"):
        pinned, _ = _optimize(_model(), tmp_path)
    assert _schedules(pinned) == {96: None, 64: None, 32: None}, str(pinned.report)


def test_fp32_linears_have_no_schedule_to_choose(tmp_path, monkeypatch):
    # An fp32 weight is not VNNI-packed: its GEMM runs alike in both schedules, so none is timed.
    monkeypatch.setattr(native, "amx_schedule_matters", lambda rows, k: True)

    def timer(run_a, run_b):
        assert not isinstance(run_b, functools.partial), "timed the schedules of an fp32 Linear"
        return (1.0, 3.0)

    monkeypatch.setattr(_autotune, "_time", timer)
    opt, _ = _optimize(_model(torch.float32), tmp_path)
    assert _schedules(opt) == {96: None, 64: None, 32: None} and "AMX" not in str(opt.report)


def test_autotune_off_times_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(_autotune, "_time", lambda *a: pytest.fail("timed with autotune=False"))
    opt, _ = _optimize(_model(), tmp_path, autotune=False)
    assert opt.report.choices == [] and not opt.report.left


def test_reference_provider_times_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(_autotune, "_time", lambda *a: pytest.fail("timed the reference provider"))
    x = torch.randn(2, 9, 32, dtype=torch.bfloat16)
    opt = amxopt.optimize(
        _model(), (x,), amxopt.AmxConfig(provider="reference", autotune_cache=str(tmp_path), keep_source=True)
    )
    assert opt.report.choices == []


def _sleeping(calls: dict, name: str, secs: float, first: float | None = None):
    """A side of a timing that sleeps ``secs`` (``first`` at its first call) and counts its calls in
    ``calls[name]``."""

    def run():
        calls[name] += 1
        time.sleep(first if first is not None and calls[name] == 1 else secs)

    return run


# (rounds' budget s, first calls' bound s, amxopt s, ATen s, ATen's first call s, calls of each side,
# whether the warm-up decided). An emulated bf16 conv can take a minute: once it is 3x behind after
# one call, stop timing it. Real-size calls (Wan2.1's attention at 480p, 17 s against 45 s) leave
# room for one round at most: a 1.5x lead in the warm-up settles it, a closer one still takes that
# round. A first pair of calls under the bound is called again: a first call's one-off cost (oneDNN
# creating its primitive) does not decide.
_WARM_UP_CASES = {
    "slow and 3x behind": (5.0, 0.2, 0.01, 0.3, None, 1, True),
    "slow and 3x behind, called again": (5.0, 1.0, 0.01, 0.3, None, 2, True),
    "a first call's one-off cost": (5.0, 1.0, 0.004, 0.004, 0.3, 3, False),
    "longer than the budget, 2.5x behind": (0.1, 0.2, 0.1, 0.25, None, 1, True),
    "longer than the budget, close": (0.1, 0.2, 0.2, 0.2, None, 2, False),
}


@pytest.mark.parametrize("case", list(_WARM_UP_CASES))
def test_when_the_warm_up_decides(monkeypatch, case):
    budget, first_calls, amx_s, aten_s, aten_first, expected, decided = _WARM_UP_CASES[case]
    monkeypatch.setattr(_autotune, "_BUDGET_S", budget)
    monkeypatch.setattr(_autotune, "_FIRST_CALLS_S", first_calls)
    calls = {"amxopt": 0, "aten": 0}
    run_aten = _sleeping(calls, "aten", aten_s, aten_first)
    amx_ms, aten_ms = _autotune._time(_sleeping(calls, "amxopt", amx_s), run_aten)
    if decided:
        assert calls == {"amxopt": expected, "aten": expected} and aten_ms > 1.5 * amx_ms
    else:  # rounds followed the warm-up, whose first call is in no sample
        assert calls["amxopt"] == calls["aten"] >= expected and aten_ms < 2 * aten_s * 1e3, (calls, aten_ms)


def test_close_timings_take_interleaved_rounds():
    calls = {"amxopt": 0, "aten": 0}
    _autotune._time(_sleeping(calls, "amxopt", 0.004), _sleeping(calls, "aten", 0.004))
    assert calls["amxopt"] == calls["aten"] > 2  # each side the same number of samples


def test_rounds_take_turns_first_and_give_each_side_its_own_time(monkeypatch):
    order = []
    monkeypatch.setattr(
        _autotune, "_sample", lambda run, repeat: order.append(run()) or {"a": 0.003, "b": 0.009}[order[-1]]
    )
    for name, value in (("_DECISIVE", 1e9), ("_FAR", 1e9), ("_FIRST_CALLS_S", 1.0)):
        monkeypatch.setattr(_autotune, name, value)  # two warm-ups that do not decide, then every round
    amx_ms, aten_ms = _autotune._time(lambda: "a", lambda: "b")
    assert (amx_ms, aten_ms) == pytest.approx((3.0, 9.0))
    rounds = [order[i : i + 2] for i in range(4, len(order), 2)]  # after the two warm-ups
    assert (
        len(rounds) > 2
        and rounds[::2] == [["a", "b"]] * len(rounds[::2])
        and rounds[1::2] == [["b", "a"]] * len(rounds[1::2])
    ), order


def test_timed_inputs_have_the_layout_of_the_graph():
    """A transposed view (Wan's q, k, v), a channels-last activation (after the direct conv2d), a
    slice and a broadcast view are timed in their own layout, and keyed apart from contiguous ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        fakes = [
            torch.empty(1, 40, 3, 8).transpose(1, 2),
            torch.empty(2, 6, 4, 5).contiguous(memory_format=torch.channels_last),
            torch.empty(4, 10)[:, :6],
            torch.empty(1, 5, 1, 8).expand(2, 5, 3, 8),
        ]
        # A broadcast of a slice is timed on a dense base, expanded: it is keyed so.
        sliced = torch.empty(9, 64)[:, :32].expand(2, -1, -1)
        contiguous = torch.empty(2, 6, 4, 5)
    for fake in fakes:
        real = _autotune.materialize(fake)
        assert not isinstance(real, type(fake)) and real.shape == fake.shape and real.stride() == fake.stride()
        assert real.float().std() > 0.5  # random values, not the storage's leftovers
        assert _autotune.describe(fake) != _autotune.describe(torch.empty(fake.shape)), fake.stride()
        assert _autotune.describe(fake) == _autotune.describe(real)  # the key names the layout timed
    real = _autotune.materialize(sliced)
    assert (
        real.stride() == (0, 32, 1)
        and _autotune.describe(sliced) == _autotune.describe(real) == "2x9x32:float32:strides 0x32x1"
    )
    assert _autotune.describe(contiguous) == "2x6x4x5:float32"


class _TwoLayouts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(32, 64)

    def forward(self, x, y):
        return self.a(x) + self.b(y.transpose(1, 2))


def test_a_linear_of_a_transposed_input_is_timed_in_its_layout(tmp_path):
    # Flattened for the timing, a transposed x was copied to a contiguous one: both Linears shared
    # one key and one decision, timed without the cost ATen pays on the strided input.
    model = _TwoLayouts().to(torch.bfloat16).eval()
    x, y = torch.randn(2, 8, 32, dtype=torch.bfloat16), torch.randn(2, 32, 8, dtype=torch.bfloat16)
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path), keep_source=True, graph_cache=False)
    opt = amxopt.optimize(model, (x, y), config)
    with torch.no_grad():
        torch.testing.assert_close(opt(x, y), model(x, y), rtol=2e-2, atol=2e-2)
    ops = sorted(t.split("]")[0] for _, t in opt.report.choices)
    assert ops == [
        "linear [16x32:bfloat16, 64x32:bfloat16, 64:bfloat16",
        "linear [2x8x32:bfloat16:strides 256x1x8, 64x32:bfloat16, 64:bfloat16",
    ], str(opt.report)


def test_an_artifact_loaded_without_autotune_drops_the_saved_decisions(tmp_path, monkeypatch):
    # Saved where ATen won every timing; AmxConfig(autotune=False) asks for every kernel amxopt has.
    from amxopt import models

    inputs = models.example_inputs("tiny-wan", torch.float32)
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (3.0, 1.0))
    tuned = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path), graph_cache=False)
    opt = amxopt.optimize(models.build_model("tiny-wan", torch.float32), inputs, tuned)
    assert any("ATen is faster" in left.detail for left in opt.report.left), str(opt.report)
    opt.save(tmp_path / "artifact")
    off = dataclasses.replace(tuned, autotune=False)
    loaded = amxopt.load(tmp_path / "artifact", off)
    with torch.no_grad():
        loaded(**inputs)
    fresh = amxopt.optimize(models.build_model("tiny-wan", torch.float32), inputs, off)
    assert loaded.report.counts() == fresh.report.counts() and sum(fresh.report.counts().values()) > 0
    assert not any("ATen is faster" in left.detail for left in loaded.report.left), str(loaded.report)


@pytest.mark.parametrize("content", ["[]", "null", '{"k": [1.0]}', '{"k": "fast"}', '{"k": [1.0', b"\xff\xfe{"])
def test_a_damaged_decision_file_is_timed_again(tmp_path, content):
    path = tmp_path / "kernel_choices.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    _autotune.reload()
    opt, _ = _optimize(_model(), tmp_path)
    assert len(opt.report.choices) == 6 and not any("[cached]" in t for _, t in opt.report.choices)


@pytest.mark.parametrize("value", [[1.0], [-3.0, 1.0], [0, 0], "fast"])
def test_a_damaged_decision_is_timed_again(tmp_path, monkeypatch, value):
    # Under the keys a lookup reads (the test above writes "k", which none does).
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (1.0, 3.0))
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path))
    _autotune.reload()
    assert not _autotune.compare("linear 1x2x3", config, lambda: (None, None)).cached
    path = tmp_path / "kernel_choices.json"
    path.write_text(json.dumps(dict.fromkeys(json.loads(path.read_text()), value)))
    _autotune.reload()
    timing = _autotune.compare("linear 1x2x3", config, lambda: (None, None))
    assert not timing.cached and (timing.amxopt_ms, timing.aten_ms) == (1.0, 3.0)
    _autotune.reload()


@pytest.mark.parametrize(
    "change",
    [
        lambda mp: mp.setattr(torch, "__version__", "0.0.0"),
        lambda mp: mp.setattr(native, "cpu_model", lambda: "another CPU"),
        lambda mp: mp.setattr(_autotune, "_POLICY", "another rule"),
        lambda mp: mp.setattr(native, "active_tier", lambda: "another tier"),
        lambda mp: mp.setattr(native, "amx_schedule", lambda: "rows"),
    ],
    ids=["torch", "cpu", "policy", "tier", "process-schedule"],
)
def test_a_decision_holds_for_the_context_it_was_timed_in(tmp_path, monkeypatch, change):
    monkeypatch.setattr(_autotune, "_time", lambda run_amxopt, run_aten: (1.0, 3.0))
    config = amxopt.AmxConfig(provider="native", autotune_cache=str(tmp_path))
    _autotune.reload()
    assert not _autotune.compare("linear 1x2x3", config, lambda: (None, None)).cached
    assert _autotune.compare("linear 1x2x3", config, lambda: (None, None)).cached  # (in memory, as a second optimize)
    _autotune._build_context.cache_clear()
    try:
        with monkeypatch.context() as mp:
            change(mp)
            _autotune._build_context.cache_clear()
            assert not _autotune.compare("linear 1x2x3", config, lambda: (None, None)).cached
    finally:
        _autotune._build_context.cache_clear()
        _autotune.reload()


def test_decisions_of_two_processes_are_merged_not_lost(tmp_path):
    # This process read the file; another stored a decision since; this one's store keeps both.
    path = tmp_path / "kernel_choices.json"
    _autotune.reload()
    _autotune._store(path, "mine-1", [1.0, 2.0])
    others = json.loads(path.read_text()) | {"theirs": [3.0, 4.0]}
    path.write_text(json.dumps(others))
    _autotune._store(path, "mine-2", [5.0, 6.0])
    assert set(json.loads(path.read_text())) == {"mine-1", "theirs", "mine-2"}
    _autotune.reload()


def test_decisions_hold_for_the_isa_settings_they_were_timed_under(monkeypatch):
    before = _autotune.context()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    _autotune._build_context.cache_clear()
    try:
        assert _autotune.context() != before and "ONEDNN_MAX_CPU_ISA=AVX2" in _autotune.context()
    finally:
        monkeypatch.undo()
        _autotune._build_context.cache_clear()
    assert _autotune.context() == before


@pytest.mark.parametrize("xdg", ["", "relative/cache"])
def test_the_cache_is_never_under_the_working_directory(monkeypatch, xdg):
    # The XDG spec ignores an empty or relative XDG_CACHE_HOME; "~" in autotune_cache is the home.
    monkeypatch.setenv("XDG_CACHE_HOME", xdg)
    monkeypatch.setenv("HOME", "/home/someone")
    assert amxopt.AmxConfig().cache_dir() == pathlib.Path("/home/someone/.cache/amxopt")
    assert amxopt.AmxConfig(autotune_cache="~/mine").cache_dir() == pathlib.Path("/home/someone/mine")


def test_a_cache_that_cannot_be_written_is_told_once_and_says_why(tmp_path, caplog):
    # Once per decision before (dozens for a real model); a directory that is a file was "File exists".
    (tmp_path / "choices").write_text("")
    (tmp_path / "graphs").write_text("")
    _autotune.reload()
    with caplog.at_level("WARNING", logger="amxopt"):
        opt, _ = _optimize(_model(), tmp_path / "choices", graph_cache=False, isolate_capture=False)  # (its log)
        _optimize(_model(), tmp_path, isolate_capture=False)
    assert len(opt.report.choices) == 6
    choices = [r.getMessage() for r in caplog.records if "could not save kernel choices" in r.getMessage()]
    assert len(choices) == 1 and f"{tmp_path / 'choices'} is a file, not a directory" in choices[0], choices
    graphs = [r.getMessage() for r in caplog.records if "could not write the graph cache" in r.getMessage()]
    assert graphs and f"{tmp_path / 'graphs'} is a file, not a directory" in graphs[0], graphs
