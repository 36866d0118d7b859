"""Wan (``diffusers`` ``WanTransformer3DModel``): Wan2.1 T2V 1.3B / 14B and Wan2.2 TI2V 5B.

One table: the released configs, spelled out, and a test-sized variant. Inputs are seeded latents
and text embeddings for one denoising step.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from amxopt.models.spec import Entry, Family, ModelSpec, config_of, get

_WAN_TIMESTEP = 500.0


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


def _wan_class() -> type[torch.nn.Module]:
    from diffusers import WanTransformer3DModel

    return WanTransformer3DModel


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
    config = config_of(model)
    patch = tuple(get(config, "patch_size"))
    if frames % patch[0] or height % patch[1] or width % patch[2]:
        raise ValueError(f"latent size {(frames, height, width)} is not a multiple of {patch}")
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn((1, int(get(config, "in_channels")), frames, height, width), generator=generator)
    text = torch.randn((1, text_tokens, int(get(config, "text_dim"))), generator=generator)
    return {
        "hidden_states": latents.to(dtype),
        "timestep": torch.tensor([_WAN_TIMESTEP], dtype=torch.float32),
        "encoder_hidden_states": text.to(dtype),
    }


def _wan_examples(spec: ModelSpec, config: Any, size: Any, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    dims = tuple(size) if isinstance(size, (tuple, list)) else ()
    if not all(isinstance(v, numbers.Integral) or (isinstance(v, float) and v.is_integer()) for v in dims):
        raise ValueError(f"Wan size must be whole numbers (F, H, W) or (F, H, W, text_tokens), got {size!r}")
    dims = tuple(int(v) for v in dims)
    if len(dims) == 3:
        dims = dims + (int(spec.default_size[3]),)
    if len(dims) != 4:
        raise ValueError(f"Wan size must be (F, H, W) or (F, H, W, text_tokens), got {size!r}")
    return wan_inputs(config, *dims, dtype=dtype, seed=seed)


WAN = Family(
    name="wan",
    library="diffusers",
    model_class=_wan_class,
    sizes=((5, 32, 32, 512), (2, 8, 8, 16)),
    examples=_wan_examples,
    entries={
        "wan2.1-t2v-1.3b": Entry(
            "Wan2.1 T2V 1.3B DiT (30 blocks, 12x128 heads, ffn 8960)",
            lambda: _wan_config(num_attention_heads=12, ffn_dim=8960, num_layers=30),
        ),
        "wan2.1-t2v-14b": Entry(
            "Wan2.1 T2V 14B DiT (40 blocks, 40x128 heads, ffn 13824)",
            lambda: _wan_config(num_attention_heads=40, ffn_dim=13824, num_layers=40),
        ),
        "wan2.2-ti2v-5b": Entry(
            "Wan2.2 TI2V 5B DiT (30 blocks, 24x128 heads, ffn 14336, 48 latent channels)",
            lambda: _wan_config(num_attention_heads=24, ffn_dim=14336, num_layers=30, in_channels=48, out_channels=48),
        ),
        "tiny-wan": Entry(
            "test-sized WanTransformer3DModel (2 blocks, 2x32 heads)",
            lambda: _wan_config(
                num_attention_heads=2,
                attention_head_dim=32,
                ffn_dim=128,
                num_layers=2,
                text_dim=64,
                freq_dim=32,
            ),
        ),
    },
)
