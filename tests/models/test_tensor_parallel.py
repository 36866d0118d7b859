"""Tensor parallelism: every family at tp 2 and 3 equals tp 1, padded heads included; the runner's errors.

The ranks are real processes on torch.distributed (gloo); tp 3 oversubscribes this machine's cores
on purpose. Head counts are chosen so that padding is needed: 16 heads at tp 3, 20 at tp 3, 5 at tp 2.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st

import amxopt
from amxopt import models
from amxopt.capture import prepare
from amxopt.passes import run_passes
from amxopt.passes._graph import fetch
from amxopt.runtime import build_graph, max_abs_error, tp
from tests.helpers import CONFIG, captured

_shard = sys.modules["amxopt.passes.shard_tensor_parallel"]

# (zoo name, config overrides, units sharded per block)
FAMILIES = {
    "qwen3-vl-16-heads": ("tiny-qwen3-vl-vision", {"hidden_size": 128, "num_heads": 16}, 2),
    "qwen3-omni-vision": ("tiny-qwen3-omni-vision", {}, 2),
    "omni-audio-20-heads": ("tiny-qwen3-omni-audio", {"d_model": 80, "encoder_attention_heads": 20}, 2),
    "wan-5-heads": ("tiny-wan", {"num_attention_heads": 5, "attention_head_dim": 16}, 3),
}


def _model(case: str, dtype: torch.dtype) -> torch.nn.Module:
    name, overrides, _ = FAMILIES[case]
    model = models.build_model(name, dtype, **overrides)
    # The row-parallel bias is added once, on rank 0: its own values, apart from the zoo's seeded ones.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=generator))
        if name == "tiny-wan":  # q and k of block 0 small enough that their RMSNorms' eps counts (a
            for linear in (model.blocks[0].attn1.to_q, model.blocks[0].attn1.to_k):  # shard without it: 0.45 off)
                linear.weight.mul_(1e-3), linear.bias.mul_(1e-3)
    return model


def _blocks(model: torch.nn.Module) -> int:
    return len(model.blocks if hasattr(model, "blocks") else model.layers)


# Every family at tp 2; at tp 3 (padded heads) Wan, whose RMSNorm across heads becomes a sum of
# squares across ranks: the other families run tp 3 in bf16 below.
@pytest.mark.parametrize("case,tp_size", [*((case, 2) for case in FAMILIES), ("wan-5-heads", 3)])
def test_fp32_shards_equal_one_rank(case, tp_size):
    name, _, per_block = FAMILIES[case]
    model = _model(case, torch.float32)
    inputs = models.example_inputs(name, torch.float32)
    single = amxopt.optimize(model, inputs, CONFIG)
    sharded = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=tp_size))
    try:
        with torch.no_grad():
            want, got = single(**inputs), sharded(**inputs)
        assert type(got) is type(want)
        for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
            torch.testing.assert_close(a, b)
        note = f"tensor parallel (tp {tp_size}, rank 0): {per_block * _blocks(model)} attention/MLP units sharded"
        assert any(note in n for n in sharded.report.notes), sharded.report.notes
    finally:
        sharded.close()


@pytest.mark.parametrize("case", list(FAMILIES))
def test_bf16_shards_within_eager_error(case):
    name, _, _ = FAMILIES[case]
    reference = _model(case, torch.float32)
    model = _model(case, torch.bfloat16)
    inputs32 = models.example_inputs(name, torch.float32)
    inputs = models.example_inputs(name, torch.bfloat16)
    sharded = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=3))
    try:
        with torch.no_grad():
            expected = reference(**inputs32)
            eager_err = max_abs_error(model(**inputs), expected)
            err = max_abs_error(sharded(**inputs), expected)
        assert err <= 1.5 * eager_err, f"{case}: tp 3 {err:.3e} vs eager bf16 {eager_err:.3e}"
    finally:
        sharded.close()


@pytest.mark.parametrize("fuse_residual", [True, False])
def test_lora_adapters_on_column_linears_are_sharded_with_them(fuse_residual):
    # B of an unmerged adapter on to_q ends the A -> B pair and joins q's heads: a column of the
    # attention, sliced once; fused as to_q's residual, the add is un-fused and sharded alike.
    peft = pytest.importorskip("peft")
    name, overrides, per_block = FAMILIES["wan-5-heads"]
    model = _model("wan-5-heads", torch.float32)
    targets = ["to_q", "to_k", "to_v", "net.0.proj"]
    model = peft.inject_adapter_in_model(peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False), model)
    inputs = models.example_inputs(name, torch.float32)
    config = dataclasses.replace(CONFIG, tp=2, fuse_residual=fuse_residual)
    sharded = amxopt.optimize(model.eval(), inputs, config)
    try:
        with torch.no_grad():
            want, got = model(**inputs), sharded(**inputs)
        torch.testing.assert_close(got.sample, want.sample)
        note = f"tensor parallel (tp 2, rank 0): {per_block * _blocks(model)} attention/MLP units sharded"
        assert any(note in n for n in sharded.report.notes), sharded.report.notes
    finally:
        sharded.close()


@given(heads=st.integers(1, 64), tp_size=st.integers(1, 8), unit=st.integers(1, 4), outer=st.integers(1, 3))
def test_padded_heads_cover_every_head_once_and_pad_with_zeros(heads, tp_size, unit, outer):
    shards = [_shard.owned_heads(heads, tp_size, r) for r in range(tp_size)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) * tp_size == _shard.padded(heads, tp_size)
    assert sorted(h for s in shards for h in s if h is not None) == list(range(heads))
    assert _shard.padded(heads, tp_size) - heads < tp_size
    # Sliced weights: each rank's rows are the real heads' rows, zeros for padding; all ranks together
    # hold every row exactly once.
    weight = torch.arange(outer * heads * unit, dtype=torch.float32)[:, None] + 1
    rows = []
    for r, owned in enumerate(shards):
        layout = _shard.Layout(0, heads, unit, outer, tuple(owned))
        part = _shard.gather(weight, 0, layout.index())
        assert part.shape[0] == layout.local_size == outer * len(owned) * unit
        pads = sum(h is None for h in owned) * unit * outer
        assert int((part == 0).sum()) == pads
        rows += part[part != 0].tolist()
    assert sorted(rows) == weight.flatten().tolist()


@given(q_heads=st.integers(1, 48), group=st.sampled_from([1, 2, 4, 8]), tp_size=st.integers(1, 6))
def test_kv_heads_serve_each_local_q_head(q_heads, group, tp_size):
    if q_heads % group:
        q_heads *= group
    kv_heads = q_heads // group
    for r in range(tp_size):
        q = _shard.owned_heads(q_heads, tp_size, r)
        kv = _shard.owned_kv_heads(q_heads, kv_heads, tp_size, r)
        assert len(q) % len(kv) == 0
        local_group = len(q) // len(kv)
        for j, h in enumerate(q):  # local q head j reads local kv head j // local_group
            if h is not None:
                assert kv[j // local_group] == h // group


def test_padding_heads_get_zero_weights_on_the_rank_that_holds_them():
    """5 heads at tp 2: rank 1 owns heads 3, 4 and one padding head. Its column-parallel rows and
    bias for that head and its row-parallel columns are zero, and only rank 0 adds the row bias."""
    model = _model("wan-5-heads", torch.float32)
    gm, _ = captured(model, models.example_inputs("tiny-wan", torch.float32))
    passes = tuple(p for p in amxopt.passes.PASSES if p != "pack_weights")
    config = dataclasses.replace(CONFIG, passes=passes, tp=2, tp_rank=1, tp_group="unused")
    run_passes(gm, config)
    linears = [n for n in gm.graph.nodes if n.target == torch.ops.amxopt.linear.default]
    attention_out = [n for n in linears if "attn1.to_out" in str(n.meta.get("nn_module_stack"))][0]
    to_q = [n for n in linears if "attn1.to_q" in str(n.meta.get("nn_module_stack"))][0]
    head_dim, pad = 16, slice(32, 48)  # local head 2 of 3 is the padding one
    w_q = fetch(gm, to_q.args[1].args[0].target)
    assert w_q.shape[0] == 3 * head_dim and to_q.args[4] == 3 * head_dim
    assert torch.count_nonzero(w_q[pad]) == 0 and torch.count_nonzero(w_q[:32]) > 0
    assert torch.count_nonzero(fetch(gm, to_q.args[2].target)[pad]) == 0
    w_o = fetch(gm, attention_out.args[1].args[0].target)
    assert w_o.shape[1] == 3 * head_dim and torch.count_nonzero(w_o[:, pad]) == 0
    assert attention_out.args[2] is None  # the bias is rank 0's
    reduce = [u.target for u in attention_out.users]
    assert reduce == [torch.ops._c10d_functional.all_reduce.default]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="tp must be a positive int"):
        amxopt.optimize(models.build_model("tiny-wan"), None, dataclasses.replace(CONFIG, tp=0))
    with pytest.raises(ValueError, match="names cores"):
        tp.cpu_plan(2, [[0], [4096]])
    with pytest.raises(ValueError, match="gives core 0 to ranks 0 and 1"):
        tp.cpu_plan(2, [[0], [0]])
    with pytest.raises(ValueError, match="one entry of cores per rank"):
        tp.cpu_plan(2, [[0]])
    assert len(tp.cpu_plan(5)) == 5  # more ranks than cores: allowed, with a warning


def test_torchrun_ranks_a_launcher_pinned_apart_keep_their_cores():
    # Every rank may use the same cores: each binds its part. Pinned apart: each keeps its own.
    allowed = sorted(os.sched_getaffinity(0))
    assert tp._rank_cores(allowed, [allowed, allowed], 1, CONFIG) == tp.cpu_plan(2)[1]
    assert tp._rank_cores([1], [[0], [1]], 1, CONFIG) == (1,)
    # Overlapping sets are not a launcher's pinning: the plan splits them.
    assert tp._rank_cores(allowed, [allowed, allowed[:1]], 0, CONFIG) == tp.cpu_plan(2)[0]
    model, inputs = models.build_model("tiny-wan"), models.example_inputs("tiny-wan")
    amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, keep_source=False))
    with pytest.raises(ValueError, match="released by an earlier amxopt.optimize"):  # a worker got meta weights
        amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2))


def test_a_dead_rank_fails_the_call_with_its_exit_code():
    model = _model("qwen3-omni-vision", torch.float32)
    inputs = models.example_inputs("tiny-qwen3-omni-vision", torch.float32)
    sharded = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2, tp_timeout_s=60))
    worker = sharded._workers[0]
    worker.kill()
    worker.join()
    with pytest.raises(RuntimeError, match="rank 1 exited with code"):
        sharded(**inputs)
    with pytest.raises(RuntimeError, match="closed"):
        sharded(**inputs)
    assert not worker.is_alive()


_UNGUARDED = """
import sys
sys.path.insert(0, {root!r})
import torch, amxopt
from amxopt import models
name = "tiny-qwen3-omni-vision"
amxopt.optimize(models.build_model(name), models.example_inputs(name), amxopt.AmxConfig(tp=2, tp_timeout_s=60))
"""


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path):
    # A spawned worker imports the script first: without the guard it tries to start workers itself.
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED.format(root=os.getcwd()))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "rank 1 exited with code 1 before reaching amxopt's code" in run.stderr
    assert 'under `if __name__ == "__main__":`' in run.stderr


_FROM_STDIN = """
import sys
sys.path.insert(0, {root!r})
import torch, amxopt
from amxopt import models
from amxopt.runtime.compare import max_abs_error
if __name__ == "__main__":
    name = "tiny-qwen3-omni-vision"
    model, inputs = models.build_model(name), models.example_inputs(name)
    sharded = amxopt.optimize(model, inputs, amxopt.AmxConfig(tp=2, tp_timeout_s=60, keep_source=True))
    with torch.no_grad():
        print("error", max_abs_error(sharded(**inputs), model(**inputs)))
    sharded.close()
