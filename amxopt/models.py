"""Model zoo: the real encoder/transformer architectures amxopt targets, with random weights.

Every entry is built from an explicit config object (the config classes' defaults do not match the
released checkpoints, so the released values are spelled out here) and initialized with a seeded,
fast, checkpoint-like init: N(0, 0.02) for Linear/Conv/Embedding weights and other free parameters,
zeros for biases, ones for norm weights. No hub access is needed or attempted.

Families:

* ``qwen3_vl_vision``: ``transformers`` ``Qwen3VLVisionModel`` (Qwen3-VL 2B / 8B vision towers).
* ``qwen3_omni_vision``: ``Qwen3OmniMoeVisionEncoder`` (Qwen3-Omni vision tower).
* ``qwen3_omni_audio``: ``Qwen3OmniMoeAudioEncoder`` (Qwen3-Omni audio tower).
* ``wan``: ``diffusers`` ``WanTransformer3DModel`` (Wan 2.1 T2V 1.3B / 14B, Wan 2.2 TI2V 5B).

Each family also has a ``tiny-*`` variant (same class, same structural features, tiny widths) for
tests. Inputs are produced by the real preprocessing: ``Qwen2VLImageProcessorPil`` for images,
``WhisperFeatureExtractor`` (as configured by Qwen3-Omni) for audio, seeded latents for Wan.

Example::

    model = build_model("tiny-qwen3-vl-vision", torch.bfloat16)
    out = model(**example_inputs("tiny-qwen3-vl-vision", torch.bfloat16))
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageDraw
import torch

logger = logging.getLogger(__name__)

_FAMILIES = ("qwen3_vl_vision", "qwen3_omni_vision", "qwen3_omni_audio", "wan")
_INIT_STD = 0.02
_ATTN_IMPLEMENTATION = "sdpa"

# Qwen3-VL image processor (preprocessor_config.json of the released checkpoints).
_QWEN_IMAGE_MEAN = (0.5, 0.5, 0.5)
_QWEN_IMAGE_STD = (0.5, 0.5, 0.5)
_QWEN_MIN_PIXELS = 65536  # 256 * 256
_QWEN_MAX_PIXELS = 16777216  # 4096 * 4096

# Qwen3-Omni audio front end (WhisperFeatureExtractor settings + Qwen3OmniMoeProcessor call kwargs).
_AUDIO_SAMPLING_RATE = 16000
_AUDIO_HOP_LENGTH = 160
_AUDIO_CHUNK_LENGTH = 300
_AUDIO_N_FFT = 400

_WAN_TIMESTEP = 500.0

# Fraction of MemAvailable a model may take before build_model refuses to build it.
_MEMORY_HEADROOM = 0.9
_MEMORY_CHECK_MIN_BYTES = 1 << 30


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One zoo entry.

    Args:
        name: zoo name (key of :data:`ZOO`).
        family: ``"qwen3_vl_vision"``, ``"qwen3_omni_vision"``, ``"qwen3_omni_audio"`` or ``"wan"``.
        description: one line about what the entry reproduces.
        build: builds the fp32 model with random (unseeded) init, in eval mode.
        config: returns a fresh config: a ``transformers`` config object for the Qwen families, a
            dict of ``WanTransformer3DModel`` constructor kwargs for ``wan``.
        default_size: the ``size`` :func:`example_inputs` uses when none is given.
        tiny: whether this is a test-sized variant.
    """

    name: str
    family: str
    description: str
    build: Callable[[], torch.nn.Module]
    config: Callable[[], Any] = dataclasses.field(default=lambda: None, repr=False)
    default_size: Any = None
    tiny: bool = False


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


# Shared by the Qwen3-VL and Qwen3-Omni vision towers (same architecture, different classes).
_QWEN_VISION_BASE = dict(
    hidden_act="gelu_pytorch_tanh",
    in_channels=3,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    initializer_range=_INIT_STD,
)


def _qwen3_vl_vision_config(**values: Any) -> Any:
    from transformers import Qwen3VLVisionConfig

    return Qwen3VLVisionConfig(**{**_QWEN_VISION_BASE, **values})


