"""Model zoo: the real encoder/transformer architectures amxopt targets, with random weights.

One table per family (``qwen.py``: Qwen3-VL vision, Qwen3-Omni vision and audio; ``wan.py``: Wan),
each entry built from an explicit config (the config classes' defaults do not match the released
checkpoints, so the released values are spelled out) and initialized with a seeded, fast,
checkpoint-like init (``build.py``). No hub access is needed or attempted.

Families:

* ``qwen3_vl_vision``: ``transformers`` ``Qwen3VLVisionModel`` (Qwen3-VL 2B / 8B vision towers; the MoE models' ``Qwen3VLMoeVisionModel`` is the same tower).
* ``qwen3_omni_vision``: ``Qwen3OmniMoeVisionEncoder`` (Qwen3-Omni vision tower).
* ``qwen3_omni_audio``: ``Qwen3OmniMoeAudioEncoder`` (Qwen3-Omni audio tower).
* ``wan``: ``diffusers`` ``WanTransformer3DModel`` (Wan 2.1 T2V 1.3B / 14B, Wan 2.2 TI2V 5B).

Each family also has a ``tiny-*`` variant (same class, same structural features, tiny widths) for
tests and quick looks (``amxopt dump tiny-wan``). Inputs are produced by the real preprocessing from
deterministic sample data (``samples.py``).

Example::

    model = build_model("tiny-qwen3-vl-vision", torch.bfloat16)
    out = model(**example_inputs("tiny-qwen3-vl-vision", torch.bfloat16))
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from amxopt.models import qwen, wan
from amxopt.models.build import (
    _default_dtype,
    _keep_fp32_names,
    _matches_module,
    check_memory,
    construct,
    reinit,
)
from amxopt.models.qwen import audio_inputs, image_inputs
from amxopt.models.samples import synthetic_image, synthetic_waveform
from amxopt.models.spec import Family, ModelSpec
from amxopt.models.wan import wan_inputs

logger = logging.getLogger(__name__)

FAMILIES: dict[str, Family] = {
    f.name: f for f in (qwen.QWEN3_VL_VISION, qwen.QWEN3_OMNI_VISION, qwen.QWEN3_OMNI_AUDIO, wan.WAN)
}


def _build(name: str, dtype: torch.dtype) -> torch.nn.Module:
    spec = _spec(name)
    model = construct(FAMILIES[spec.family], spec.config(), dtype)
    reinit(model)
    model.eval()
    model.zoo_name = spec.name
    return model


def _make_spec(family: Family, name: str) -> ModelSpec:
    tiny = name.startswith("tiny-")
    return ModelSpec(
        name=name,
        family=family.name,
        description=family.entries[name].description,
        build=lambda: _build(name, torch.float32),
        config=family.entries[name].config,
        default_size=family.sizes[tiny],
        tiny=tiny,
    )


# The released configs first, then the test-sized ones.
ZOO: dict[str, ModelSpec] = {
    name: _make_spec(f, name)
    for tiny in (False, True)
    for f in FAMILIES.values()
    for name in f.entries
    if name.startswith("tiny-") == tiny
}


def _spec(name: str) -> ModelSpec:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; valid names: {list(ZOO)}") from None


def _model_class(family: str) -> type[torch.nn.Module]:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid families: {list(FAMILIES)}")
    return FAMILIES[family].model_class()


# build_model's RNG use and construction (``construct``, ``reinit``) live in build.py.
_reinit = reinit


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, **config: Any) -> torch.nn.Module:
    """Build a zoo model with seeded random weights, in eval mode.

    The model is created directly in ``dtype`` (as ``from_pretrained(torch_dtype=dtype)`` would):
    parameters of the class's keep-in-fp32 modules stay fp32 (for Wan: ``time_embedder``,
    ``scale_shift_table``, ``norm1/2/3``), and non-persistent buffers keep the dtype the library
    gives them (fp32 rotary/sinusoid tables for Qwen, float64 rope tables for Wan). Weights are
    drawn in fp32 and cast, so the bf16 build equals the fp32 build (same seed) rounded to bf16.
    Resets the global torch RNG (``torch.manual_seed(seed)``). The model gets a ``zoo_name``
    attribute.

    Args:
        name: a key of :data:`ZOO`.
        dtype: parameter dtype (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``).
        seed: seed for the weights.
        **config: config values that replace the zoo's (e.g. ``num_heads=16`` for a head count
            that tensor parallelism must pad).

    Returns:
        The model, in ``eval()`` mode.

    Raises:
        KeyError: ``name`` is not in the zoo (the message lists the valid names), or a ``config``
            key is not one of its config's.
        MemoryError: the weights would not fit in the available memory.

    Example::

        model = build_model("tiny-wan", torch.bfloat16, seed=1)
    """
    spec = _spec(name)
    family = FAMILIES[spec.family]
    if not spec.tiny:
        check_memory(spec, family, dtype)
    start = time.perf_counter()
    torch.manual_seed(seed)
    values = _config_with(spec, config, "build_model")
    model = construct(family, values, dtype)
    torch.manual_seed(seed)
    reinit(model)
    model.eval()
    model.zoo_name = spec.name
    params = sum(p.numel() for p in model.parameters())
    logger.info(
        "built %s (%s, %.1fM params, %s, seed %d) in %.1fs",
        name,
        type(model).__name__,
        params / 1e6,
        dtype,
        seed,
        time.perf_counter() - start,
    )
    return model


def _config_with(spec: ModelSpec, changes: Mapping[str, Any], caller: str) -> Any:
    """A fresh config of ``spec`` with ``changes`` applied; a key the config lacks raises KeyError."""
    family = FAMILIES[spec.family]
    values = spec.config()
    for key, value in changes.items():
        if isinstance(values, dict) and key in _init_arguments(family):
            values[key] = value
        elif hasattr(values, key):
            setattr(values, key, value)
        else:  # a config object takes any attribute, diffusers' from_config drops unknown keys: a
            # misspelt key would change nothing
            where = family.model_class().__name__ if isinstance(values, dict) else type(values).__name__
            raise KeyError(f"{caller}({spec.name!r}): {where} has no {key!r}")
    return values


def _init_arguments(family: Family) -> set[str]:
    """The config keys a diffusers model class takes: its constructor's arguments."""
    return set(inspect.signature(family.model_class().__init__).parameters) - {"self"}