"""


def test_a_script_read_from_stdin_runs_with_tp():
    # Its __file__ is "<stdin>": a worker ran that missing path and died, told to add the guard it had.
    run = subprocess.run(
        [sys.executable, "-"], input=_FROM_STDIN.format(root=os.getcwd()), capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert float(run.stdout.split("error")[1]) < 1e-4


def test_a_model_class_of_a_main_program_without_a_file_is_refused_before_starting_workers(monkeypatch):
    # python -c, a notebook: a worker cannot import the class to unpickle the model.
    main = types.ModuleType("__main__")
    monkeypatch.setitem(sys.modules, "__main__", main)
    block = type("LocalBlock", (torch.nn.Module,), {"forward": lambda self, x: x * 2, "__module__": "__main__"})
    with pytest.raises(RuntimeError, match="LocalBlock is defined in a main program that is no file"):
        amxopt.optimize(torch.nn.Sequential(block()).eval(), (torch.randn(2, 4),), dataclasses.replace(CONFIG, tp=2))


def test_a_hung_rank_fails_the_call_within_the_timeout():
    model = _model("qwen3-omni-vision", torch.float32)
    inputs = models.example_inputs("tiny-qwen3-omni-vision", torch.float32)
    sharded = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2, tp_timeout_s=8))
    worker = sharded._workers[0]
    os.kill(worker.pid, signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel call failed"):
            sharded(**inputs)
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert time.monotonic() - start < 60
    worker.join(timeout=30)
    assert not worker.is_alive()


_TORCHRUN_SCRIPT = """
import dataclasses, sys, torch, torch.distributed as dist
import torch.utils._pytree as pytree
import amxopt
from amxopt import models
sys.path.insert(0, {root!r})
from tests.helpers import CONFIG
model = models.build_model("tiny-qwen3-omni-audio", torch.float32, d_model=80, encoder_attention_heads=20)
inputs = models.example_inputs("tiny-qwen3-omni-audio", torch.float32)
one = amxopt.optimize(model, inputs, CONFIG)
opt = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp="env"))
with torch.no_grad():
    for a, b in zip(pytree.tree_leaves(opt(**inputs)), pytree.tree_leaves(one(**inputs))):
        torch.testing.assert_close(a, b)
