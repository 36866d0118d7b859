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