def _qwen3_omni_vision_config(**values: Any) -> Any:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeVisionEncoderConfig,
    )

    return Qwen3OmniMoeVisionEncoderConfig(**{**_QWEN_VISION_BASE, **values})


def _qwen3_omni_audio_config(**values: Any) -> Any:
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeAudioEncoderConfig,
    )

    base = dict(
        num_mel_bins=128,
        n_window=50,
        n_window_infer=800,
        conv_chunksize=500,
        max_source_positions=1500,
        activation_function="gelu",
        scale_embedding=False,
        initializer_range=_INIT_STD,
    )
    base.update(values)
    return Qwen3OmniMoeAudioEncoderConfig(**base)


def _wan_config(**values: Any) -> dict[str, Any]:
    base = dict(
        patch_size=(1, 2, 2),
        attention_head_dim=128,
        in_channels=16,
        out_channels=16,
        text_dim=4096,
        freq_dim=256,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    base.update(values)
    return base


_CONFIGS: dict[str, Callable[[], Any]] = {
    "qwen3-vl-2b-vision": lambda: _qwen3_vl_vision_config(
        depth=24,
        hidden_size=1024,
        num_heads=16,
        intermediate_size=4096,
        out_hidden_size=2048,
        deepstack_visual_indexes=[5, 11, 17],
    ),
    "qwen3-vl-8b-vision": lambda: _qwen3_vl_vision_config(
        depth=27,
        hidden_size=1152,
        num_heads=16,
        intermediate_size=4304,
        out_hidden_size=4096,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    "qwen3-omni-vision": lambda: _qwen3_omni_vision_config(
        depth=27,
        hidden_size=1152,
        num_heads=16,
        intermediate_size=4304,
        out_hidden_size=2048,
        deepstack_visual_indexes=[8, 16, 24],
    ),
    "qwen3-omni-audio": lambda: _qwen3_omni_audio_config(
        d_model=1280,
        encoder_layers=32,
        encoder_attention_heads=20,
        encoder_ffn_dim=5120,
        downsample_hidden_size=480,
        output_dim=2048,
    ),
    "wan2.1-t2v-1.3b": lambda: _wan_config(num_attention_heads=12, ffn_dim=8960, num_layers=30),
    "wan2.1-t2v-14b": lambda: _wan_config(num_attention_heads=40, ffn_dim=13824, num_layers=40),
    "wan2.2-ti2v-5b": lambda: _wan_config(
        num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48
    ),
    "tiny-qwen3-vl-vision": lambda: _qwen3_vl_vision_config(
        depth=3,
        hidden_size=64,
        num_heads=4,
        intermediate_size=128,
        out_hidden_size=96,
        deepstack_visual_indexes=[0, 2],
        num_position_embeddings=64,
    ),
    "tiny-qwen3-omni-vision": lambda: _qwen3_omni_vision_config(
        depth=3,
        hidden_size=64,
        num_heads=4,
        intermediate_size=128,
        out_hidden_size=80,
        deepstack_visual_indexes=[0, 2],
        num_position_embeddings=64,
    ),
    "tiny-qwen3-omni-audio": lambda: _qwen3_omni_audio_config(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        downsample_hidden_size=32,
        output_dim=48,
    ),
    "tiny-wan": lambda: _wan_config(
        num_attention_heads=2,
        attention_head_dim=32,
        ffn_dim=128,
        num_layers=2,
        text_dim=64,
        freq_dim=32,
    ),
}


# --------------------------------------------------------------------------------------------------
# Construction and init
# --------------------------------------------------------------------------------------------------


def _model_class(family: str) -> type[torch.nn.Module]:
    if family == "qwen3_vl_vision":
        from transformers import Qwen3VLVisionModel

        return Qwen3VLVisionModel
    if family == "qwen3_omni_vision":
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeVisionEncoder,
        )

        return Qwen3OmniMoeVisionEncoder
    if family == "qwen3_omni_audio":
        from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
            Qwen3OmniMoeAudioEncoder,
        )

        return Qwen3OmniMoeAudioEncoder
    if family == "wan":
        from diffusers import WanTransformer3DModel

        return WanTransformer3DModel
    raise ValueError(f"unknown model family {family!r}; valid families: {list(_FAMILIES)}")


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _keep_fp32_names(cls: type[torch.nn.Module], dtype: torch.dtype) -> list[str]:
    """Module names ``from_pretrained(torch_dtype=dtype)`` would keep in fp32 for ``cls``."""
    if dtype == torch.float32:
        return []
    from transformers import PreTrainedModel

    names: list[str] = []
    if issubclass(cls, PreTrainedModel):
        # transformers: the non-strict list only applies to fp16, the strict one to fp16 and bf16.
        if dtype == torch.float16:
            names += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
        if dtype in (torch.float16, torch.bfloat16):
            names += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    else:
        # diffusers: `_keep_in_fp32_modules` applies to any torch_dtype.
        names += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
        names += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    return names