assert any("tensor parallel (tp 2, rank " in n for n in opt.report.notes), opt.report.notes
with open({out!r} + f"/rank{{dist.get_rank()}}.txt", "w") as f:  # one file a rank: their stdout interleaves
    f.write(f"ok {{sorted(__import__('os').sched_getaffinity(0))}}")
dist.destroy_process_group()
"""


def test_torchrun_ranks_with_tp_env(tmp_path):
    import pathlib
    import subprocess

    root = str(pathlib.Path(__file__).resolve().parents[2])
    script = tmp_path / "rank.py"
    script.write_text(_TORCHRUN_SCRIPT.format(root=root, out=str(tmp_path)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(tp._free_port()),
           str(script)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    plan = tp.cpu_plan(2)  # each rank bound to its share of the cores
    for rank in range(2):
        assert (tmp_path / f"rank{rank}.txt").read_text() == f"ok {sorted(plan[rank])}"


class _GQABlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, heads * self.head_dim)
        self.kv = torch.nn.Linear(dim, 2 * kv_heads * self.head_dim)
        self.o = torch.nn.Linear(heads * self.head_dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class GQAModel(torch.nn.Module):
    """Two GQA blocks: 8 q / 2 kv heads (both divide tp 2: kv split alongside) and 6 q / 3 kv heads
    (kv does not divide: each rank keeps the kv head of each of its q heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_GQABlock(48, 8, 2), _GQABlock(48, 6, 3)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("attention", ["amxopt", "aten"])
def test_gqa_kv_heads_split_or_kept_per_q_head(attention):
    """Both with amxopt.varlen_attention and with ATen's SDPA (what autotune keeps where ATen is faster)."""
    torch.manual_seed(0)
    model = GQAModel().eval()
    x = torch.randn(2, 10, 48)
    passes = None if attention == "amxopt" else tuple(p for p in amxopt.passes.PASSES if p != "replace_attention")
    _check_shards(model, x, dataclasses.replace(CONFIG, tp=2, passes=passes), units=2)


def _check_shards(model, x, config, units: int) -> None:
    """``units`` units sharded, and the ranks' output that of ``model``."""
    sharded = amxopt.optimize(model, (x,), config)
    try:
        assert any(f"{units} attention/MLP units sharded" in n for n in sharded.report.notes), sharded.report.notes
        with torch.no_grad():
            torch.testing.assert_close(sharded(x), model(x))
    finally:
        sharded.close()


class _FlippedQ(_GQABlock):
    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).flip(-1).view(b, s, self.heads, self.head_dim).transpose(1, 2)  # flip: unknown to the pass
        k, v = self.kv(x).view(b, s, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


def test_an_attention_the_pass_cannot_follow_is_replicated_and_reported():
    model = GQAModel().eval()
    model.blocks[1] = _FlippedQ(48, 6, 3)
    x = torch.randn(2, 10, 48)
    adapter, graph_inputs = prepare(model, (x,))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=1, tp_group="unused")
    report = build_graph(model, adapter, graph_inputs, config).report
    assert any("1 attention/MLP units sharded" in n for n in report.notes), report.notes
    assert any("replicated across tp ranks" in n and "flip" in n for n in report.notes), report.notes


def test_the_report_counts_the_all_reduces_a_shard_runs():
    # Wan's q/k RMSNorm spans all heads: each sharded attention adds an all-reduce per norm.
    model = _model("wan-5-heads", torch.float32)
    adapter, graph_inputs = prepare(model, models.example_inputs("tiny-wan", torch.float32))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=0, tp_group="unused")
    graph = build_graph(model, adapter, graph_inputs, config)
    reduces = sum(1 for n in graph.captured.gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default)
    units = 3 * _blocks(model)
    assert reduces > units
    assert any(f"{units} attention/MLP units sharded, {reduces} all-reduces" in n for n in graph.report.notes)
    # The shapes the dumps print are this rank's: they kept the whole model's (a Linear of 96 columns
    # shown as 192, a 2-head view as 4 heads).
    gm = graph.captured.gm
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            assert n.meta["val"].shape == fetch(gm, n.target).shape, n.name
        elif n.target is torch.ops.amxopt.linear.default:
            assert n.meta["val"].shape[-1] == n.args[4], n.name
    # the q/k norms it decomposed are in the table, left as ATen, not gone from it
    one = build_graph(model, adapter, graph_inputs, dataclasses.replace(CONFIG, tp=1))
    norms = one.report.counts()["rms_norm"]
    assert norms == 4 * _blocks(model) and graph.report.left_counts()["rms_norm"] == norms  # q, k of attn1, attn2
    assert "a local sum of squares, all-reduced" in str(graph.report)


class _MQABlock(torch.nn.Module):
    """8 q heads, one kv head: ``view(b, s, 1, d)`` also fits the last dim of the heads' layout."""

    def __init__(self, dim: int = 48, heads: int = 8) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, self.head_dim)
        self.v = torch.nn.Linear(dim, self.head_dim)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k, v = (f(x).view(b, s, 1, self.head_dim).transpose(1, 2) for f in (self.k, self.v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class _NormedKBlock(torch.nn.Module):
    """6 q / 3 kv heads with an RMSNorm over all k heads (as Wan's norm_k): at tp 2 each rank keeps a kv
    head twice, which an all-reduced sum of squares would count twice."""

    def __init__(self, dim: int = 48, heads: int = 6, kv_heads: int = 3) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.q = torch.nn.Linear(dim, dim)
        self.k = torch.nn.Linear(dim, kv_heads * self.head_dim)
        self.v = torch.nn.Linear(dim, kv_heads * self.head_dim)
        self.norm_k = torch.nn.RMSNorm(kv_heads * self.head_dim, eps=1e-6)
        self.o = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.norm_k(self.k(x)).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v(x).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class _LayerNormedKBlock(_NormedKBlock):
    """6 q / 6 kv heads with a LayerNorm over all k heads: its mean and variance span the ranks' shards,
    which a local sum of squares, all-reduced (an RMSNorm's), does not give."""

    def __init__(self) -> None:
        super().__init__(kv_heads=6)
        self.norm_k = torch.nn.LayerNorm(48, eps=1e-6)


class _OwnResidualMLP(torch.nn.Module):
    """``h + fc2(h)``: replace_linear fuses h, the row Linear's own (sharded) input, as its residual."""

    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.fc1(x))
        return h + self.fc2(h)


class _GainedMLP(torch.nn.Module):
    """``fc2(gelu(fc1(x)) * gain)``: a replicated parameter across the hidden dim the shard splits."""

    def __init__(self, dim: int = 48, hidden: int = 96) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)
        self.gain = torch.nn.Parameter(torch.randn(hidden))

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)) * self.gain)


