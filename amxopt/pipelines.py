"""Whole models and pipelines around the zoo's towers, as users run them, with random weights.

* :func:`build_qwen3_vl`: ``transformers`` ``Qwen3VLForConditionalGeneration`` (a zoo vision tower
  plus a text decoder; ``moe=True``: ``Qwen3VLMoeForConditionalGeneration``), and
  :func:`qwen3_vl_prompt` for ``generate`` inputs with images or videos.
* :func:`build_qwen3_omni_thinker`: ``Qwen3OmniMoeThinkerForConditionalGeneration`` (zoo vision and
  audio towers plus an MoE text decoder), and :func:`qwen3_omni_prompt`.
* :func:`build_wan_pipeline`: ``diffusers`` ``WanPipeline`` (a zoo Wan transformer, a UMT5 text
  encoder, the Wan VAE, a flow-matching scheduler and a word-level tokenizer built in code).

No tokenizer or weights can be downloaded: token ids are laid out in code the way the processors
lay them out (``<vision_start> <image_pad> x n <vision_end>``), and weights use the zoo's seeded init.

Example::

    model = build_qwen3_vl("tiny", torch.float32)
    tokens = model.generate(**qwen3_vl_prompt(model, images=[(64, 96)]), max_new_tokens=4, do_sample=False)
"""

from __future__ import annotations

from typing import Any

import torch

from amxopt import models
from amxopt.models.build import construct_class

# Special token ids of the tiny vocabularies (the released ones are 151k+, far past a tiny vocab).
_VOCAB = 512
_IMAGE, _VIDEO, _AUDIO, _VISION_START, _VISION_END, _AUDIO_START, _AUDIO_END = range(_VOCAB - 7, _VOCAB)
_VISION_IDS = dict(
    image_token_id=_IMAGE, video_token_id=_VIDEO, vision_start_token_id=_VISION_START, vision_end_token_id=_VISION_END
)
_PROMPT = (11, 12, 13)  # "describe this" stand-in text tokens around the media

# Text decoders: "tiny" for tests; "small" is a 4-layer decoder at the released 2B width, so a demo
# answers about an image without spending minutes in the 28-layer language model.
_TEXT = {
    "tiny": dict(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, mrope_section=[4, 4, 4]),
    "small": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=4, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, mrope_section=[24, 20, 20]),
}  # fmt: skip
_VISION = {"tiny": "tiny-qwen3-vl-vision", "small": "qwen3-vl-2b-vision"}
# The MoE decoders (Qwen3-Omni's thinker, Qwen3-VL-MoE): 4 experts, 2 per token, in every layer.
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, decoder_sparse_step=1)


def _text_config(size: str) -> dict[str, Any]:
    t = dict(_TEXT[size])
    section = t.pop("mrope_section")
    rope = {"rope_type": "default", "rope_theta": 5000000.0, "mrope_section": section, "mrope_interleaved": True}
    return dict(t, vocab_size=_VOCAB, rope_parameters=rope, max_position_embeddings=32768, tie_word_embeddings=True)