def _matches_module(param_name: str, module_names: Sequence[str]) -> bool:
    """Whether ``param_name`` lies in a module called like one of ``module_names`` (whole dotted
    components, as diffusers' ``module in name.split(".")``)."""
    for module_name in module_names:
        if re.search(rf"(^|\.){re.escape(module_name)}($|\.)", param_name):
            return True
    return False


def _construct(family: str, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """Instantiate ``family`` from ``config`` directly in ``dtype`` without running any weight
    init (parameters hold garbage until :func:`_reinit`), then upcast the keep-in-fp32 modules."""
    cls = _model_class(family)
    if family == "wan":
        from diffusers.models.modeling_utils import no_init_weights

        with no_init_weights(), _default_dtype(dtype):
            model = cls.from_config(dict(config))
    else:
        from transformers.initialization import no_init_weights

        with no_init_weights():
            model = cls._from_config(config, dtype=dtype, attn_implementation=_ATTN_IMPLEMENTATION)
    keep = _keep_fp32_names(cls, dtype)
    if keep:
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and _matches_module(name, keep):
                tensor.data = tensor.data.to(torch.float32)
    return model


def _is_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return "Norm" in name or isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm))


@torch.no_grad()
def _reinit(model: torch.nn.Module) -> None:
    """Fill every parameter from the global RNG in a dtype-independent way.

    Values are drawn in fp32 in ``named_modules`` order and then cast, so a bf16 build holds exactly
    the bf16 rounding of the fp32 build with the same seed.
    """
    for _, module in model.named_modules():
        norm = _is_norm(module)
        for pname, param in module.named_parameters(recurse=False):
            if pname == "bias" or pname.endswith("_bias"):
                param.zero_()
            elif norm and pname == "weight":
                param.fill_(1.0)
            elif param.dtype == torch.float32:
                param.normal_(0.0, _INIT_STD)
            else:
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, _INIT_STD))


def _build(spec_name: str, dtype: torch.dtype) -> torch.nn.Module:
    spec = _spec(spec_name)
    model = _construct(spec.family, spec.config(), dtype)
    _reinit(model)
    model.eval()
    model.zoo_name = spec.name
    return model


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _check_memory(spec: ModelSpec, dtype: torch.dtype) -> None:
    """Raise :class:`MemoryError` up front instead of letting the OOM killer end the process."""
    with torch.device("meta"):
        model = _construct(spec.family, spec.config(), dtype)
    needed = sum(t.numel() * t.element_size() for t in model.parameters())
    available = _available_memory()
    if needed < _MEMORY_CHECK_MIN_BYTES or available is None:
        return
    if needed > _MEMORY_HEADROOM * available:
        raise MemoryError(
            f"{spec.name} in {dtype} needs ~{needed / 2**30:.1f} GiB of weights but only "
            f"{available / 2**30:.1f} GiB of memory is available"
        )


# --------------------------------------------------------------------------------------------------
# Zoo
# --------------------------------------------------------------------------------------------------

