"""amxopt: rewrite unmodified vision, audio and video-diffusion models to run AMX kernels on Xeon CPUs.

``amxopt.optimize(model, example_inputs)`` captures the model with torch.export, replaces attention,
Linear, Conv3d patch embedding and LayerNorm/RMSNorm with ``torch.ops.amxopt`` kernels, packs the
weights once, and returns a module with the original call signature and output type.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from amxopt import ops  # noqa: F401 - registers torch.ops.amxopt
from amxopt.capture import CaptureError, capture, find_adapter, prepare
from amxopt.config import AmxConfig
from amxopt.ops import AmxOpError, packed
from amxopt.ops.providers import resolve
from amxopt.runtime import OptimizedModule, Report, build_graph, tp
from amxopt.runtime.components import (
    ComponentsReport,
    has_towers,
    is_pipeline,
    optimize_components,
    unrunnable,
    warn_if_decoder,
)
from amxopt.runtime.loading import CheckpointError, from_pretrained, load

__all__ = [
    "AmxConfig",
    "AmxOpError",
    "CaptureError",
    "CheckpointError",
    "ComponentsReport",
    "OptimizedModule",
    "Report",
    "capture",
    "from_pretrained",
    "load",
    "optimize",
]


def optimize(model: Any, example_inputs: Any = None, config: AmxConfig | None = None) -> Any:
    """Capture ``model``, rewrite it onto amxopt ops and pack its weights.

    Args:
        model: in eval mode and in the dtype it should run in (e.g. ``.to(torch.bfloat16)``), one of
            - a supported encoder/transformer or any plain ``nn.Module``: it is captured whole;
            - a transformers model containing supported towers (``Qwen3VLForConditionalGeneration``,
              the Qwen3-Omni thinker): each tower is replaced in place, the language model is left;
            - a diffusers pipeline (``WanPipeline``, ...): ``transformer``, ``transformer_2`` and the
              text/image encoders are replaced in place.
        example_inputs: a tuple of positional args or a dict of kwargs for ``model``; ``None``
            captures at the first call instead (and again when a call does not fit the graph).
            Whole models and pipelines always capture each part at its first call.
        config: options; ``AmxConfig()`` by default. Optimizing a whole model or pipeline again
            keeps the parts optimized before, unless ``config`` is given and differs from theirs.

    Returns:
        For a module captured whole, an :class:`OptimizedModule` taking the same arguments and
        returning the same output type as ``model`` (``.report`` is the rewrite report). For a whole
        model or pipeline, ``model`` itself, its parts replaced, with ``model.amxopt_report`` (a
        :class:`ComponentsReport`).

    Example::

        model = amxopt.optimize(Qwen3VLForConditionalGeneration.from_pretrained(path).eval())
        tokens = model.generate(**inputs)
        print(model.amxopt_report)
    """
    given, config = config is not None, config or AmxConfig()
    if isinstance(model, (OptimizedModule, tp.TPModule)):
        raise ValueError(
            f"amxopt: optimize() was given an {type(model).__name__}, a model amxopt already optimized; "
            "pass the original model"
        )
    if getattr(model, "training", False):
        raise ValueError(
            f"amxopt: {type(model).__name__} is in training mode; amxopt optimizes inference, call .eval()"
        )
    refusal = None if is_pipeline(model) else unrunnable(model)  # a pipeline's part runs eagerly instead
    if refusal is not None:
        raise ValueError(f"amxopt: {refusal}: cast the model (model.to(torch.bfloat16)) before optimizing it")
    config = dataclasses.replace(config, provider=resolve(config.provider))
    if config.tp != 1 and isinstance(model, torch.nn.Module) and any(map(packed.is_released, model.parameters())):
        raise ValueError(
            f"amxopt: {type(model).__name__}'s weights were released by an earlier amxopt.optimize (or loaded packed "
            "by amxopt.from_pretrained or amxopt.load): tensor parallelism slices the source weights; optimize a "
            "fresh model with tp"
        )
    if config.tp != 1 and config.tp_group is None:
        if is_pipeline(model) or has_towers(model):
            raise ValueError(
                f"amxopt: tensor parallelism applies to a model captured whole (an encoder or transformer), "
                f"not to {type(model).__name__}'s parts: optimize the tower itself with tp"
            )
        if config.tp == "env":
            config = tp.rank_config(config)
        else:
            return tp.TPModule(model, example_inputs, config)
    if is_pipeline(model) or has_towers(model):
        if example_inputs is not None:
            raise ValueError(
                f"amxopt: {type(model).__name__} is optimized part by part, each captured at its first call; "
                "call optimize() without example inputs"
            )
        return optimize_components(model, config, given)
    warn_if_decoder(model)
    if example_inputs is None:
        return OptimizedModule(model, find_adapter(model)(model), None, config)
    # Captured as the module runs (OptimizedModule): in its own dtype, whatever autocast the caller
    # is under (autocast is per thread, so an isolated capture's would not see it anyway).
    with torch.autocast("cpu", enabled=False):
        adapter, graph_inputs = prepare(model, example_inputs)
        first = build_graph(model, adapter, graph_inputs, config)
    return OptimizedModule(model, adapter, first, config)
