"""Capture in a forked child (amxopt/runtime/isolated.py): the same graph as a capture in this
process, torch.export never imported here, and every failure of the child falls back."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch
import torch.utils._pytree as pytree

import amxopt
from amxopt import models
from amxopt.capture import CaptureError
from amxopt.ops.packed import packed_for, packings
from amxopt.runtime import isolated
from tests.helpers import CONFIG

FAMILIES = ("tiny-qwen3-vl-vision", "tiny-qwen3-omni-vision", "tiny-qwen3-omni-audio", "tiny-wan")
CHILD = "graph restored from amxopt's capture in a forked child process"
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is not available on this platform")


def _config(tmp_path, **kw) -> amxopt.AmxConfig:
    return dataclasses.replace(CONFIG, graph_cache=False, autotune_cache=str(tmp_path), **kw)


def _outputs(opt, inputs):
    with torch.no_grad():
        return pytree.tree_leaves(opt(**inputs))


def _assert_matches_eager(opt, name, dtype, inputs, tol):
    reference = models.build_model(name, dtype)  # the same seeded weights
    for got, want in zip(_outputs(opt, inputs), _outputs(reference, inputs), strict=True):
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", FAMILIES)
def test_the_child_sends_back_the_graph_a_capture_here_makes(name, tmp_path):
    model = models.build_model(name, torch.bfloat16)
    inputs = models.example_inputs(name, torch.bfloat16)
    here = amxopt.optimize(model, inputs, _config(tmp_path, provider="native", isolate_capture=False))
    child = amxopt.optimize(model, inputs, _config(tmp_path, provider="native"))
    assert any(CHILD in n for n in child.report.notes), child.report.notes
    assert not any(CHILD in n for n in here.report.notes)
    assert child.report.counts() == here.report.counts()
    assert str(child.graph_module.graph) == str(here.graph_module.graph)
    for t in (*child.graph_module.parameters(), *child.graph_module.buffers()):
        assert t.device.type == "cpu"  # the child's shape-only packings never reach this process
    for got, want in zip(_outputs(child, inputs), _outputs(here, inputs), strict=True):
        assert torch.equal(got, want), name


def test_a_recapture_in_the_child_shares_the_packed_weights_of_the_first_graph(tmp_path):
    name = "tiny-qwen3-vl-vision"
    model = models.build_model(name, torch.float32)
    config = _config(tmp_path, provider="native", keep_source=False, dynamic=False)
    opt = amxopt.optimize(model, models.example_inputs(name, torch.float32), config)
    other = models.example_inputs(name, torch.float32, size=[(64, 96), (32, 32)])
    reference = models.build_model(name, torch.float32)
    with torch.no_grad():
        got, want = opt(**other), reference(**other)
    assert len(opt.graphs) == 2 and all(any(CHILD in n for n in g.report.notes) for g in opt._graphs)
    first, second = ({b.data_ptr() for b in gm.get_submodule("_packed").buffers()} for gm in opt.graphs)
    assert first == second  # packed once: the second graph reads the first one's packings
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_the_weights_are_packed_here_while_the_child_captures(tmp_path, monkeypatch):
    name = "tiny-qwen3-vl-vision"
    made, threads = [], []
    pack, pack_meanwhile = isolated.weights.pack, isolated._pack_meanwhile

    def count_threads(weight, provider):  # every packing in this process, restore's included
        threads.append(torch.get_num_threads())
        return pack(weight, provider)

    def keep_packings(module, provider, done, replied):
        pack_meanwhile(module, provider, done, lambda: False)  # all of them, however fast the child
        made.extend(packed_for(p, provider) for p in done)

    parent, remember = os.getpid(), isolated.packed.remember

    def remember_here(p, provider, value):  # the child's packings are shape-only: it computes none
        if os.getpid() != parent and value.device.type != "meta":
            (tmp_path / "packed-in-the-child").touch()
        return remember(p, provider, value)

    monkeypatch.setattr(isolated.weights, "pack", count_threads)
    monkeypatch.setattr(isolated, "_pack_meanwhile", keep_packings)
    monkeypatch.setattr(isolated.packed, "remember", remember_here)
    monkeypatch.setattr(isolated.threading, "active_count", lambda: 1)  # a thread an earlier test left
    before = torch.get_num_threads()
    model = models.build_model(name, torch.bfloat16)
    inputs = models.example_inputs(name, torch.bfloat16)
    opt = amxopt.optimize(model, inputs, _config(tmp_path, provider="native"))
    assert any(CHILD in n for n in opt.report.notes)
    assert not (tmp_path / "packed-in-the-child").exists()
    graph_packed = list(opt.graph_module.get_submodule("_packed").buffers())
    assert graph_packed and all(any(b is t for t in made) for b in graph_packed)
    # Restore packed nothing (it would run on every thread); the packing here left the child a core.
    assert threads and set(threads) == {max(1, before - 1)}
    assert torch.get_num_threads() == before
    _assert_matches_eager(opt, name, torch.bfloat16, inputs, 5e-2)


def test_packing_here_stops_when_the_child_replies_and_restore_packs_the_rest(tmp_path, monkeypatch):
    name = "tiny-qwen3-vl-vision"
    made = []
    pack_meanwhile = isolated._pack_meanwhile

    def reply_after_one(module, provider, done, replied):
        answers = iter([False])  # the child "replies" once one weight is packed
        pack_meanwhile(module, provider, done, lambda: next(answers, True))
        made.extend(done)

    monkeypatch.setattr(isolated, "_pack_meanwhile", reply_after_one)
    model = models.build_model(name, torch.bfloat16)
    inputs = models.example_inputs(name, torch.bfloat16)
    opt = amxopt.optimize(model, inputs, _config(tmp_path, provider="native"))
    assert any(CHILD in n for n in opt.report.notes)
    assert len(made) == 1
    assert len(list(opt.graph_module.get_submodule("_packed").buffers())) > 1  # restore packed the others
    _assert_matches_eager(opt, name, torch.bfloat16, inputs, 5e-2)


def test_a_packing_made_while_the_child_captures_that_no_graph_reads_is_dropped(tmp_path):
    name = "tiny-qwen3-omni-audio"
    model = models.build_model(name, torch.float32)
    inputs = models.example_inputs(name, torch.float32)
    passes = [p for p in amxopt.passes.PASSES if p != "replace_linear"]  # every Linear stays ATen
    opt = amxopt.optimize(model, inputs, _config(tmp_path, provider="native", passes=passes, keep_source=False))
    assert any(CHILD in n for n in opt.report.notes)
    linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and not any(packings(w) for w in linears)
    assert all(w.device.type == "cpu" for w in linears)  # not released: the graph reads them
    _assert_matches_eager(opt, name, torch.float32, inputs, 1e-4)


def test_autotune_decides_in_the_child_and_the_report_shows_it(tmp_path):
    name = "tiny-qwen3-omni-audio"
    model = models.build_model(name, torch.bfloat16)
    inputs = models.example_inputs(name, torch.bfloat16)
    config = _config(tmp_path, provider="native", autotune=True)
    # This process read the decisions file before (an earlier optimize): the child's additions are read again.
    isolated._autotune._load(isolated._autotune._cache_file(config))
    child = amxopt.optimize(model, inputs, config)
    here = amxopt.optimize(model, inputs, dataclasses.replace(config, isolate_capture=False))
    assert child.report.choices, "the child's timings are in the report"
    assert not any("[cached]" in str(c) for c in child.report.choices), "timed for this very optimize"
    # The child stored its decisions on disk; this process reads them instead of timing again.
    assert [c[0] for c in here.report.choices] == [c[0] for c in child.report.choices]
    assert all("[cached]" in str(c) for c in here.report.choices), here.report.choices


def test_the_parent_stops_packing_before_the_childs_first_timing(tmp_path, monkeypatch):
    # A timing must not share the cores with the packing here: the child asks the parent to stop, and
    # times once it has (restore packs the rest, after the child's reply).
    packs, pack, pack_meanwhile = [], isolated.weights.pack, isolated._pack_meanwhile  # (start, end, meanwhile)
    meanwhile = threading.Event()

    def slow_pack(p, provider):
        start = time.monotonic()
        if meanwhile.is_set():
            time.sleep(1.0)  # 15 weights outlast the child's export: unstopped, it packs beside the timings
        result = pack(p, provider)
        packs.append((start, time.monotonic(), meanwhile.is_set()))
        return result

    def slowly(*args):
        meanwhile.set()
        try:
            pack_meanwhile(*args)
        finally:
            meanwhile.clear()

    spans = tmp_path / "timings"

    def timed(run_amxopt, run_aten):  # in the child: when each timing runs (CLOCK_MONOTONIC is the system's)
        start = time.monotonic()
        time.sleep(0.05)
        with open(spans, "a") as f:
            f.write(f"{start} {time.monotonic()}\n")
        return 1.0, 2.0

    monkeypatch.setattr(isolated.weights, "pack", slow_pack)
    monkeypatch.setattr(isolated, "_pack_meanwhile", slowly)
    monkeypatch.setattr(isolated._autotune, "_time", timed)
    name = "tiny-qwen3-omni-audio"
    model, inputs = models.build_model(name, torch.bfloat16), models.example_inputs(name, torch.bfloat16)
    opt = amxopt.optimize(model, inputs, _config(tmp_path, provider="native", autotune=True))
    assert any(CHILD in n for n in opt.report.notes) and opt.report.choices
    timings = [tuple(map(float, line.split())) for line in spans.read_text().splitlines()]
    first, last = min(s for s, _ in timings), max(e for _, e in timings)
    assert all(end <= first or start >= last for start, end, _ in packs), (packs, first, last)
    assert any(here for *_, here in packs) and any(start >= last and not here for start, _, here in packs)


def _closes_its_end_then_exits(conn, *args):
    conn.close()  # the parent reads the end of the pipe, and waits for the exit status
    time.sleep(1)
    os._exit(3)


@pytest.mark.parametrize("child", [lambda *args: os._exit(3), _closes_its_end_then_exits], ids=["exits", "exits-later"])
def test_a_child_that_dies_falls_back_to_a_capture_here(child, tmp_path, monkeypatch, caplog):
    name = "tiny-wan"
    monkeypatch.setattr(isolated, "_child", child)
    inputs = models.example_inputs(name, torch.float32)
    with caplog.at_level(logging.INFO, logger="amxopt.runtime.isolated"):
        opt = amxopt.optimize(models.build_model(name, torch.float32), inputs, _config(tmp_path))
    assert (
        "capturing in this process" in caplog.text and "ended without a graph (EOFError; exit status 3)" in caplog.text
    )
    assert not any(CHILD in n for n in opt.report.notes)
    assert opt.report.counts()["linear"] > 0


def test_a_child_reaped_by_the_callers_sigchld_setting_still_serves_its_graph(tmp_path):
    # A daemon that ignores SIGCHLD: the kernel reaps the child, and waitpid finds none.
    name = "tiny-qwen3-omni-audio"
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        opt = amxopt.optimize(
            models.build_model(name, torch.float32), models.example_inputs(name, torch.float32), _config(tmp_path)
        )
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert any(CHILD in n for n in opt.report.notes), opt.report.notes


def test_a_process_with_other_threads_keeps_its_thread_count_while_packing(tmp_path, monkeypatch):
    # Lowered, a thread running its first parallel op meanwhile would keep the lowered count.
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    done = threading.Event()
    other = threading.Thread(target=done.wait)
    other.start()
    try:
        name = "tiny-qwen3-vl-vision"
        opt = amxopt.optimize(
            models.build_model(name, torch.bfloat16),
            models.example_inputs(name, torch.bfloat16),
            _config(tmp_path, provider="native"),
        )
    finally:
        done.set()
        other.join()
    assert any(CHILD in n for n in opt.report.notes)
    assert set_to == []


def test_a_failed_fork_captures_here(tmp_path, monkeypatch):
    def no_fork():
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(isolated.os, "fork", no_fork)
    name = "tiny-qwen3-omni-audio"
    opt = amxopt.optimize(
        models.build_model(name, torch.float32), models.example_inputs(name, torch.float32), _config(tmp_path)
    )
    assert not any(CHILD in n for n in opt.report.notes)
    assert opt.report.counts()["linear"] > 0
    assert gc.get_freeze_count() == 0  # nothing left frozen


def test_a_model_export_cannot_capture_raises_the_childs_capture_error(tmp_path, monkeypatch, caplog):
    class DataDependent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            for _ in range(int(x.abs().sum().item() * 3) % 4):  # control flow on a value
                x = self.fc(x)
            return x

    made, pack_meanwhile = [], isolated._pack_meanwhile

    def pack_all(module, provider, done, replied):  # however fast the child fails
        pack_meanwhile(module, provider, done, lambda: False)
        made.extend(done)

    monkeypatch.setattr(isolated, "_pack_meanwhile", pack_all)
    model = DataDependent().eval()
    with caplog.at_level(logging.INFO, logger="amxopt.runtime.isolated"):
        with pytest.raises(CaptureError, match="could not capture DataDependent"):
            amxopt.optimize(model, (torch.randn(2, 4),), _config(tmp_path, provider="native"))
    assert "capturing in this process" not in caplog.text  # the same verdict here: export is not run twice
    assert len(made) == 1 and made[0] is model.fc.weight  # packed here meanwhile,
    assert not packings(model.fc.weight)  # and dropped: no graph reads it


class _Transposed(torch.nn.Module):
    """A weight packed transposed: the packing is computed from it, so the child sends its values in a file."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(32, 48) / 6)

    def forward(self, x):
        return torch.nn.functional.linear(x, self.w.t())