_DESCRIPTIONS = {
    "qwen3-vl-2b-vision": "Qwen3-VL-2B vision tower (24 blocks, 1024 wide, deepstack 5/11/17)",
    "qwen3-vl-8b-vision": "Qwen3-VL-8B vision tower (27 blocks, 1152 wide, deepstack 8/16/24)",
    "qwen3-omni-vision": "Qwen3-Omni-30B-A3B vision encoder (27 blocks, 1152 wide, out 2048)",
    "qwen3-omni-audio": "Qwen3-Omni-30B-A3B audio encoder (32 layers, 1280 wide, 128 mels)",
    "wan2.1-t2v-1.3b": "Wan2.1 T2V 1.3B DiT (30 blocks, 12x128 heads, ffn 8960)",
    "wan2.1-t2v-14b": "Wan2.1 T2V 14B DiT (40 blocks, 40x128 heads, ffn 13824)",
    "wan2.2-ti2v-5b": "Wan2.2 TI2V 5B DiT (30 blocks, 24x128 heads, ffn 14336, 48 latent channels)",
    "tiny-qwen3-vl-vision": "test-sized Qwen3VLVisionModel (3 blocks, 64 wide, deepstack 0/2)",
    "tiny-qwen3-omni-vision": "test-sized Qwen3OmniMoeVisionEncoder (3 blocks, 64 wide)",
    "tiny-qwen3-omni-audio": "test-sized Qwen3OmniMoeAudioEncoder (2 layers, 64 wide, 128 mels)",
    "tiny-wan": "test-sized WanTransformer3DModel (2 blocks, 2x32 heads)",
}

_FAMILY_OF = {
    "qwen3-vl-2b-vision": "qwen3_vl_vision",
    "qwen3-vl-8b-vision": "qwen3_vl_vision",
    "qwen3-omni-vision": "qwen3_omni_vision",
    "qwen3-omni-audio": "qwen3_omni_audio",
    "wan2.1-t2v-1.3b": "wan",
    "wan2.1-t2v-14b": "wan",
    "wan2.2-ti2v-5b": "wan",
    "tiny-qwen3-vl-vision": "qwen3_vl_vision",
    "tiny-qwen3-omni-vision": "qwen3_omni_vision",
    "tiny-qwen3-omni-audio": "qwen3_omni_audio",
    "tiny-wan": "wan",
}

_DEFAULT_SIZES = {
    "qwen3_vl_vision": (448, 64),
    "qwen3_omni_vision": (448, 64),
    "qwen3_omni_audio": (30.0, 2.0),
    "wan": ((5, 32, 32, 512), (2, 8, 8, 16)),
}


def _make_spec(name: str) -> ModelSpec:
    family = _FAMILY_OF[name]
    tiny = name.startswith("tiny-")
    real_size, tiny_size = _DEFAULT_SIZES[family]
    return ModelSpec(
        name=name,
        family=family,
        description=_DESCRIPTIONS[name],
        build=lambda: _build(name, torch.float32),
        config=_CONFIGS[name],
        default_size=tiny_size if tiny else real_size,
        tiny=tiny,
    )


ZOO: dict[str, ModelSpec] = {name: _make_spec(name) for name in _CONFIGS}