def example_inputs(
    name: str,
    dtype: torch.dtype = torch.float32,
    *,
    size: str | int | tuple | list | None = None,
    seed: int = 0,
    config: Mapping[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Keyword inputs for ``build_model(name)(**inputs)``, through the real preprocessing.

    Does not build the model (only its config).

    Args:
        name: a key of :data:`ZOO`.
        dtype: dtype of the floating inputs (pixels, mel features, latents, text embeddings).
        size: vision: side in pixels (int), ``(height, width)``, or a list of those for several
            images (default 448 real / 64 tiny); audio: seconds, or a list of seconds for several
            clips (default 30 real / 2 tiny); Wan: latent ``(F, H, W)`` or ``(F, H, W, text)``
            (default ``(5, 32, 32, 512)`` real / ``(2, 8, 8, 16)`` tiny). A string is parsed as
            a Python literal (``"448"``, ``"(5, 32, 32)"``).
        seed: seed of the synthetic images / waveforms / latents (image ``i`` uses ``seed + i``).
        config: the config values given to ``build_model(name, **config)``: inputs for that model
            (patch sizes, mel bins, Wan's latent channels and text width follow them; the Qwen
            image processors make RGB pixels, so a Qwen vision ``in_channels`` other than 3 does not fit).

    Returns:
        A dict of tensors to pass as ``model(**inputs)``.

    Raises:
        KeyError: ``name`` is not in the zoo, or a ``config`` key is not one of its config's.
        ValueError: ``size`` does not fit the family.

    Example::

        inputs = example_inputs("qwen3-vl-2b-vision", torch.bfloat16, size=[448, (224, 336)])
    """
    spec = _spec(name)
    if size is None:
        size = spec.default_size
    if isinstance(size, str):
        import ast

        try:
            size = ast.literal_eval(size)
        except (ValueError, SyntaxError) as exc:
            raise ValueError(f"cannot parse size {size!r}") from exc
    return FAMILIES[spec.family].examples(spec, _config_with(spec, config or {}, "example_inputs"), size, dtype, seed)


__all__ = [
    "FAMILIES",
    "ZOO",
    "Family",
    "ModelSpec",
    "audio_inputs",
    "build_model",
    "example_inputs",
    "image_inputs",
    "synthetic_image",
    "synthetic_waveform",
    "wan_inputs",
    "_default_dtype",
    "_keep_fp32_names",
    "_matches_module",
]