class _FusedGateUpMLP(torch.nn.Module):
    """One Linear computing gate and up, sliced apart: not elementwise between the Linears."""

    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.gate_up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        gate_up = self.gate_up(x)
        gate, up = gate_up[..., : gate_up.shape[-1] // 2], gate_up[..., gate_up.shape[-1] // 2 :]
        return x + self.down(torch.nn.functional.silu(gate) * up)


class _Blocks(torch.nn.Module):
    def __init__(self, *blocks: torch.nn.Module) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x, note=None):  # note: an argument a call may pass anything in
        for block in self.blocks:
            x = block(x)
        return x


class _BetweenResidualMLP(torch.nn.Module):
    """``g + fc2(g)`` with ``g`` computed between the Linears (not fused into the column Linear)."""

    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        g = torch.tanh(self.fc1(x)) * 0.5
        return g + self.fc2(g)


class _DividedMLP(torch.nn.Module):
    """``fc2(tanh(u) / u)``, finite for u != 0: a padding column's u is 0, and 0 / 0 is NaN."""

    def __init__(self, dim: int = 48, hidden: int = 5) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        u = self.fc1(x)
        return x + self.fc2(torch.tanh(u) / u)


class _NotFiniteAtZeroMLP(torch.nn.Module):
    """``fc2(f(x, u))`` with ``u = fc1(x)`` of 5 columns, where ``f`` maps a padding column's zero
    to inf or NaN: a replicated value over u, a negative power of u, rsqrt."""

    def __init__(self, f, dim: int = 48, hidden: int = 5) -> None:
        super().__init__()
        self.f, self.fc1, self.fc2 = f, torch.nn.Linear(dim, hidden), torch.nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.fc2(self.f(x, self.fc1(x)))


class _MaskedAttentionBlock(torch.nn.Module):
    """4 heads with a mask per head (``[B, H, S, S]``): a shard's heads do not match its heads dim."""

    def __init__(self, dim: int = 48, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv, self.o = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        mask = torch.ones(b, self.heads, s, s, dtype=torch.bool).tril()
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class _ActivatedRowMLP(torch.nn.Module):
    """``x + gelu(fc2(gelu(fc1(x))))``: the row Linear's gelu, fused into it, must follow the all-reduce."""

    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x))))


class _SlicedQKVBlock(_MaskedAttentionBlock):
    """One Linear computing q, k and v, sliced apart by features (no mask): a shard holds parts of all three."""

    def forward(self, x):
        b, s, c = x.shape
        qkv = self.qkv(x)
        q, k, v = (
            qkv[..., i * c : (i + 1) * c].reshape(b, s, self.heads, self.head_dim).transpose(1, 2) for i in range(3)
        )
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(o.transpose(1, 2).reshape(b, s, c))