def _spec(name: str) -> ModelSpec:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model {name!r}; valid names: {list(ZOO)}") from None


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
        KeyError: ``name`` is not in the zoo (the message lists the valid names).
        MemoryError: the weights would not fit in the available memory.

    Example::

        model = build_model("tiny-wan", torch.bfloat16, seed=1)
    """
    spec = _spec(name)
    if not spec.tiny:
        _check_memory(spec, dtype)
    start = time.perf_counter()
    torch.manual_seed(seed)
    values = spec.config()
    for key, value in config.items():
        if isinstance(values, dict):
            values[key] = value
        else:
            setattr(values, key, value)
    model = _construct(spec.family, values, dtype)
    torch.manual_seed(seed)
    _reinit(model)
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


# --------------------------------------------------------------------------------------------------
# Synthetic data
# --------------------------------------------------------------------------------------------------


def synthetic_image(height: int, width: int, seed: int = 0) -> PIL.Image.Image:
    """A deterministic RGB test image: colour gradients, a few shapes and pixel noise.

    Args:
        height: image height in pixels.
        width: image width in pixels.
        seed: selects the shapes, colours and noise.

    Returns:
        An RGB ``PIL.Image.Image`` of size ``(width, height)``.

    Example::

        img = synthetic_image(448, 448, seed=3)
    """
    rng = np.random.default_rng(seed)
    ys = np.linspace(0.0, 1.0, height, dtype=np.float32)[:, None]
    xs = np.linspace(0.0, 1.0, width, dtype=np.float32)[None, :]
    phase = rng.uniform(0.0, 2.0 * np.pi, size=3)
    radial = np.sqrt((xs - 0.5) ** 2 + (ys - 0.5) ** 2)
    base = np.stack(
        [
            0.5 + 0.5 * np.sin(2.0 * np.pi * xs + phase[0]) * np.ones_like(ys),
            0.5 + 0.5 * np.cos(2.0 * np.pi * ys + phase[1]) * np.ones_like(xs),
            0.5 + 0.5 * np.cos(6.0 * np.pi * radial + phase[2]),
        ],
        axis=-1,
    )
    image = PIL.Image.fromarray((base * 255.0).astype(np.uint8))
    draw = PIL.ImageDraw.Draw(image)
    for _ in range(6):
        x0, x1 = sorted(rng.uniform(0, width, size=2).tolist())
        y0, y1 = sorted(rng.uniform(0, height, size=2).tolist())
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        if rng.random() < 0.5:
            draw.rectangle([x0, y0, x1, y1], fill=color)
        else:
            draw.ellipse([x0, y0, x1, y1], fill=color)
    for _ in range(4):
        points = [(float(rng.uniform(0, width)), float(rng.uniform(0, height))) for _ in range(2)]
        color = tuple(int(c) for c in rng.integers(0, 256, size=3))
        draw.line(points, fill=color, width=max(1, min(height, width) // 64))
    pixels = np.asarray(image, dtype=np.float32)
    pixels = pixels + rng.normal(0.0, 8.0, size=pixels.shape)
    return PIL.Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def synthetic_waveform(seconds: float, sampling_rate: int = 16000, seed: int = 0) -> np.ndarray:
    """A deterministic mono test signal: a few linear chirps under an envelope, plus noise.

    Args:
        seconds: duration.
        sampling_rate: samples per second.
        seed: selects the chirps and the noise.

    Returns:
        ``float32`` array of ``round(seconds * sampling_rate)`` samples, peak amplitude 0.5.

    Example::

        wav = synthetic_waveform(30.0)  # 480000 samples
    """
    rng = np.random.default_rng(seed)
    n = int(round(seconds * sampling_rate))
    t = np.arange(n, dtype=np.float64) / sampling_rate
    duration = max(seconds, 1.0 / sampling_rate)
    nyquist = sampling_rate / 2.0
    signal = np.zeros(n, dtype=np.float64)
    for _ in range(3):
        f0, f1 = rng.uniform(80.0, 0.8 * nyquist, size=2)
        amp = rng.uniform(0.3, 1.0)
        rate = rng.uniform(0.2, 3.0)
        # Linear chirp: instantaneous frequency f0 + (f1 - f0) * t / duration.
        chirp = np.sin(2.0 * np.pi * (f0 * t + 0.5 * (f1 - f0) * t**2 / duration))
        envelope = 0.5 + 0.5 * np.sin(2.0 * np.pi * rate * t + rng.uniform(0, 2 * np.pi))
        signal += amp * envelope * chirp
    signal += 0.05 * rng.standard_normal(n)
    peak = np.max(np.abs(signal)) if n else 1.0
    return (0.5 * signal / max(peak, 1e-8)).astype(np.float32)


# --------------------------------------------------------------------------------------------------
# Input builders
# --------------------------------------------------------------------------------------------------


def _config_of(model_or_config: Any) -> Any:
    config = getattr(model_or_config, "config", model_or_config)
    if config is None:
        raise ValueError("expected a zoo model or its config")
    return config


def _get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config[key]
    return getattr(config, key)


def _default_min_pixels(model_or_config: Any, patch_size: int, merge_size: int) -> int:
    name = getattr(model_or_config, "zoo_name", None)
    if name in ZOO and ZOO[name].tiny:
        return (patch_size * merge_size) ** 2
    return _QWEN_MIN_PIXELS


def image_inputs(
    model: Any,
    images: list[PIL.Image.Image],
    dtype: torch.dtype = torch.float32,
    *,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
) -> dict[str, torch.Tensor]:
    """Preprocess images for a Qwen3-VL / Qwen3-Omni vision tower.

    Uses ``transformers.Qwen2VLImageProcessorPil`` (the torchvision-free backend) configured as
    the released Qwen3-VL checkpoints: patch/temporal patch/merge sizes from the model config,
    mean = std = 0.5, bicubic smart-resize to multiples of ``patch_size * merge_size`` within
    ``[min_pixels, max_pixels]`` (65536 .. 16777216; tiny zoo models use a minimum of one merged
    patch so that small test images are not upscaled).

    Args:
        model: a vision model (or its config, or a ``build_model`` result).
        images: one or more images; their patches are concatenated.
        dtype: dtype of the returned pixel patches.
        min_pixels: override of the smart-resize lower bound.
        max_pixels: override of the smart-resize upper bound.

    Returns:
        ``{"hidden_states": (num_patches, 3 * t_patch * patch * patch) float tensor,
        "grid_thw": (num_images, 3) int64 tensor}``.

    Example::

        inputs = image_inputs(model, [synthetic_image(448, 448)])  # grid_thw [[1, 28, 28]]
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    config = _config_of(model)
    patch_size = int(config.patch_size)
    merge_size = int(config.spatial_merge_size)
    if min_pixels is None:
        min_pixels = _default_min_pixels(model, patch_size, merge_size)
    if max_pixels is None:
        max_pixels = _QWEN_MAX_PIXELS
    processor = Qwen2VLImageProcessorPil(
        do_resize=True,
        size={"shortest_edge": int(min_pixels), "longest_edge": int(max_pixels)},
        patch_size=patch_size,
        temporal_patch_size=int(config.temporal_patch_size),
        merge_size=merge_size,
        image_mean=list(_QWEN_IMAGE_MEAN),
        image_std=list(_QWEN_IMAGE_STD),
        do_convert_rgb=True,
    )
    out = processor(images=list(images), return_tensors="pt")
    return {
        "hidden_states": out["pixel_values"].to(dtype),
        "grid_thw": out["image_grid_thw"],
    }


