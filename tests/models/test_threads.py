"""One optimized model called from several threads, and models captured in several threads at once."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import torch
from torch import nn

import amxopt
from amxopt import models
from amxopt.models import build
from amxopt.runtime import graph_store, module, weights
from tests.helpers import CONFIG

# Native ops and released weights, as a serving process runs them; captured in this process.
SERVING = dataclasses.replace(CONFIG, provider="auto", keep_source=False, graph_cache=False, isolate_capture=False)


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64)).to(torch.bfloat16).eval()


def _in_threads(*calls) -> list:
    """Each call in a thread of its own; their results (or what they raised), in order."""
    results: list = [None] * len(calls)

    def run(i: int) -> None:
        try:
            with torch.no_grad():
                results[i] = calls[i]()
        except Exception as e:  # noqa: BLE001 - returned for the test to show
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return results


def _counting_captures(monkeypatch) -> list:
    captures: list = []
    build = module.build_graph

    def counting(*args, **kwargs):
        captures.append(threading.get_ident())
        return build(*args, **kwargs)

    monkeypatch.setattr(module, "build_graph", counting)
    return captures


def test_a_call_while_the_first_call_releases_the_weights_keeps_its_graph(monkeypatch):
    # The second call saw the weights amxopt was releasing as a change to the source and dropped the
    # graph under the first call, which then failed ('NoneType' object has no attribute 'settle').
    captures, releasing, go_on = _counting_captures(monkeypatch), threading.Event(), threading.Event()
    trim = weights._return_freed_heap

    def slow_trim() -> None:  # (in the release, after the weights were swapped for placeholders)
        releasing.set()
        threading.Timer(0.5, go_on.set).start()  # the second call is under way by then
        go_on.wait(30)
        trim()

    monkeypatch.setattr(weights, "_return_freed_heap", slow_trim)
    source = _mlp()
    with torch.no_grad():
        want = source(x := torch.randn(2, 64, dtype=torch.bfloat16))
    opt = amxopt.optimize(source, config=SERVING)

    def second():
        assert releasing.wait(60)
        return opt.check_inputs(x) or opt(x)

    first, second = _in_threads(lambda: opt(x), second)
    assert isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor), (first, second)
    torch.testing.assert_close(first, want, atol=0.05, rtol=0.05)
    assert torch.equal(first, second) and len(captures) == 1 and len(opt.graphs) == 1


def test_first_calls_of_a_loaded_model_from_two_threads_restore_its_graph_once(tmp_path, monkeypatch):
    # One thread restored the saved graph while the other found nothing pending and no graph yet,
    # and captured again (a full capture, where load() promises none).
    name = "tiny-qwen3-vl-vision"
    inputs = models.example_inputs(name, torch.bfloat16)
    opt = amxopt.optimize(models.build_model(name, torch.bfloat16), inputs, SERVING)
    with torch.no_grad():
        want = opt(**inputs).pooler_output
    opt.save(tmp_path)
    captures, restore = _counting_captures(monkeypatch), graph_store.restore

    def slow_restore(*args, **kwargs):
        time.sleep(0.3)
        return restore(*args, **kwargs)

    monkeypatch.setattr(graph_store, "restore", slow_restore)
    loaded = amxopt.load(tmp_path, SERVING)
    outputs = _in_threads(*[lambda: loaded(**inputs).pooler_output] * 2)
    assert all(isinstance(o, torch.Tensor) and torch.equal(o, want) for o in outputs), outputs
    assert not captures and len(loaded.graphs) == 1


def test_models_captured_in_two_threads_export_one_at_a_time(monkeypatch):
    # torch.export's state is process-wide: two exports at once failed ("CURRENT_PATCHER is None"),
    # blamed on the model.
    export, running, most = torch.export.export, [0], [0]

    def one_at_a_time(*args, **kwargs):
        running[0] += 1
        most[0] = max(most[0], running[0])
        try:
            time.sleep(0.2)  # (long enough for the other thread to start its own)
            return export(*args, **kwargs)
        finally:
            running[0] -= 1

    monkeypatch.setattr(torch.export, "export", one_at_a_time)
    sources = [_mlp(seed) for seed in (0, 1)]
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    opts = [amxopt.optimize(s, config=SERVING) for s in sources]
    with torch.no_grad():
        wants = [s(x) for s in sources]
    outputs = _in_threads(*[lambda o=o: o(x) for o in opts])
    assert most[0] == 1
    for got, want in zip(outputs, wants, strict=True):
        assert isinstance(got, torch.Tensor), got
        torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)


def test_a_build_on_the_meta_device_leaves_other_threads_and_restores_what_it_replaced():
    # amxopt.load builds its model with nn.Module.register_parameter swapped: another thread's modules
    # got meta weights meanwhile, and two loads at once could leave the swap installed for good.
    from amxopt.runtime import loading

    original, inside, done = nn.Module.register_parameter, threading.Event(), threading.Event()
    seen = {}

    def second_build():
        seen["other thread's weight"] = nn.Linear(2, 2).weight.device.type  # while the first build holds it
        inside.set()
        with loading._parameters_on_meta():
            seen["own weight"] = nn.Linear(2, 2).weight.device.type
            done.wait(5)  # the first build ends meanwhile, unless it waits for this one

    with loading._parameters_on_meta():
        other = threading.Thread(target=second_build)
        other.start()
        inside.wait(5)
        assert nn.Linear(2, 2).weight.device.type == "meta"
    done.set()
    other.join()
    assert seen == {"other thread's weight": "cpu", "own weight": "meta"}
    assert nn.Module.register_parameter is original


def test_builds_in_two_threads_restore_the_default_dtype():
    # Two builds of bf16 models at once left torch's default dtype at bf16 for the whole process.
    inside, done = threading.Event(), threading.Event()

    def second_build():
        inside.set()
        with models._default_dtype(torch.float16):
            done.wait(5)  # the first build ends meanwhile, unless it waits for this one

    with models._default_dtype(torch.bfloat16):
        other = threading.Thread(target=second_build)
        other.start()
        inside.wait(5)
    done.set()
    other.join()
    assert torch.get_default_dtype() == torch.float32


def test_a_build_waiting_for_another_leaves_torch_init_alone():
    # diffusers' no_init_weights swaps torch.nn.init's functions for the process: entered before the
    # wait, a queued Wan build left every other thread's new modules uninitialised meanwhile.
    init = torch.nn.init.kaiming_uniform_
    with build.BUILD_LOCK:  # another build (an amxopt.load) holds it
        other = threading.Thread(target=models.build_model, args=("tiny-wan",))
        other.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _in_frames(other, "construct_class"):
            time.sleep(0.05)
        time.sleep(0.2)  # (waiting for the lock by then)
        assert _in_frames(other, "construct_class") and torch.nn.init.kaiming_uniform_ is init
    other.join()
    assert torch.nn.init.kaiming_uniform_ is init


def _in_frames(thread: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident)
    while frame is not None and frame.f_code.co_name != function:
        frame = frame.f_back
    return frame is not None