class _SinkKVBlock(torch.nn.Module):
    """Learned kv tokens (replicated parameters) concatenated to k and v (sharded by heads) along the sequence."""

    def __init__(self, dim: int = 48, heads: int = 4, sinks: int = 2) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.k_sink = torch.nn.Parameter(torch.randn(1, heads, sinks, self.head_dim))
        self.v_sink = torch.nn.Parameter(torch.randn(1, heads, sinks, self.head_dim))

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (f(x).view(b, s, self.heads, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        k = torch.cat([k, self.k_sink.expand(b, -1, -1, -1)], dim=2)
        v = torch.cat([v, self.v_sink.expand(b, -1, -1, -1)], dim=2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class _ZeroEpsHeadNormBlock(torch.nn.Module):
    """3 heads (padded to 4 at tp 2) with a per-head norm of q and k with eps 0: 0 * rsqrt(0) on the padding."""

    def __init__(self, dim: int = 48, heads: int = 3, norm=torch.nn.RMSNorm) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = norm(self.head_dim, eps=0.0), norm(self.head_dim, eps=0.0)

    def forward(self, x):
        b, s, _ = x.shape
        q = self.norm_q(self.q(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        k = self.norm_k(self.k(x).view(b, s, self.heads, self.head_dim)).transpose(1, 2)
        v = self.v(x).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.o(o.transpose(1, 2).reshape(b, s, -1))


class _ComputedBiasMLP(torch.nn.Module):
    """A bias scaled by the input (a conditioned bias): a shard would slice it, or add it on every rank."""

    def __init__(self, which: str, dim: int = 48) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.which = which

    def forward(self, x):
        b1, b2 = (
            f.bias * x.mean() if self.which == name else f.bias for f, name in ((self.fc1, "fc1"), (self.fc2, "fc2"))
        )
        h = torch.nn.functional.gelu(torch.nn.functional.linear(x, self.fc1.weight, b1))
        return x + torch.nn.functional.linear(h, self.fc2.weight, b2)


_UNSHARDABLE = {  # block, what the report says of it
    # untested: the padding column's NaN, all-reduced, made every output NaN
    "a division of padded columns": (_DividedMLP, "5 columns are padded to 6 at tp 2, and div"),
    # untested: a check of the numerator's layout instead of the denominator's, and a negative power
    # taken as safe, passed these (NaN at tp 2)
    "a division by padded columns": (
        functools.partial(_NotFiniteAtZeroMLP, lambda x, u: x.pow(2).mean(-1, keepdim=True) / u),
        "5 columns are padded to 6 at tp 2, and div",
    ),
    "a negative power of padded columns": (
        functools.partial(_NotFiniteAtZeroMLP, lambda x, u: torch.tanh(u) * u.pow(-1.0)),
        "5 columns are padded to 6 at tp 2, and pow",
    ),
    "rsqrt of padded columns": (
        functools.partial(_NotFiniteAtZeroMLP, lambda x, u: torch.tanh(u) * torch.rsqrt(u * u)),
        "5 columns are padded to 6 at tp 2, and rsqrt",
    ),
    # untested: sharded, every call failed (a mask of 4 heads against a shard's 2)
    "an attention mask": (_MaskedAttentionBlock, "has an attention mask"),
    "one kv head": (_MQABlock, "do not reach the attention along its heads dim"),
    "norm across duplicated kv heads": (_NormedKBlock, "kv heads that ranks keep per q head"),
    "LayerNorm across heads": (_LayerNormedKBlock, "a LayerNorm across heads"),
    "residual is the row's input": (_OwnResidualMLP, "adds a sharded residual"),
    # untested: sharded, every call failed (48 against 24)
    "residual computed between the Linears": (_BetweenResidualMLP, "adds a sharded residual"),
    "fused gate and up": (_FusedGateUpMLP, "the ops between its Linears are not all elementwise (aten.slice"),
    # untested: sharded, every call failed (48 against 96)
    "replicated operand across the hidden dim": (_GainedMLP, "spans the sharded dim"),
    # untested: gelu of each rank's partial sum (0.127 off eager at tp 2); every call failed
    "activation fused into the row Linear": (_ActivatedRowMLP, "has a fused gelu (it must follow the all-reduce)"),
    "q, k and v sliced from one Linear": (_SlicedQKVBlock, "slices or concatenates along the sharded dim"),
    # untested: every output NaN at tp 2 (helper review, stop 61)
    "per-head RMSNorm with eps 0": (_ZeroEpsHeadNormBlock, "3 heads are padded to 4 at tp 2, and rms_norm"),
    "per-head LayerNorm with eps 0": (
        functools.partial(_ZeroEpsHeadNormBlock, norm=torch.nn.LayerNorm),
        "3 heads are padded to 4 at tp 2, and layer_norm",
    ),
    # untested (helper reviews, stops 60 and 61): a rank's heads beside every head's sinks
    "kv sink tokens concatenated to sharded heads": (_SinkKVBlock, "concatenates sharded and replicated tensors"),
    # untested: optimize() raised TypeError ('str' object is not callable) at tp 2
    "column bias computed in the graph": (functools.partial(_ComputedBiasMLP, "fc1"), "is computed in the graph"),
    "row bias computed in the graph": (functools.partial(_ComputedBiasMLP, "fc2"), "is computed in the graph"),
}


@pytest.mark.parametrize("case", list(_UNSHARDABLE))
def test_units_a_shard_would_get_wrong_are_replicated_and_reported(case):
    block, reason = _UNSHARDABLE[case]
    torch.manual_seed(0)
    model = _Blocks(block()).eval()
    x = torch.randn(2, 10, 48)
    adapter, graph_inputs = prepare(model, (x,))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=0, tp_group="unused")
    report = build_graph(model, adapter, graph_inputs, config).report
    assert any("replicated across tp ranks" in n and reason in n for n in report.notes), report.notes
    assert not any("units sharded" in n for n in report.notes), report.notes


class _PlainMLP(torch.nn.Module):
    def __init__(self, dim: int = 48) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _CountingBlocks(torch.nn.Module):
    """Counts its calls in a buffer, written in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([_PlainMLP()])
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.blocks[0](x) * self.calls


def test_a_model_that_writes_its_buffers_is_refused_at_tp():
    # Each rank wrote the buffer the ranks share with the caller's model: counted twice per call, the
    # output 10.65 off eager, and the next call refused as if the user had changed a weight (helper
    # review, stop 61). Shape propagation in the pass wrote it too, at optimize().
    torch.manual_seed(0)
    model, x = _CountingBlocks().eval(), torch.randn(2, 10, 48)
    adapter, graph_inputs = prepare(model, (x,))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=0, tp_group="unused")
    with pytest.raises(ValueError, match=r"tp 2 cannot run a model that writes its own tensor calls in forward"):
        build_graph(model, adapter, graph_inputs, config)
    assert model.calls.item() == 0


class _Held(torch.nn.Module):
    """Two MLP blocks in a ModuleList named ``holder``."""

    def __init__(self, holder: str) -> None:
        super().__init__()
        self.holder = holder
        setattr(self, holder, torch.nn.ModuleList([_PlainMLP(), _PlainMLP()]))

    def forward(self, x):
        for block in getattr(self, self.holder):
            x = block(x)
        return x


@pytest.mark.parametrize("holder", ["blocks", "block", "resblocks", "h", "layer", "sequential"])
def test_blocks_are_found_under_their_usual_names_and_a_model_without_them_says_so(holder):
    # T5's "block" and open_clip's "resblocks" were not blocks: tp sharded nothing, and nothing said so.
    model = torch.nn.Sequential(_PlainMLP(), _PlainMLP()) if holder == "sequential" else _Held(holder)
    adapter, graph_inputs = prepare(model.eval(), (torch.randn(2, 10, 48),))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=0, tp_group="unused")
    notes = build_graph(model, adapter, graph_inputs, config).report.notes
    expected = "tp found no unit to shard" if holder == "sequential" else "2 attention/MLP units sharded"
    assert any(expected in n for n in notes), notes


def test_a_shard_keeps_its_slices_not_the_whole_weights():
    # The whole weights the slices came from stayed in each rank's graph, unread: more memory per
    # rank than the unsharded model, and no test measured it.
    model = _Blocks(_PlainMLP(), _PlainMLP()).eval()
    adapter, graph_inputs = prepare(model, (torch.randn(2, 10, 48),))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=0, tp_group="unused")
    gm = build_graph(model, adapter, graph_inputs, config).captured.gm
    held = sum(t.numel() for t in (*gm.parameters(), *gm.buffers()))
    fcs = sum(p.numel() for n, p in model.named_parameters() if ".weight" in n)
    assert held <= sum(p.numel() for p in model.parameters()) - fcs // 2, (held, fcs)


def test_a_division_of_columns_that_need_no_padding_is_sharded():
    model = _Blocks(_DividedMLP(hidden=6)).eval()
    adapter, graph_inputs = prepare(model, (torch.randn(2, 10, 48),))
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=1, tp_group="unused")
    report = build_graph(model, adapter, graph_inputs, config).report
    assert any("1 attention/MLP units sharded" in n for n in report.notes), report.notes


def test_a_norm_across_padded_heads_without_eps_is_sharded():
    # Wan's norm_q / norm_k span every head: their moments are all-reduced over the whole row, which the
    # padding's zeros leave finite. Only a per-head norm without eps is refused (review of stop 61's change).
    model = models.build_model("tiny-wan", torch.float32, num_attention_heads=5, attention_head_dim=16)
    for block in model.blocks:
        block.attn1.norm_q.eps = block.attn1.norm_k.eps = block.attn2.norm_q.eps = block.attn2.norm_k.eps = 0.0
    adapter, graph_inputs = prepare(model, models.example_inputs("tiny-wan", torch.float32))
    config = dataclasses.replace(CONFIG, tp=3, tp_rank=0, tp_group="unused")
    report = build_graph(model, adapter, graph_inputs, config).report
    assert any("6 attention/MLP units sharded" in n for n in report.notes), report.notes


@pytest.mark.parametrize("rank", range(4))
def test_every_rank_refuses_a_norm_across_kv_heads_kept_per_q_head(rank):
    """4 q / 2 kv heads at tp 4: each rank keeps one kv head, none twice, but each kv head is on two
    ranks; every rank must decide alike (from the head counts), or their all-reduces pair up wrongly."""
    model = _Blocks(_NormedKBlock(48, 4, 2)).eval()
    adapter, graph_inputs = prepare(model, (torch.randn(2, 10, 48),))
    config = dataclasses.replace(CONFIG, tp=4, tp_rank=rank, tp_group="unused")
    report = build_graph(model, adapter, graph_inputs, config).report
    assert any("kv heads that ranks keep per q head" in n for n in report.notes), report.notes


def test_a_recapture_of_released_weights_says_which_calls_need_keep_source():
    # A rank's second graph (another dtype, a shape outside the guards) must shard the weights again.
    model, inputs = models.build_model("tiny-wan"), models.example_inputs("tiny-wan")
    with torch.no_grad():
        amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, keep_source=False))(**inputs)
    adapter, graph_inputs = prepare(model, inputs)
    config = dataclasses.replace(CONFIG, keep_source=False, tp=2, tp_rank=0, tp_group="unused")
    with pytest.raises(RuntimeError, match=r"was released .* an input in another dtype, or a shape outside their"):
        build_graph(model, adapter, graph_inputs, config)


def test_a_rank_outside_tp_is_refused():
    model = _Blocks(_OwnResidualMLP()).eval()
    adapter, graph_inputs = prepare(model, (torch.randn(2, 10, 48),))
    with pytest.raises(ValueError, match="tp_rank 2 is not a rank of tp 2"):
        build_graph(model, adapter, graph_inputs, dataclasses.replace(CONFIG, tp=2, tp_rank=2, tp_group="unused"))


def test_replicated_units_and_autotune_across_ranks_give_the_model_output():
    """The unshardable blocks at tp 2 (real ranks), with autotune on: rank 0's decisions hold on every
    rank (``_autotune._agreed``), so the ranks build one graph and their collectives pair up."""
    torch.manual_seed(0)
    model = _Blocks(_MQABlock(), _NormedKBlock(), _OwnResidualMLP(), _GQABlock(48, 8, 2)).eval()
    x = torch.randn(2, 10, 48)
    _check_shards(model, x, dataclasses.replace(CONFIG, tp=2, autotune=True), units=1)


def _decide_on(rank: int, port: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    from amxopt.passes import _autotune

    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    config = dataclasses.replace(CONFIG, tp=2, tp_rank=rank, tp_group=dist.group.WORLD.group_name)
    with open(f"{out}/rank{rank}.txt", "w") as f:
        f.write(_autotune._agreed(config, lambda: f"decided on rank {rank}"))
    dist.destroy_process_group()


def test_rank_0_decides_for_every_rank(tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(_decide_on, args=(tp._free_port(), str(tmp_path)), nprocs=2)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["decided on rank 0"] * 2


def test_an_idle_module_and_a_failed_call_leave_it_usable(tmp_path):
    model = _model("qwen3-omni-vision", torch.float32)
    inputs = models.example_inputs("tiny-qwen3-omni-vision", torch.float32)
    sharded = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2, tp_timeout_s=5))
    try:
        os.kill(sharded._workers[0].pid, signal.SIGINT)  # a terminal's Ctrl-C reaches every process
        time.sleep(7)  # idle past tp_timeout_s: the workers' wait for a call has no timeout
        expected = pytree.tree_leaves(model(**inputs))
        for a, b in zip(pytree.tree_leaves(sharded(**inputs)), expected):
            torch.testing.assert_close(a, b)
        # What rank 0 alone would do wrong (the workers keep their own shards, or wait in collectives):
        with pytest.raises(RuntimeError, match="runs tensor-parallel"):
            model.load_state_dict(model.state_dict())
        with pytest.raises(RuntimeError, match="runs tensor-parallel"):
            model.blocks[0].mlp.linear_fc2 = torch.nn.Linear(1, 1)
        loads = []
        model.load_adapter = lambda *args, **kwargs: loads.append(kwargs)  # peft would write rank 0's adapter
        with pytest.raises(RuntimeError, match="runs tensor-parallel"):
            sharded.load_adapter(str(tmp_path / "adapter"), adapter_name="style", hotswap=True)
        assert not loads
        del model.load_adapter
        wants_grad = {k: v.requires_grad_() if k == "hidden_states" else v for k, v in inputs.items()}
        with pytest.raises(RuntimeError, match="hidden_states requires grad"):
            sharded(**wants_grad)
        inputs["hidden_states"] = inputs["hidden_states"].detach()
        assert sharded.state_dict().keys() == model.state_dict().keys()
        with pytest.raises(RuntimeError, match="needs every rank in step"):
            sharded.profile(inputs)
        with pytest.raises(RuntimeError, match="one shard of the weights per rank"):
            sharded.save(str(tmp_path))
        wide = {
            k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()
        }
        for a, b in zip(pytree.tree_leaves(sharded(**wide)), expected):  # eager casts it: every rank captures again
            torch.testing.assert_close(a, b)
        with pytest.raises((TypeError, ValueError), match="not_an_argument"):
            sharded(**inputs, not_an_argument=1)
        with pytest.raises(Exception) as failed:  # refused by check_inputs, before any rank runs it
            sharded(hidden_states=inputs["hidden_states"][:, :-1], grid_thw=inputs["grid_thw"])
        assert "tensor-parallel call failed" not in str(failed.value)
        for a, b in zip(pytree.tree_leaves(sharded(**inputs)), expected):
            torch.testing.assert_close(a, b)
        # A replicated norm weight given new data: rank 0's graph would read it, the workers their old copies
        # (0.021 off before the check covered every weight at tp).
        model.blocks[0].norm1.weight.data = model.blocks[0].norm1.weight.data + 1
        with pytest.raises(RuntimeError, match="runs tensor-parallel"):
            sharded(**inputs)
    finally:
        sharded.close()


class _MLPBlock(torch.nn.Module):
    """An MLP block whose capture fails in every process but ``fails_outside``'s: a worker's."""

    def __init__(self, fails_outside: int | None = None):
        super().__init__()
        self.fc1, self.fc2, self.fails_outside = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32), fails_outside

    def forward(self, x):
        if self.fails_outside is not None and os.getpid() != self.fails_outside:
            raise ValueError("this block cannot be captured in a worker")
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class _ReadInRank0Only:
    """Pickles, and unpickles in rank 0 only: as a class defined under a script's main guard."""

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def __reduce__(self):
        return _read_in_rank_0_only, (self.parent,)


def _read_in_rank_0_only(parent: int) -> _ReadInRank0Only:
    if os.getpid() != parent:
        raise AttributeError("Can't get attribute 'Note' on <module '__mp_main__'>")
    return _ReadInRank0Only(parent)


class _ReadInRank2Only(torch.Tensor):
    """A tensor that unpickles (as a plain one) everywhere but in rank 2: as an allocation that fails there."""

    def __reduce_ex__(self, protocol):
        return _read_but_in_rank_2, (self.as_subclass(torch.Tensor).clone(),)


def _read_but_in_rank_2(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() == 2:
        raise MemoryError("cannot allocate in rank 2 alone")
    return t


def test_an_argument_one_worker_cannot_read_is_run_by_no_rank():
    # Rank 1 read it and ran the call, alone in its collectives; the next call's message paired with them,
    # and the module closed after tp_timeout_s (review of stop 61's change).
    model, x = _Blocks(_MLPBlock(), _MLPBlock()).eval(), torch.randn(4, 32)
    sharded = amxopt.optimize(model, (x,), dataclasses.replace(CONFIG, tp=3, tp_timeout_s=10))
    try:
        with torch.no_grad():
            with pytest.raises(
                TypeError, match=r"\(rank 2: MemoryError: cannot allocate in rank 2 alone\); no rank ran it$"
            ):
                sharded(x.as_subclass(_ReadInRank2Only))
            for scale in (1, 2, 3):
                torch.testing.assert_close(sharded(x * scale), model(x * scale))
        sharded.close()
        assert [w.exitcode for w in sharded._workers] == [0, 0]  # stopped in step, by the stop message
    finally:
        sharded.close()


def test_an_argument_that_cannot_be_sent_is_refused_and_the_module_stays_usable():
    model, x = _Blocks(_MLPBlock(), _MLPBlock()).eval(), torch.randn(4, 32)
    sharded = amxopt.optimize(model, (x,), dataclasses.replace(CONFIG, tp=2))
    try:
        with pytest.raises(TypeError, match="cannot be pickled"):
            sharded(x, note=threading.Lock())
        # The worker died reading it, the call failed and the module closed (helper review, stop 61).
        with pytest.raises(TypeError, match=r"could not be read in a worker process \(rank 1: AttributeError: Can't"):
            sharded(x, note=_ReadInRank0Only(os.getpid()))
        with torch.no_grad():
            expected = model(x)
            torch.testing.assert_close(sharded(x), expected)
        # Calls from two threads take turns (interleaved, their collectives broke the process group).
        outputs = []
        threads = [threading.Thread(target=lambda: outputs.append(sharded(x))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(outputs) == 2
        for out in outputs:
            torch.testing.assert_close(out, expected)
        with pytest.raises(TypeError, match="cannot be pickled or copied"):
            copy.deepcopy(sharded)
        # A sliced weight written in place: rank 0 runs its shard, a copy the write did not reach (0.65 off).
        with torch.no_grad():
            model.blocks[0].fc1.weight.mul_(3)
        with pytest.raises(RuntimeError, match="runs tensor-parallel"):
            sharded(x)
    finally:
        sharded.close()


@torch.library.custom_op("amxopt_tests::fails_in_a_worker", mutates_args=())
def _fails_in_a_worker(x: torch.Tensor, parent: int) -> torch.Tensor:
    """Fails in a worker alone on 3 rows, in rank 0 alone on 5; takes a second in rank 0 on 7."""
    if os.getpid() != parent and x.shape[0] == 3:
        raise MemoryError("out of memory in this worker alone")
    if os.getpid() == parent and x.shape[0] == 5:
        raise MemoryError("out of memory in rank 0 alone")
    if os.getpid() == parent and x.shape[0] == 7:
        time.sleep(1)
    return x.clone()


@_fails_in_a_worker.register_fake
def _(x, parent):
    return torch.empty_like(x)


class _ScaledBlocks(torch.nn.Module):
    """Blocks scaled by a call's number (refused alike on every rank where negative), after an op
    that fails at run time in a worker alone."""

    def __init__(self, parent: int):
        super().__init__()
        self.blocks, self.parent = torch.nn.ModuleList([_MLPBlock(), _MLPBlock()]), parent

    def forward(self, x, scale=1.0, noise=0.0):
        if scale < 0:
            raise ValueError("scale must not be negative")
        x = torch.ops.amxopt_tests.fails_in_a_worker(x, self.parent)
        if noise:  # a random op: every rank must draw rank 0's numbers
            x = x + noise * torch.randn_like(x)
        for block in self.blocks:
            x = block(x) * scale
        return x


@torch.library.custom_op("amxopt_tests::slow_to_capture_in_a_worker", mutates_args=())
def _slow_to_capture_in_a_worker(x: torch.Tensor, parent: int) -> torch.Tensor:
    return x.clone()


@_slow_to_capture_in_a_worker.register_fake
def _(x, parent):
    if os.getpid() != parent:
        time.sleep(3)  # a worker's capture, later than rank 0's by more than tp_timeout_s
    return torch.empty_like(x)


class _SlowToCaptureBlocks(_ScaledBlocks):
    def forward(self, x):
        return super().forward(torch.ops.amxopt_tests.slow_to_capture_in_a_worker(x, self.parent))


def test_a_workers_optimize_is_not_bounded_by_the_calls_timeout():
    # A short tp_timeout_s bounds each call's collectives, not a worker's start and optimize (which
    # on a loaded machine take longer than rank 0's): "did not optimize the model within 1 s".
    model, x = _SlowToCaptureBlocks(os.getpid()).eval(), torch.randn(4, 32)
    sharded = amxopt.optimize(model, (x,), dataclasses.replace(CONFIG, tp=2, tp_timeout_s=1))
    try:
        with torch.no_grad():
            torch.testing.assert_close(sharded(x), model(x))
    finally:
        sharded.close()


def test_an_autotune_decision_past_the_timeout_says_so(tmp_path):
    # With autotune on, rank 0 sends each decision in a collective, which the slow worker reaches after
    # tp_timeout_s: optimize() failed with gloo's own words (helper review, stop 61).
    model, x = _SlowToCaptureBlocks(os.getpid()).eval(), torch.randn(4, 32)
    config = dataclasses.replace(
        CONFIG, tp=2, tp_timeout_s=1, autotune=True, provider="auto", autotune_cache=str(tmp_path)
    )
    with pytest.raises(RuntimeError, match=r"autotune decision did not reach every rank within tp_timeout_s \(1 s"):
        amxopt.optimize(model, (x,), config)


def test_every_call_reaches_the_ranks_with_its_own_values_and_a_rank_that_raises_is_named():
    model = _ScaledBlocks(os.getpid()).eval()
    sharded = amxopt.optimize(model, (torch.randn(4, 32),), dataclasses.replace(CONFIG, tp=2, tp_timeout_s=3))
    try:
        with torch.no_grad():
            # Same shapes, other values, and a number: the ranks ran the first call's again (1.29 off),
            # or the number's default (1.12 off), and no test called twice.
            for seed, kwargs in ((0, {}), (1, {}), (0, {"scale": 2.0}), (2, {})):
                x = torch.randn(4, 32, generator=torch.Generator().manual_seed(seed))
                torch.testing.assert_close(sharded(x, **kwargs), model(x, **kwargs))
            # Each rank drew its own noise (0.43 off eager under the same seed; helper review, stop 61).
            torch.manual_seed(3)
            got = sharded(x, noise=0.5)
            torch.manual_seed(3)
            torch.testing.assert_close(got, model(x, noise=0.5))
            # Refused alike on every rank (past check_inputs: in the capture): the call's own error, still in step.
            with pytest.raises(amxopt.CaptureError, match="scale must not be negative"):
                sharded(x, scale=-1.0)
            torch.testing.assert_close(sharded(x), model(x))
            # A worker raising alone: rank 0 waits in a collective; the error was "no rank exited".
            with pytest.raises(RuntimeError, match=r"rank 1 raised in call \d+:(.|\n)*out of memory in this worker"):
                sharded(torch.randn(3, 32))
    finally:
        sharded.close()


def test_a_close_from_another_thread_lets_the_running_call_end():
    # The stop went out amid the call's collectives: close() hung for tp_timeout_s and the call failed
    # with "rank 0 raised in call 3" (the stop's number; helper review, stop 61).
    model, x = _ScaledBlocks(os.getpid()).eval(), torch.randn(7, 32)  # 7 rows: a second in rank 0's op
    sharded = amxopt.optimize(model, (x,), dataclasses.replace(CONFIG, tp=2, tp_timeout_s=3))
    got = []
    try:
        with torch.no_grad():
            sharded(x)
            caller = threading.Thread(target=lambda: got.append(sharded(x)))
            caller.start()
            time.sleep(0.5)
            sharded.close()
            caller.join()
            torch.testing.assert_close(got[0], model(x))
            assert [w.exitcode for w in sharded._workers] == [0]
    finally:
        sharded.close()


def test_a_rank_killed_after_a_refused_call_is_not_told_with_that_calls_error():
    # A worker's error of a call every rank refused stays in the store until its next call goes
    # through: kept, a later death was told with the old call's traceback.
    model, x = _ScaledBlocks(os.getpid()).eval(), torch.randn(4, 32)
    sharded = amxopt.optimize(model, (x,), dataclasses.replace(CONFIG, tp=2, tp_timeout_s=3))
    try:
        with torch.no_grad():
            with pytest.raises(amxopt.CaptureError, match="scale must not be negative"):
                sharded(x, scale=-1.0)
            sharded(x)
            worker = sharded._workers[0]
            worker.kill()
            worker.join()
            with pytest.raises(RuntimeError, match="rank 1 exited with code -9") as failed:
                sharded(x)
        assert "scale must not be negative" not in str(failed.value)
    finally:
        sharded.close()


def test_rank_0_raising_alone_is_the_error_and_closes_the_module():
    # The workers wait for it in a collective until tp_timeout_s: the error named rank 1's timeout
    # first, rank 0's own error last in brackets; no test had rank 0 fail alone.
    model = _ScaledBlocks(os.getpid()).eval()
    sharded = amxopt.optimize(model, (torch.randn(4, 32),), dataclasses.replace(CONFIG, tp=2, tp_timeout_s=3))
    try:
        with torch.no_grad():
            with pytest.raises(
                RuntimeError,
                match=r"^amxopt: a tensor-parallel call failed: rank 0 raised in call \d+: MemoryError: out of "
                r"memory in rank 0 alone; the other ranks waited for it: rank 1 ",
            ):
                sharded(torch.randn(5, 32))
            with pytest.raises(RuntimeError, match="this TPModule is closed"):  # (out of step: not called again)
                sharded(torch.randn(4, 32))
    finally:
        sharded.close()


def test_a_model_that_cannot_be_pickled_is_named_as_such():
    model, x = _Blocks(_MLPBlock(), _MLPBlock()).eval(), torch.randn(4, 32)
    model.blocks[0].register_forward_hook(lambda module, args, out: None)  # a lambda: not picklable
    with pytest.raises(RuntimeError, match="tp hands the model to its worker processes by pickling it"):
        amxopt.optimize(model, (x,), dataclasses.replace(CONFIG, tp=2))


def test_a_worker_that_fails_to_optimize_is_the_error_autotune_or_not():
    # With autotune, rank 0 waits for the worker in a collective: gloo's error would say only "closed".
    model, x = _Blocks(_MLPBlock(os.getpid()), _MLPBlock(os.getpid())).eval(), torch.randn(4, 32)
    config = dataclasses.replace(CONFIG, tp=2, provider="auto", autotune=True)
    with pytest.raises(RuntimeError, match="tp rank 1 exited with code 1:(.|\n)*cannot be captured in a worker"):
        amxopt.optimize(model, (x,), config)
    assert not torch.distributed.is_initialized()


def test_close_is_idempotent_and_collecting_a_module_leaves_nothing_behind():
    import gc

    import torch.distributed as dist

    model = _model("qwen3-omni-vision", torch.float32)
    inputs = models.example_inputs("tiny-qwen3-omni-vision", torch.float32)
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2))
    start = time.monotonic()
    first.close()
    # stopped by its message, not terminated after a wait (5 s, and exit code -15)
    assert time.monotonic() - start < 2 and [w.exitcode for w in first._workers] == [0]
    first.close()
    second = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2))
    first.close()  # not the group of the module now open
    assert dist.is_initialized()
    workers = second._workers
    for a, b in zip(pytree.tree_leaves(second(**inputs)), pytree.tree_leaves(model(**inputs))):
        torch.testing.assert_close(a, b)
    del second
    gc.collect()
    assert not dist.is_initialized()
    assert not any(w.is_alive() for w in workers)
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == (cores, threads)
    # closed in another thread: this thread, which optimized, gets its cores back (they went to the closer)
    third = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, tp=2))
    closer = threading.Thread(target=third.close)
    closer.start()
    closer.join()
    assert os.sched_getaffinity(0) == cores
    torch.set_num_threads(threads)  # the count is per thread: only a close in this thread restores it


def test_a_worker_waits_for_the_next_call_however_long_the_module_idles(monkeypatch):
    import datetime

    import torch.distributed as dist

    monkeypatch.setattr(tp, "_IDLE_WAIT", datetime.timedelta(seconds=0.2))  # (a day)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    threading.Timer(0.8, lambda: store.set(tp._CALL.format(1), "")).start()
    start = time.monotonic()
    tp._wait_for_call(store, 1)  # the wait is renewed past each _IDLE_WAIT, not given up
    assert time.monotonic() - start > 0.6


def test_only_a_worker_that_stored_an_error_for_the_call_is_said_to_have_raised():
    import torch.distributed as dist

    sharded = object.__new__(tp.TPModule)
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    sharded.__dict__["_store"] = store
    assert not sharded._raised_in(1, 2)  # not done
    store.set(tp._DONE.format(1), "2")
    assert not sharded._raised_in(1, 2)  # done, no error: it finished the call (was told as raising)
    store.set(tp._ERROR.format(1), "Traceback ...")
    assert sharded._raised_in(1, 2) and not sharded._raised_in(1, 3)