def audio_inputs(
    model: Any, waveforms: list[np.ndarray], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Log-mel features for the Qwen3-Omni audio encoder.

    Runs ``transformers.WhisperFeatureExtractor(feature_size=num_mel_bins, sampling_rate=16000,
    hop_length=160, chunk_length=300, n_fft=400)`` with the Qwen3-Omni processor's call arguments
    (``padding=True, truncation=False, return_attention_mask=True``), then packs the valid frames
    of every clip along time exactly as ``Qwen3OmniMoeThinkerModel.get_audio_features`` does.
    A clip of ``s`` seconds gives ``100 * s`` frames (30 s -> 3000).

    Args:
        model: the audio encoder (or its config).
        waveforms: mono 16 kHz clips (1-D float arrays).
        dtype: dtype of the returned features.

    Returns:
        ``{"input_features": (num_mel_bins, total_frames) float tensor,
        "feature_lens": (num_clips,) int64 tensor}``.

    Example::

        inputs = audio_inputs(model, [synthetic_waveform(30.0)])  # feature_lens [3000]
    """
    from transformers import WhisperFeatureExtractor

    config = _config_of(model)
    extractor = WhisperFeatureExtractor(
        feature_size=int(config.num_mel_bins),
        sampling_rate=_AUDIO_SAMPLING_RATE,
        hop_length=_AUDIO_HOP_LENGTH,
        chunk_length=_AUDIO_CHUNK_LENGTH,
        n_fft=_AUDIO_N_FFT,
    )
    out = extractor(
        [np.asarray(w, dtype=np.float32) for w in waveforms],
        sampling_rate=_AUDIO_SAMPLING_RATE,
        padding=True,
        truncation=False,
        return_attention_mask=True,
        return_tensors="pt",
    )
    features, mask = out["input_features"], out["attention_mask"].bool()
    packed = features.permute(0, 2, 1)[mask].permute(1, 0).contiguous()
    return {
        "input_features": packed.to(dtype),
        "feature_lens": mask.sum(-1).to(torch.long),
    }


def wan_inputs(
    model: Any,
    frames: int,
    height: int,
    width: int,
    text_tokens: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """Seeded inputs for one Wan DiT denoising step (batch 1).

    Args:
        model: a ``WanTransformer3DModel`` (or its config / config dict).
        frames: latent frames ``F``.
        height: latent height ``H`` (a multiple of the spatial patch size).
        width: latent width ``W`` (a multiple of the spatial patch size).
        text_tokens: length of the text embedding sequence.
        dtype: dtype of the latents and text embeddings (the timestep stays fp32).
        seed: seed for the latents and text embeddings.

    Returns:
        ``{"hidden_states": (1, in_channels, F, H, W), "timestep": fp32 tensor [500.0],
        "encoder_hidden_states": (1, text_tokens, text_dim)}``; the video sequence is
        ``F/pt * H/ph * W/pw`` tokens.

    Example::

        inputs = wan_inputs(model, 5, 32, 32, 512, torch.bfloat16)  # 1280 video tokens
    """
    config = _config_of(model)
    patch = tuple(_get(config, "patch_size"))
    if frames % patch[0] or height % patch[1] or width % patch[2]:
        raise ValueError(f"latent size {(frames, height, width)} is not a multiple of {patch}")
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn((1, int(_get(config, "in_channels")), frames, height, width), generator=generator)
    text = torch.randn((1, text_tokens, int(_get(config, "text_dim"))), generator=generator)
    return {
        "hidden_states": latents.to(dtype),
        "timestep": torch.tensor([_WAN_TIMESTEP], dtype=torch.float32),
        "encoder_hidden_states": text.to(dtype),
    }


def _image_sizes(size: Any) -> list[tuple[int, int]]:
    def one(item: Any) -> tuple[int, int]:
        if isinstance(item, (int, np.integer)):
            return int(item), int(item)
        if isinstance(item, (tuple, list)) and len(item) == 2:
            return int(item[0]), int(item[1])
        raise ValueError(f"bad image size {item!r}: expected an int or (height, width)")

    if isinstance(size, tuple) and len(size) == 2 and all(isinstance(v, int) for v in size):
        return [one(size)]
    if isinstance(size, list):
        if not size:
            raise ValueError("empty list of image sizes")
        return [one(item) for item in size]
    return [one(size)]


def _audio_lengths(size: Any) -> list[float]:
    if isinstance(size, (list, tuple)):
        if not size:
            raise ValueError("empty list of audio lengths")
        return [float(s) for s in size]
    return [float(size)]


def example_inputs(
    name: str,
    dtype: torch.dtype = torch.float32,
    *,
    size: str | int | tuple | list | None = None,
    seed: int = 0,
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

    Returns:
        A dict of tensors to pass as ``model(**inputs)``.

    Raises:
        KeyError: ``name`` is not in the zoo.
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
    config = spec.config()
    if spec.family in ("qwen3_vl_vision", "qwen3_omni_vision"):
        images = [synthetic_image(h, w, seed + i) for i, (h, w) in enumerate(_image_sizes(size))]
        merge = int(config.patch_size) * int(config.spatial_merge_size)
        min_pixels = merge * merge if spec.tiny else None
        return image_inputs(config, images, dtype, min_pixels=min_pixels)
    if spec.family == "qwen3_omni_audio":
        waves = [synthetic_waveform(s, _AUDIO_SAMPLING_RATE, seed + i) for i, s in enumerate(_audio_lengths(size))]
        return audio_inputs(config, waves, dtype)
    if spec.family == "wan":
        dims = tuple(int(v) for v in size) if isinstance(size, (tuple, list)) else ()
        if len(dims) == 3:
            dims = dims + (int(spec.default_size[3]),)
        if len(dims) != 4:
            raise ValueError(f"Wan size must be (F, H, W) or (F, H, W, text_tokens), got {size!r}")
        return wan_inputs(config, *dims, dtype=dtype, seed=seed)
    raise ValueError(f"unknown family {spec.family!r}")  # pragma: no cover
