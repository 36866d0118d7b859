"""amxopt: rewrite unmodified vision, audio and video-diffusion models to run AMX kernels on Xeon CPUs.

``amxopt.optimize(model, example_inputs)`` captures the model with torch.export, replaces attention,
Linear, Conv3d patch embedding and LayerNorm/RMSNorm with ``torch.ops.amxopt`` kernels, packs the
weights once, and returns a module with the original call signature and output type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from torch import nn

from amxopt import ops  # noqa: F401 - registers torch.ops.amxopt
from amxopt.capture import CaptureError, capture, find_adapter, prepare
from amxopt.config import AmxConfig
from amxopt.ops import AmxOpError
from amxopt.ops.providers import resolve
from amxopt.runtime import OptimizedModule, Report, build_graph

__all__ = ["AmxConfig", "AmxOpError", "CaptureError", "OptimizedModule", "Report", "capture", "optimize"]


def optimize(model: nn.Module, example_inputs: Any = None, config: AmxConfig | None = None) -> OptimizedModule:
    """Capture ``model``, rewrite it onto amxopt ops and pack its weights.

    Args:
        model: a ``transformers``/``diffusers``/plain ``nn.Module`` in eval mode, in the dtype it
            should run in (e.g. ``model.to(torch.bfloat16)``).
        example_inputs: a tuple of positional args or a dict of kwargs for ``model``; ``None``
            captures at the first call instead (and again when a call does not fit the graph).
        config: options; ``AmxConfig()`` by default.

    Returns:
        An :class:`OptimizedModule` taking the same arguments and returning the same output type as
        ``model``; ``.graph_module`` is the rewritten graph and ``.report`` the rewrite report.

    Example::

        opt = amxopt.optimize(vision.to(torch.bfloat16).eval(), {"hidden_states": px, "grid_thw": grid})
        out = opt(hidden_states=px, grid_thw=grid)
        print(opt.report)
    """
    config = config or AmxConfig()
    if model.training:
        raise ValueError(
            f"amxopt: {type(model).__name__} is in training mode; amxopt optimizes inference, call .eval()"
        )
    config = dataclasses.replace(config, provider=resolve(config.provider))
    if example_inputs is None:
        return OptimizedModule(model, find_adapter(model)(model), None, config)
    adapter, graph_inputs = prepare(model, example_inputs)
    first = build_graph(model, adapter, graph_inputs, config)
    return OptimizedModule(model, adapter, first, config)
