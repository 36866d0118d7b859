"""Capture: an nn.Module and example inputs -> an aten-level torch.fx.GraphModule.

``ADAPTERS`` is the ordered list of model-family adapters; a model none of them matches goes
through plain export and still gets every pass whose pattern its graph contains.
"""

from __future__ import annotations

from typing import Any

from torch import fx, nn

from amxopt.capture.base import Adapter, Captured, CaptureError, export, refuse_inference_tensors
from amxopt.capture.qwen import QwenAudioAdapter, QwenVisionAdapter
from amxopt.capture.wan import WanAdapter
from amxopt.config import AmxConfig

ADAPTERS: tuple[type[Adapter], ...] = (QwenVisionAdapter, QwenAudioAdapter, WanAdapter)


def find_adapter(model: nn.Module) -> type[Adapter]:
    return next((a for a in ADAPTERS if a.matches(model)), Adapter)


def split_inputs(example_inputs: Any) -> tuple[tuple, dict]:
    """``example_inputs`` is a tuple of positional args, a dict of kwargs, or a single tensor."""
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    return (example_inputs,), {}


def prepare(model: nn.Module, example_inputs: Any) -> tuple[Adapter, dict[str, Any]]:
    """The adapter for ``model`` and the graph inputs of one call (the eager, data-dependent part
    run; of a call the adapter splits, its first part's: the graph that serves the parts)."""
    adapter = find_adapter(model)(model)
    args, kwargs = split_inputs(example_inputs)
    call = adapter.bind(args, kwargs)
    adapter.output_options(call)  # the graph returns the default output; options apply per call
    return adapter, adapter.graph_inputs(adapter.split(call)[0])


def capture(model: nn.Module, example_inputs: Any, config: AmxConfig | None = None) -> fx.GraphModule:
    """Capture ``model`` on ``example_inputs`` as an aten-level ``torch.fx.GraphModule``.

    The graph's inputs are the adapter's graph inputs (for Qwen: the precomputed metadata), so
    call it through :func:`amxopt.optimize` rather than directly.

    Args:
        model: an ``nn.Module`` in eval mode.
        example_inputs: tuple of positional args or dict of kwargs for ``model``.
        config: capture options (``dynamic``); defaults to ``AmxConfig()``.

    Returns:
        The exported ``GraphModule`` (parameters appear as ``get_attr`` nodes).

    Example::

        gm = amxopt.capture(model, {"hidden_states": x, "grid_thw": grid})
        print(gm.graph)
    """
    config = config or AmxConfig()
    adapter, graph_inputs = prepare(model, example_inputs)
    return export(model, adapter, graph_inputs, config.dynamic, config.stamp_blocks).gm


__all__ = [
    "ADAPTERS",
    "Adapter",
    "CaptureError",
    "Captured",
    "capture",
    "export",
    "find_adapter",
    "prepare",
    "refuse_inference_tensors",
    "split_inputs",
]
