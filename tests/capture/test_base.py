"""Plain capture (amxopt/capture/base.py): the settings export runs under are torch's again after it."""

from __future__ import annotations

import pytest
import torch

from amxopt import models
from amxopt.capture import prepare
from amxopt.capture.base import export


@pytest.mark.parametrize("stamp", [True, False])
def test_export_settings_apply_while_it_traces_and_are_restored_after(stamp, monkeypatch):
    seen = []
    trace = torch.export.export

    def spy(*args, **kwargs):
        seen.append((torch.fx.config.do_not_emit_stack_traces, torch._dynamo.config.fake_tensor_cache_enabled))
        return trace(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", spy)
    name = "tiny-qwen3-omni-audio"
    model = models.build_model(name, torch.float32)
    adapter, graph_inputs = prepare(model, models.example_inputs(name, torch.float32))
    before = (torch.fx.config.do_not_emit_stack_traces, torch._dynamo.config.fake_tensor_cache_enabled)
    captured = export(model, adapter, graph_inputs, True, stamp)
    assert seen and all(s == (True, False) for s in seen), seen  # no stack per node, no dispatch cache
    assert (torch.fx.config.do_not_emit_stack_traces, torch._dynamo.config.fake_tensor_cache_enabled) == before
    # No node carries the model's Python stack (export's own runtime-assert pass still stamps a few).
    assert not any("modeling_" in n.meta.get("stack_trace", "") for n in captured.gm.graph.nodes)


class _Keywords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x, **kwargs):
        return self.fc(x) * (2.0 if kwargs.get("double") else 1.0) + kwargs.get("shift", 0)


def test_a_call_with_an_extra_keyword_exports_dynamic_and_the_forward_is_restored():
    # torch.export keyed dynamic_shapes by forward's parameters and then matched them against the
    # extra keywords at the top: every dynamic export failed (CLIP's output_hidden_states=True), each
    # batch size got a static graph, and the ninth was refused.
    model = _Keywords().eval()
    own = model.forward
    model.forward = lambda *a, **k: own(*a, **k)  # replaced on the instance: kept after the export
    replaced = model.forward
    inputs = {"x": torch.randn(3, 16), "double": True, "shift": torch.randn(3, 16)}
    adapter, graph_inputs = prepare(model, inputs)
    captured = export(model, adapter, graph_inputs, True)
    assert captured.dynamic and not captured.note, captured.note
    assert model.forward is replaced and type(model).forward is _Keywords.forward
    for rows in (3, 5):
        other = {**graph_inputs, "x": torch.randn(rows, 16), "shift": torch.randn(rows, 16)}
        captured.check(other)
        with torch.no_grad():
            torch.testing.assert_close(captured.gm(**other), model(**other))


class _PositionalOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x, /, scale=1.0):
        return self.fc(x) * scale


def test_a_positional_only_parameter_is_exported_and_the_forward_is_restored():
    # export passes every input by name: the model was refused ("'x' parameter is positional only")
    model, x = _PositionalOnly().eval(), torch.randn(3, 8)
    adapter, graph_inputs = prepare(model, (x,))
    for dynamic in (True, False):
        captured = export(model, adapter, graph_inputs, dynamic)
        with torch.no_grad():
            assert torch.equal(captured.gm(**graph_inputs), model(x))
        assert captured.dynamic == dynamic
        if not dynamic:  # a static graph: its guards refuse another size
            with pytest.raises(AssertionError, match=r"Guard failed: x.size\(\)\[0\] == 3"):
                captured.check({"x": torch.randn(5, 8)})
    assert "forward" not in vars(model)


def test_a_static_export_of_a_model_that_exports_dynamic_too():
    name = "tiny-wan"
    model = models.build_model(name, torch.float32)
    adapter, graph_inputs = prepare(model, models.example_inputs(name, torch.float32))
    captured = export(model, adapter, graph_inputs, False)
    assert not captured.dynamic and captured.note == ""
    with torch.no_grad():
        assert torch.equal(captured.gm(**graph_inputs)[0], model(**graph_inputs)[0])


def test_a_keyword_only_forward_wrapper_is_removed_after_the_export():
    model = _Keywords().eval()
    adapter, graph_inputs = prepare(model, {"x": torch.randn(3, 16), "double": True})
    export(model, adapter, graph_inputs, True)
    assert "forward" not in vars(model)


class _Equal(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) * (2 if torch.equal(x, x.abs()) else 1)


def _refusal(model, inputs) -> str:
    from amxopt.capture import CaptureError

    adapter, graph_inputs = prepare(model, inputs)
    with pytest.raises(CaptureError) as refused:
        export(model, adapter, graph_inputs, True)
    return str(refused.value)


def test_capture_errors_say_where_tensor_values_or_a_models_own_hook_decide():
    x = {"x": torch.randn(4, 8)}
    # torch words it "DataDependentOutputException: aten.equal.default" (no "data-dependent")
    assert "DataDependentOutputException" in (said := _refusal(_Equal().eval(), x))
    assert "computes shapes or Python control flow from tensor values" in said
    hooked = _Equal().eval()
    hooked.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    assert "Forward hooks or replaced forwards on the model are traced" in _refusal(hooked, x)  # (its path is "")
    # A pre-hook of the model's own reading its args: amxopt passes the inputs by name
    positional = torch.nn.Sequential(torch.nn.Linear(8, 8)).eval()
    positional.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    said = _refusal(positional, {"input": x["x"]})
    assert "IndexError" in said and "has a forward pre-hook of its own" in said and "not in args" in said


class _Lazy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        if "table" not in self.fc._buffers:
            self.fc.register_buffer("table", torch.arange(8.0), persistent=False)
        return self.fc(x) + self.fc.table


def test_a_model_registering_a_buffer_while_it_runs_is_refused_and_left_without_it():
    # The trace registered a FakeTensor on the model, and the first call ran a graph that had read
    # a constant made while tracing (3.9 off eager); the next call ran eagerly's result.
    from amxopt.capture import CaptureError

    model = _Lazy().eval()
    adapter, graph_inputs = prepare(model, (torch.randn(3, 8),))
    with pytest.raises(CaptureError, match="_Lazy registers fc.table while it runs, which torch.export traces"):
        export(model, adapter, graph_inputs, True)
    assert "table" not in model.fc._buffers
    model(torch.randn(3, 8))  # called once, as the message advises: then it captures
    export(model, adapter, graph_inputs, True)