def _no_tensors_file(*args):
    raise OSError(28, "No space left on device")


@pytest.mark.parametrize("save", [None, _no_tensors_file], ids=["restored", "not-written"])
def test_the_childs_tensors_file_is_deleted(save, tmp_path, monkeypatch):
    # Restored here, the parent deletes it; one the child could not write (its reply fails) the child deletes.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    if save is not None:
        monkeypatch.setattr(isolated, "save_tensors", save)
    sent, restore = [], isolated._restore
    monkeypatch.setattr(
        isolated, "_restore", lambda reply, *args: sent.append(reply.get("tensors")) or restore(reply, *args)
    )
    torch.manual_seed(0)
    model, x = _Transposed().eval(), torch.randn(8, 32)
    opt = amxopt.optimize(model, (x,), _config(tmp_path, provider="native", keep_source=True))
    if save is None:
        assert any(CHILD in n for n in opt.report.notes), opt.report.notes
        assert len(sent) == 1 and sent[0].startswith(str(scratch))
    else:  # captured here
        assert sent == [] and not any(CHILD in n for n in opt.report.notes)
    assert os.listdir(scratch) == []
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "error",
    [
        isolated.GraphStoreError("a node outside the vocabulary"),
        KeyError("nodes"),
        ValueError("bad guard"),
        FileNotFoundError(2, "No such file or directory"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_a_graph_that_cannot_be_restored_here_is_captured_here(error, tmp_path, monkeypatch, caplog):
    def restore(*args, **kwargs):
        raise error

    monkeypatch.setattr(isolated.graph_store, "restore", restore)
    torch.manual_seed(0)
    model, x = _Transposed().eval(), torch.randn(8, 32)
    with caplog.at_level(logging.INFO, logger="amxopt.runtime.isolated"):
        opt = amxopt.optimize(model, (x,), _config(tmp_path))
    assert f"its graph could not be restored: {error}" in caplog.text and "capturing in this process" in caplog.text
    assert not any(CHILD in n for n in opt.report.notes)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x), rtol=1e-4, atol=1e-4)


