"""The Qwen3 towers: Qwen3-VL vision, Qwen3-Omni vision and audio (``transformers``).

One table per family: the released checkpoints' configs, spelled out (the config classes' defaults
do not match them), and a test-sized variant with the same structural features. Inputs go through
the real preprocessing: ``Qwen2VLImageProcessorPil`` for images, ``WhisperFeatureExtractor`` (as
Qwen3-Omni configures it) for audio.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import PIL.Image
import torch

from amxopt.models.samples import synthetic_image, synthetic_waveform
from amxopt.models.spec import INIT_STD, Entry, Family, ModelSpec, config_of

# Qwen3-VL and Qwen3-Omni image processors (preprocessor_config.json of the released checkpoints):
# the same mean, std and patching; their own smart-resize bounds in pixels.
_QWEN_IMAGE_MEAN = (0.5, 0.5, 0.5)
_QWEN_IMAGE_STD = (0.5, 0.5, 0.5)
_QWEN_PIXELS = (65536, 16777216)  # Qwen3-VL: 256 * 256 .. 4096 * 4096
_OMNI_PIXELS = (3136, 12845056)  # Qwen3-Omni: 56 * 56 .. 28 * 28 * 16384 (Qwen2-VL's)

# Qwen3-Omni audio front end (WhisperFeatureExtractor settings + Qwen3OmniMoeProcessor call kwargs).
AUDIO_SAMPLING_RATE = 16000
_AUDIO_HOP_LENGTH = 160
_AUDIO_CHUNK_LENGTH = 300
_AUDIO_N_FFT = 400


# Shared by the Qwen3-VL and Qwen3-Omni vision towers (same architecture, different classes).
_QWEN_VISION_BASE = dict(
    hidden_act="gelu_pytorch_tanh",
    in_channels=3,
    patch_size=16,
    temporal_patch_size=2,
    spatial_merge_size=2,
    num_position_embeddings=2304,
    initializer_range=INIT_STD,
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
        initializer_range=INIT_STD,
    )
    base.update(values)
    return Qwen3OmniMoeAudioEncoderConfig(**base)


# --- the classes ------------------------------------------------------------------------------------


def _vl_vision_class() -> type[torch.nn.Module]:
    from transformers import Qwen3VLVisionModel

    return Qwen3VLVisionModel


def _omni_vision_class() -> type[torch.nn.Module]:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeVisionEncoder

    return Qwen3OmniMoeVisionEncoder


def _omni_audio_class() -> type[torch.nn.Module]:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    return Qwen3OmniMoeAudioEncoder


# --- inputs -----------------------------------------------------------------------------------------


def _default_pixels(model_or_config: Any, patch_size: int, merge_size: int) -> tuple[int, int]:
    """The smart-resize bounds of the processor released with the model: Qwen3-Omni's vision
    config is its own class; a tiny zoo model's minimum is one merged patch."""
    omni = "Omni" in type(config_of(model_or_config)).__name__
    low, high = _OMNI_PIXELS if omni else _QWEN_PIXELS
    if str(getattr(model_or_config, "zoo_name", "")).startswith("tiny-"):  # a tiny zoo model
        low = (patch_size * merge_size) ** 2
    return low, high


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
    the released checkpoints: patch/temporal patch/merge sizes from the model config,
    mean = std = 0.5, bicubic smart-resize to multiples of ``patch_size * merge_size`` within
    ``[min_pixels, max_pixels]`` (Qwen3-VL's 65536 .. 16777216, Qwen3-Omni's 3136 .. 12845056;
    tiny zoo models use a minimum of one merged patch so that small test images are not upscaled).

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

    config = config_of(model)
    patch_size = int(config.patch_size)
    merge_size = int(config.spatial_merge_size)
    low, high = _default_pixels(model, patch_size, merge_size)
    min_pixels = low if min_pixels is None else min_pixels
    max_pixels = high if max_pixels is None else max_pixels
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

    config = config_of(model)
    shortest = _AUDIO_N_FFT // 2 + 1  # the extractor reflect-pads each clip by n_fft / 2 on both sides
    for i, w in enumerate(waveforms):
        if np.asarray(w).ndim != 1 or len(w) < shortest:
            raise ValueError(
                f"audio_inputs: clip {i} has shape {tuple(np.asarray(w).shape)}; clips are 1-D, at least {shortest} "
                f"samples ({shortest / AUDIO_SAMPLING_RATE:.4f} s at {AUDIO_SAMPLING_RATE} Hz)"
            )
    extractor = WhisperFeatureExtractor(
        feature_size=int(config.num_mel_bins),
        sampling_rate=AUDIO_SAMPLING_RATE,
        hop_length=_AUDIO_HOP_LENGTH,
        chunk_length=_AUDIO_CHUNK_LENGTH,
        n_fft=_AUDIO_N_FFT,
    )
    out = extractor(
        [np.asarray(w, dtype=np.float32) for w in waveforms],
        sampling_rate=AUDIO_SAMPLING_RATE,
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


def _image_sizes(size: Any) -> list[tuple[int, int]]:
    def one(item: Any) -> tuple[int, int]:
        if isinstance(item, (int, np.integer)):
            sides = int(item), int(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            sides = int(item[0]), int(item[1])
        else:
            raise ValueError(f"bad image size {item!r}: expected an int or (height, width)")
        if min(sides) < 1:
            raise ValueError(f"bad image size {item!r}: sides must be >= 1 pixel")
        return sides

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
        lengths = [float(s) for s in size]
    else:
        lengths = [float(size)]
    if not all(0 < s < math.inf for s in lengths):
        raise ValueError(f"bad audio length {size!r}: seconds must be positive and finite")
    return lengths


def _image_examples(spec: ModelSpec, config: Any, size: Any, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    images = [synthetic_image(h, w, seed + i) for i, (h, w) in enumerate(_image_sizes(size))]
    merge = int(config.patch_size) * int(config.spatial_merge_size)
    return image_inputs(config, images, dtype, min_pixels=merge * merge if spec.tiny else None)


def _audio_examples(spec: ModelSpec, config: Any, size: Any, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    waves = [synthetic_waveform(s, AUDIO_SAMPLING_RATE, seed + i) for i, s in enumerate(_audio_lengths(size))]
    return audio_inputs(config, waves, dtype)


# --- the tables -------------------------------------------------------------------------------------

QWEN3_VL_VISION = Family(
    name="qwen3_vl_vision",
    library="transformers",
    model_class=_vl_vision_class,
    sizes=(448, 64),
    examples=_image_examples,
    entries={
        "qwen3-vl-2b-vision": Entry(
            "Qwen3-VL-2B vision tower (24 blocks, 1024 wide, deepstack 5/11/17)",
            lambda: _qwen3_vl_vision_config(
                depth=24,
                hidden_size=1024,
                num_heads=16,
                intermediate_size=4096,
                out_hidden_size=2048,
                deepstack_visual_indexes=[5, 11, 17],
            ),
        ),
        "qwen3-vl-8b-vision": Entry(
            "Qwen3-VL-8B vision tower (27 blocks, 1152 wide, deepstack 8/16/24)",
            lambda: _qwen3_vl_vision_config(
                depth=27,
                hidden_size=1152,
                num_heads=16,
                intermediate_size=4304,
                out_hidden_size=4096,
                deepstack_visual_indexes=[8, 16, 24],
            ),
        ),
        "tiny-qwen3-vl-vision": Entry(
            "test-sized Qwen3VLVisionModel (3 blocks, 64 wide, deepstack 0/2)",
            lambda: _qwen3_vl_vision_config(
                depth=3,
                hidden_size=64,
                num_heads=4,
                intermediate_size=128,
                out_hidden_size=96,
                deepstack_visual_indexes=[0, 2],
                num_position_embeddings=64,
            ),
        ),
    },
)

QWEN3_OMNI_VISION = Family(
    name="qwen3_omni_vision",
    library="transformers",
    model_class=_omni_vision_class,
    sizes=(448, 64),
    examples=_image_examples,
    entries={
        "qwen3-omni-vision": Entry(
            "Qwen3-Omni-30B-A3B vision encoder (27 blocks, 1152 wide, out 2048)",
            lambda: _qwen3_omni_vision_config(
                depth=27,
                hidden_size=1152,
                num_heads=16,
                intermediate_size=4304,
                out_hidden_size=2048,
                deepstack_visual_indexes=[8, 16, 24],
            ),
        ),
        "tiny-qwen3-omni-vision": Entry(
            "test-sized Qwen3OmniMoeVisionEncoder (3 blocks, 64 wide)",
            lambda: _qwen3_omni_vision_config(
                depth=3,
                hidden_size=64,
                num_heads=4,
                intermediate_size=128,
                out_hidden_size=80,
                deepstack_visual_indexes=[0, 2],
                num_position_embeddings=64,
            ),
        ),
    },
)

QWEN3_OMNI_AUDIO = Family(
    name="qwen3_omni_audio",
    library="transformers",
    model_class=_omni_audio_class,
    sizes=(30.0, 2.0),
    examples=_audio_examples,
    entries={
        "qwen3-omni-audio": Entry(
            "Qwen3-Omni-30B-A3B audio encoder (32 layers, 1280 wide, 128 mels)",
            lambda: _qwen3_omni_audio_config(
                d_model=1280,
                encoder_layers=32,
                encoder_attention_heads=20,
                encoder_ffn_dim=5120,
                downsample_hidden_size=480,
                output_dim=2048,
            ),
        ),
        "tiny-qwen3-omni-audio": Entry(
            "test-sized Qwen3OmniMoeAudioEncoder (2 layers, 64 wide, 128 mels)",
            lambda: _qwen3_omni_audio_config(
                d_model=64,
                encoder_layers=2,
                encoder_attention_heads=4,
                encoder_ffn_dim=128,
                downsample_hidden_size=32,
                output_dim=48,
            ),
        ),
    },
)
