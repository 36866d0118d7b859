"""What a zoo entry is: a :class:`Family` (one model class, its table of sizes) and a :class:`ModelSpec`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

INIT_STD = 0.02  # the configs' initializer_range; the least std of reinit's weights (see build.reinit)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of a family's table: what it reproduces, and its config (a fresh object per call)."""

    description: str
    config: Callable[[], Any]


@dataclasses.dataclass(frozen=True)
class Family:
    """One model class and every zoo entry built from it.

    Args:
        name: ``"qwen3_vl_vision"``, ``"qwen3_omni_vision"``, ``"qwen3_omni_audio"`` or ``"wan"``.
        library: ``"transformers"`` or ``"diffusers"`` (how the class is built from a config).
        model_class: returns the class (imported on first use: the libraries are slow to import).
        sizes: the default ``size`` of :func:`amxopt.models.example_inputs`, for real and tiny entries.
        examples: ``(spec, config, size, dtype, seed) -> inputs``, through the real preprocessing.
        entries: zoo name -> :class:`Entry`; ``tiny-*`` names are test-sized variants.
    """

    name: str
    library: str
    model_class: Callable[[], type[torch.nn.Module]]
    sizes: tuple[Any, Any]
    examples: Callable[..., dict[str, torch.Tensor]]
    entries: Mapping[str, Entry]


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One zoo entry.

    Args:
        name: zoo name (key of :data:`amxopt.models.ZOO`).
        family: ``"qwen3_vl_vision"``, ``"qwen3_omni_vision"``, ``"qwen3_omni_audio"`` or ``"wan"``.
        description: one line about what the entry reproduces.
        build: builds the fp32 model with random (unseeded) init, in eval mode.
        config: returns a fresh config: a ``transformers`` config object for the Qwen families, a
            dict of ``WanTransformer3DModel`` constructor kwargs for ``wan``.
        default_size: the ``size`` :func:`amxopt.models.example_inputs` uses when none is given.
        tiny: whether this is a test-sized variant.
    """

    name: str
    family: str
    description: str
    build: Callable[[], torch.nn.Module]
    config: Callable[[], Any] = dataclasses.field(default=lambda: None, repr=False)
    default_size: Any = None
    tiny: bool = False


def config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    if config is None:
        raise ValueError("expected a zoo model or its config")
    return config


def get(config: Any, key: str) -> Any:
    """``config[key]`` for a dict config (Wan's), ``config.key`` for a transformers config."""
    if isinstance(config, Mapping):
        return config[key]
    return getattr(config, key)