def test_an_interrupt_while_the_child_captures_kills_it(tmp_path, monkeypatch):
    def interrupted(*args):
        raise KeyboardInterrupt

    ended, reap = [], isolated._reap
    monkeypatch.setattr(isolated, "_child", lambda *args: time.sleep(10))  # a long capture
    monkeypatch.setattr(isolated, "_pack_meanwhile", interrupted)
    monkeypatch.setattr(isolated, "_reap", lambda pid: ended.append(reap(pid)) or ended[-1])
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        amxopt.optimize(_Transposed().eval(), (torch.randn(8, 32),), _config(tmp_path))
    assert ended == ["killed by SIGKILL"]  # not waited for: the child must not outlive the call
    assert time.monotonic() - start < 10


def test_a_child_that_dies_waiting_to_time_is_captured_again_here(tmp_path):
    # The child asks the parent to stop packing and dies (an OOM kill) before it may time, while the
    # parent still packs. The parent must not write to it (under SIGPIPE's default action, as a CLI or
    # an embedding host sets it, that ended the process), nor wait on a lock the child held: it
    # captures here. A fresh interpreter, for the signal disposition.
    script = f"""
import os, signal, threading, time, torch, amxopt
from amxopt import models
from amxopt.passes import _autotune
from amxopt.runtime import isolated
signal.signal(signal.SIGPIPE, signal.SIG_DFL)
parent, pack, quiet = os.getpid(), isolated.weights.pack, _autotune._quiet
def slow_pack(p, provider):  # still packing when the child asks
    if threading.current_thread() is threading.main_thread() and os.getpid() == parent:
        time.sleep(0.3)
    return pack(p, provider)
def dies_waiting():
    if _autotune.before_timing is not None:  # (the child's hook)
        threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGKILL)).start()
    quiet()
isolated.weights.pack, _autotune._quiet = slow_pack, dies_waiting
name = "tiny-qwen3-omni-audio"
config = amxopt.AmxConfig(provider="native", graph_cache=False, autotune_cache={str(tmp_path)!r})
model, inputs = models.build_model(name, torch.bfloat16), models.example_inputs(name, torch.bfloat16)
opt = amxopt.optimize(model, inputs, config)
print("child" if any("forked child" in n for n in opt.report.notes) else "here", opt.report.counts()["linear"])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-3000:])
    where, linears = done.stdout.split()[-2:]
    assert where == "here" and int(linears) > 0


def test_optimize_never_imports_torch_export_in_this_process(tmp_path):
    # A fresh interpreter: this test process has imported torch.export long ago.
    script = f"""
import json, sys, torch, amxopt
from amxopt import models
name = "tiny-qwen3-vl-vision"
config = amxopt.AmxConfig(provider="reference", autotune=False, graph_cache=False, autotune_cache={str(tmp_path)!r})
opt = amxopt.optimize(models.build_model(name, torch.float32), models.example_inputs(name, torch.float32), config)
print(json.dumps({{"notes": opt.report.notes, "modules": [m for m in ("torch.export._trace", "networkx") if m in sys.modules]}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert any(CHILD in n for n in result["notes"]), result["notes"]
    assert result["modules"] == [], f"imported here: {result['modules']}"
