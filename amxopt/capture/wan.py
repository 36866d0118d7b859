"""Adapter for diffusers' WanTransformer3DModel.

Stock Wan exports as one graph (dense SDPA attention, no data-dependent Python), so this adapter
only checks the call against the model's config, so that a wrong latent shape fails with a clear
message instead of deep inside export. The batch dim is dynamic from 2 up (export fixes a batch-1
example's: the next call of a larger batch is captured again, and that graph takes every batch of 2
or more: a guidance batch, several videos per prompt).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amxopt.capture.base import Adapter


class WanAdapter(Adapter):
    """``(hidden_states [B, C, F, H, W], timestep [B] or one per latent token [B, T], encoder_hidden_states
    [B, L, text_dim])``."""

    name = "wan"

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        self.in_channels = cfg.in_channels
        self.patch = tuple(cfg.patch_size)
        self.text_dim = cfg.text_dim
        # The rotary table covers this many positions per axis (in patches).
        self.rope_len = cfg.rope_max_seq_len

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return type(model).__name__ == "WanTransformer3DModel"

    def graph_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        who = f"amxopt: {self.model_name}"
        x, text = call.get("hidden_states"), call.get("encoder_hidden_states")
        if not isinstance(x, torch.Tensor) or x.dim() != 5 or x.shape[1] != self.in_channels:
            raise ValueError(
                f"{who}: hidden_states must be latents [B, {self.in_channels}, F, H, W], "
                f"got {getattr(x, 'shape', type(x).__name__)}"
            )
        if any(d % p for d, p in zip(x.shape[2:], self.patch)):
            raise ValueError(
                f"{who}: latent {tuple(x.shape[2:])} is not divisible by the patch size {self.patch} (eager "
                "drops the remainder and returns a smaller latent than it was given, which a denoising loop cannot "
                "step; WanPipeline's height and width are multiples of 16)"
            )
        if not isinstance(text, torch.Tensor) or text.dim() != 3 or text.shape[2] != self.text_dim:
            raise ValueError(
                f"{who}: encoder_hidden_states must be [B, L, {self.text_dim}], "
                f"got {getattr(text, 'shape', type(text).__name__)}"
            )
        if text.shape[0] == 1 < x.shape[0]:  # one prompt for every latent: eager broadcasts it
            call = {**call, "encoder_hidden_states": text.expand(x.shape[0], -1, -1)}
        elif text.shape[0] != x.shape[0]:
            raise ValueError(
                f"{who}: encoder_hidden_states {tuple(text.shape)} is for a batch of {text.shape[0]}, hidden_states "
                f"{tuple(x.shape)} for {x.shape[0]}: give each latent its own text embeddings, or one for all"
            )
        if call.get("attention_kwargs") and call["attention_kwargs"] != {"scale": 1.0}:  # (1.0: LoRA as set)
            raise ValueError(
                f"{who}: attention_kwargs are not supported, got {call['attention_kwargs']} (for a LoRA scale, "
                "set it with set_adapters(names, weights) on the model or pipeline: the next call captures it)"
            )
        if "attention_kwargs" in call:  # empty: the call without it, whose graph serves (as for None)
            call = {k: v for k, v in call.items() if k != "attention_kwargs"}
        return call

    def dynamic_shapes(self, graph_inputs: dict[str, Any]) -> dict[str, Any]:
        # Frames, height and width vary as multiples of the patch (so the patchify stays exact and
        # replace_patch_embed can prove it); text length varies freely; the batch from 2 up (one dim
        # for every input that has it); everything else is static.
        shapes: dict[str, Any] = {k: ({} if isinstance(v, torch.Tensor) else None) for k, v in graph_inputs.items()}
        if graph_inputs["hidden_states"].shape[0] > 1:
            batch = torch.export.Dim("batch", min=2)
            for name in ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"):
                value = graph_inputs.get(name)
                if (
                    isinstance(value, torch.Tensor)
                    and value.dim()
                    and value.shape[0] == graph_inputs["hidden_states"].shape[0]
                ):
                    shapes[name] = {0: batch}
        latent = {}
        example = graph_inputs["hidden_states"].shape
        for axis, (name, p) in enumerate(zip(("frames", "height", "width"), self.patch), start=2):
            if example[axis] // p == 1:  # export fixes a size-1 example (one latent frame: an image): static
                continue
            dim = torch.export.Dim(f"latent_{name}_patches", min=1, max=self.rope_len)
            latent[axis] = dim * p if p > 1 else dim
        shapes["hidden_states"] = {**shapes["hidden_states"], **latent}
        shapes["encoder_hidden_states"] = {**shapes["encoder_hidden_states"], 1: torch.export.Dim.AUTO}
        timestep = graph_inputs.get("timestep")
        if isinstance(timestep, torch.Tensor) and timestep.dim() == 2:  # one per latent token (Wan2.2 TI2V)
            shapes["timestep"] = {**shapes["timestep"], 1: torch.export.Dim.AUTO}  # export ties it to the latent
        return shapes