def _init(model: torch.nn.Module, dtype: torch.dtype | None, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    models._reinit(model)
    return (model if dtype is None else model.to(dtype)).eval()


def _built(cls: type, config: Any, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A transformers model as ``from_pretrained(dtype=dtype)`` makes it (rotary and position tables
    stay fp32; ``.to(dtype)`` would cast them), with the zoo's seeded weights."""
    torch.manual_seed(seed)
    model = construct_class(cls, "transformers", config, dtype)
    models._reinit(model)
    return model.eval()


def build_qwen3_vl(
    size: str = "tiny", dtype: torch.dtype = torch.float32, seed: int = 0, moe: bool = False
) -> torch.nn.Module:
    """``Qwen3VLForConditionalGeneration``: the ``tiny`` or ``small`` (real 2B vision tower) variant;
    with ``moe``, ``Qwen3VLMoeForConditionalGeneration`` (the class of Qwen3-VL-30B-A3B and
    235B-A22B, whose tower is the same architecture) with a 4-expert decoder."""
    import transformers

    vision = models.ZOO[_VISION[size]].config()
    text = _text_config(size)
    if moe:
        text.update(_MOE)
    vision.out_hidden_size = text["hidden_size"]
    prefix = "Qwen3VLMoe" if moe else "Qwen3VL"
    config = getattr(transformers, f"{prefix}Config")(
        vision_config=vision.to_dict(), text_config=text, tie_word_embeddings=True, **_VISION_IDS
    )
    model = _built(getattr(transformers, f"{prefix}ForConditionalGeneration"), config, dtype, seed)
    model.model.visual.zoo_name = _VISION[size]
    return model


def _media(
    visual: torch.nn.Module, images: list, videos: list, dtype: torch.dtype, seed: int
) -> dict[str, torch.Tensor]:
    vision, out = visual.config, {}
    if images:
        pics = [models.synthetic_image(h, w, seed + i) for i, (h, w) in enumerate(images)]
        px = models.image_inputs(visual, pics, dtype)  # (a tiny tower's minimum: one merged patch)
        out.update(pixel_values=px["hidden_states"], image_grid_thw=px["grid_thw"])
    if videos:
        # (frames, height, width) in patches; pixel patches drawn directly (no video processor offline).
        # Qwen3VLVideoProcessor pads a clip's frames up to a multiple of the temporal patch size.
        if any(t < 1 for t, _, _ in videos):
            raise ValueError(f"amxopt.pipelines: a video needs at least one frame, got videos={videos}")
        grid = torch.tensor([[-(-t // vision.temporal_patch_size), h, w] for t, h, w in videos])
        dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        gen = torch.Generator().manual_seed(seed)
        out.update(
            pixel_values_videos=torch.randn(int(grid.prod(-1).sum()), dim, generator=gen).to(dtype),
            video_grid_thw=grid,
        )
    return out


def _ids(spans: list[list[int]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([[1, *_PROMPT[:1]] + [t for span in spans for t in span] + list(_PROMPT[1:])])
    # What the processors return beside the ids for M-RoPE: 1 on image tokens, 2 on video tokens.
    types = (ids == _IMAGE).long() + 2 * (ids == _VIDEO).long()
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": types}


def qwen3_vl_prompt(
    model: torch.nn.Module, images: list | None = None, videos: list | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``generate`` kwargs: one prompt with ``images`` (``(height, width)`` in pixels) and ``videos``
    (``(frames, height, width)`` in patches; frames padded to a multiple of the temporal patch size,
    as the video processor pads them)."""
    vision = model.config.vision_config
    dtype = model.model.visual.dtype
    media = _media(model.model.visual, images or [], videos or [], dtype, seed)
    merge = vision.spatial_merge_size**2
    spans = [
        [_VISION_START] + [_IMAGE] * (int(thw.prod()) // merge) + [_VISION_END]
        for thw in media.get("image_grid_thw", [])
    ]
    # Qwen3VLProcessor writes each temporal patch of a video as its own span after a timestamp.
    for t, h, w in media.get("video_grid_thw", torch.empty(0, 3)).tolist():
        spans += [[_PROMPT[0], _VISION_START] + [_VIDEO] * (h * w // merge) + [_VISION_END] for _ in range(t)]
    return {**_ids(spans), **media}


def build_qwen3_omni_thinker(dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """Tiny ``Qwen3OmniMoeThinkerForConditionalGeneration``: zoo vision and audio towers, MoE decoder."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeThinkerConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        Qwen3OmniMoeThinkerForConditionalGeneration,
    )

    text = _text_config("tiny")
    text.update(_MOE)
    vision = models.ZOO["tiny-qwen3-omni-vision"].config()
    vision.out_hidden_size = text["hidden_size"]
    audio = models.ZOO["tiny-qwen3-omni-audio"].config()
    audio.output_dim = text["hidden_size"]
    config = Qwen3OmniMoeThinkerConfig(
        vision_config=vision.to_dict(),
        audio_config=audio.to_dict(),
        text_config=text,
        audio_token_id=_AUDIO,
        audio_start_token_id=_AUDIO_START,
        audio_end_token_id=_AUDIO_END,
        **_VISION_IDS,
    )
    model = _built(Qwen3OmniMoeThinkerForConditionalGeneration, config, dtype, seed)
    model.model.visual.zoo_name, model.model.audio_tower.zoo_name = "tiny-qwen3-omni-vision", "tiny-qwen3-omni-audio"
    return model


def qwen3_omni_prompt(
    model: torch.nn.Module, images: list | None = None, audio_seconds: list | None = None, seed: int = 0
) -> dict[str, torch.Tensor]:
    """``generate`` kwargs for the thinker: ``images`` as for :func:`qwen3_vl_prompt`, audio clips of
    ``audio_seconds`` through the real Whisper feature extractor."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    vision = model.config.vision_config
    media = _media(model.model.visual, images or [], [], model.model.visual.dtype, seed)
    spans = []
    for thw in media.get("image_grid_thw", []):
        spans.append([_VISION_START] + [_IMAGE] * (int(thw.prod()) // vision.spatial_merge_size**2) + [_VISION_END])
    if audio_seconds:
        waves = [models.synthetic_waveform(s, seed=seed + i) for i, s in enumerate(audio_seconds)]
        feats = models.audio_inputs(model.config.audio_config, waves, model.model.audio_tower.dtype)
        lens = feats["feature_lens"]
        # The thinker takes padded [batch, mel, frames] features with a frame mask.
        padded = torch.zeros(
            len(waves), feats["input_features"].shape[0], int(lens.max()), dtype=model.model.audio_tower.dtype
        )
        mask = torch.zeros(len(waves), int(lens.max()), dtype=torch.long)
        for i, chunk in enumerate(feats["input_features"].split(lens.tolist(), dim=1)):
            padded[i, :, : chunk.shape[1]] = chunk
            mask[i, : chunk.shape[1]] = 1
        media.update(input_features=padded, feature_attention_mask=mask)
        for n in _get_feat_extract_output_lengths(lens).tolist():
            spans.append([_AUDIO_START] + [_AUDIO] * int(n) + [_AUDIO_END])
    ids = _ids(spans)
    del ids["mm_token_type_ids"]  # the thinker finds its media spans from the token ids
    return {**ids, **media}


# UMT5 text encoders: "tiny" for tests and demos (the released UMT5-XXL is 5.7B parameters).
# "xxl-2" has UMT5-XXL's width (the real Wan transformers' text_dim 4096) with 2 of its 24 layers.
_UMT5 = {
    "tiny": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=32),
    "xxl-2": dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=2, num_heads=64, relative_attention_num_buckets=32),
}
_WORDS = ("a cat walks on the grass in the sun slowly bright colorful blurry low quality static").split()


def _word_tokenizer() -> Any:
    """A word-level fast tokenizer over a small vocabulary, built in code (no download)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tok_models
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "</s>", "<unk>", *_WORDS])}
    tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_wan_pipeline(
    transformer: str = "tiny-wan",
    dtype: torch.dtype = torch.float32,
    *,
    text_encoder: str = "tiny",
    two_experts: bool = False,
    expand_timesteps: bool = False,
    seed: int = 0,
) -> Any:
    """``WanPipeline`` around the zoo transformer ``transformer``, a UMT5 encoder and a small Wan VAE.

    Args:
        transformer: zoo name of the Wan transformer (built as :func:`amxopt.models.build_model`
            builds it: keep-in-fp32 modules stay fp32); its ``text_dim`` must be the encoder's width.
        dtype: dtype of the transformer(s) and text encoder; the VAE stays fp32, as Wan runs it.
        text_encoder: UMT5 size: ``"tiny"``, or ``"xxl-2"`` for the real transformers (text_dim 4096).
        two_experts: Wan2.2 A14B style: a second transformer (``transformer_2``, another seed)
            denoises the low-noise steps, switching at ``boundary_ratio`` 0.875.
        expand_timesteps: Wan2.2 TI2V style: the transformer gets one timestep per latent token.
        seed: seed of every weight.

    The scheduler is Wan2.1's: UniPC with flow sigmas, shift 3.
    """
    from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    dit = models.build_model(transformer, dtype, seed=seed)
    cfg = dict(
        _UMT5[text_encoder], feed_forward_proj="gated-gelu", vocab_size=len(_WORDS) + 3, pad_token_id=0, eos_token_id=1
    )
    if dit.config.text_dim != cfg["d_model"]:  # (before the encoder is built: xxl-2 is 1.5 GB in fp32)
        raise ValueError(
            f"amxopt.pipelines: {transformer} reads text_dim {dit.config.text_dim} but the {text_encoder} UMT5 "
            f"encoder writes {cfg['d_model']}"
        )
    encoder = _init(UMT5EncoderModel(UMT5Config(**cfg)), dtype, seed + 1)
    z = dit.config.in_channels
    # The default latent statistics are Wan2.1's 16 channels; the pipeline views them as z_dim.
    stats = {} if z == 16 else {"latents_mean": [0.0] * z, "latents_std": [1.0] * z}
    vae = _init(AutoencoderKLWan(base_dim=16, z_dim=z, dim_mult=[1, 2, 2, 2], **stats), None, seed + 2)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return WanPipeline(
        tokenizer=_word_tokenizer(),
        text_encoder=encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=dit,
        transformer_2=models.build_model(transformer, dtype, seed=seed + 3) if two_experts else None,
        boundary_ratio=0.875 if two_experts else None,
        expand_timesteps=expand_timesteps,
    )


def wan_call(
    height: int = 64, width: int = 64, num_frames: int = 5, steps: int = 2, output_type: str = "pt", **extra: Any
) -> dict[str, Any]:
    """``WanPipeline`` call kwargs: a prompt and a negative prompt from the built-in vocabulary,
    guidance 5.0 (so every step runs the transformer on the cond and the uncond prompt); ``extra``
    adds or replaces any (``guidance_scale=1.0``: no uncond pass)."""
    call = dict(
        prompt="a cat walks on the grass",
        negative_prompt="blurry low quality",
        height=height,
        width=width,
        num_frames=num_frames,
        num_inference_steps=steps,
        guidance_scale=5.0,
        output_type=output_type,
    )
    return {**call, **extra}
