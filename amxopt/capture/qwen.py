"""Adapters for the Qwen3-VL / Qwen3-Omni vision encoders and the Qwen3-Omni audio encoder.

Their stock forward loops over segments in Python (``torch.split(lengths.tolist())``) and derives
rotary/position indices from ``grid_thw`` with ``.tolist()``, which torch.export cannot capture.
transformers lets callers pass all of that precomputed as kwargs; these adapters compute it
eagerly with transformers' own helpers, validate the call, and route attention to
``amxopt.varlen_attention`` so each layer's attention is one graph node.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from amxopt.capture.attention import routed_attention
from amxopt.capture.base import Adapter
from amxopt.ops import DTYPES

logger = logging.getLogger(__name__)
_LAYER_OUTPUTS = ("output_hidden_states", "output_attentions")
_VISION_PRECOMPUTED = ("cu_seqlens", "max_seqlen", "position_ids", "interp_indices", "interp_weights")


class _QwenAdapter(Adapter):
    classes: tuple[str, ...] = ()
    dynamic_dims: dict[str, tuple[int, ...]] = {}

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return type(model).__name__ in cls.classes

    @classmethod
    def refusal(cls, model: nn.Module, dtype: torch.dtype | None = None) -> str | None:
        # Its attention is captured as amxopt's op, which takes no other dtype.
        if dtype is None:
            dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        if dtype in DTYPES:  # the ops' dtypes
            return None
        return f"{type(model).__name__} is in {dtype}, and amxopt's attention takes float32 or bfloat16"

    def tracing(self, model: nn.Module):
        # optimize() refused such a tower; one cast since (a kept source) is a capture error.
        refusal = self.refusal(model)
        if refusal is not None:
            raise ValueError(f"{refusal}: cast the model (model.to(torch.bfloat16)) before optimizing it")
        return routed_attention(model)

    def dynamic_shapes(self, graph_inputs: dict[str, Any]) -> dict[str, Any]:
        # Token/segment counts vary per call; feature widths are fixed by the weights.
        auto = torch.export.Dim.AUTO
        return {k: {d: auto for d in self.dynamic_dims.get(k, ())} for k in graph_inputs}

    def _reject_extras(self, call: dict[str, Any], allowed: set[str]) -> None:
        # A whole model's call passes its own output_hidden_states / output_attentions on to the tower
        # (transformers' get_image_features), whose output it does not return: the graph computes
        # the tower's outputs, without its per-layer states (they stay None), and says so once.
        asked = [k for k in _LAYER_OUTPUTS if call.pop(k, None)]
        if asked and not getattr(self, "_told_layer_outputs", False):
            self._told_layer_outputs = True
            logger.warning(
                "amxopt: %s computes its outputs without per-layer states: %s ignored (their fields are None)",
                self.model_name,
                " and ".join(asked),
            )
        # Qwen3-VL-MoE's whole model passes its language model's router flag on to the tower, which
        # has no router: its output gains only an empty router_logits entry, which the model drops.
        call.pop("output_router_logits", None)
        extra = {k for k, v in call.items() if v is not None and k not in allowed}
        if extra:
            raise ValueError(f"amxopt: {self.model_name} is optimized without these arguments: {sorted(extra)}")


class QwenVisionAdapter(_QwenAdapter):
    """Qwen3-VL (dense and MoE: the same tower) / Qwen3-Omni vision encoder:
    ``(hidden_states [T, C*t*p*p], grid_thw [N, 3])``."""

    name = "qwen3_vision"
    classes = ("Qwen3VLVisionModel", "Qwen3VLMoeVisionModel", "Qwen3OmniMoeVisionEncoder")
    dynamic_dims = {
        "hidden_states": (0,),
        "cu_seqlens": (0,),
        "position_ids": (0,),
        "interp_indices": (0,),
        "interp_weights": (0,),
    }

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        self.merge = cfg.spatial_merge_size
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
        self.grid_side = model.num_grid_per_side
        self.interp_mode = model.interpolation_mode
        self.align_corners = model.interpolation_align_corners

    def graph_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        from transformers.vision_utils import (
            get_vision_cu_seqlens,
            get_vision_interpolation_indices_and_weights,
            get_vision_position_ids,
        )

        # The metadata the forward computes from grid_thw may come precomputed (transformers'
        # vision_utils: the tower's own keywords, or image_cu_seqlens etc. through the whole model):
        # the helpers then return the caller's tensors, as in eager. max_seqlen is flash
        # attention's hint, which amxopt's kernels do not need (they read cu_seqlens).
        given = {k: call.pop(k) for k in _VISION_PRECOMPUTED if call.get(k) is not None}
        given.pop("max_seqlen", None)
        self._reject_extras(call, {"hidden_states", "grid_thw"})
        x, grid = call.get("hidden_states"), call.get("grid_thw")
        self._validate(x, grid)
        self._validate_given(given, x.shape[0])
        indices, weights = get_vision_interpolation_indices_and_weights(
            grid,
            num_grid_per_side=self.grid_side,
            mode=self.interp_mode,
            align_corners=self.align_corners,
            spatial_merge_size=self.merge,
            kwargs=given,
        )

        # Per-patch rows go in grouped by merge window, [T / merge**2, merge**2, ...], and the graph
        # flattens them back: the patch count is then merge**2 * k by construction. With a bare T,
        # the mergers' view(-1, hidden * merge**2) leaves export to prove T divisible, and the
        # FloorDiv expressions it carries from there cost ~0.4 s of sympy in a cold capture.
        def windows(t: torch.Tensor) -> torch.Tensor:
            return t.reshape(-1, self.merge**2, *t.shape[1:])

        return {
            "hidden_states": windows(x),
            "cu_seqlens": get_vision_cu_seqlens(grid, kwargs=given),
            "position_ids": windows(get_vision_position_ids(grid, self.merge, kwargs=given)),
            "interp_indices": windows(indices),
            "interp_weights": windows(weights),
        }

    def _validate(self, x, grid) -> None:
        who = f"amxopt: {self.model_name}"
        if not isinstance(x, torch.Tensor) or not isinstance(grid, torch.Tensor):
            raise TypeError(f"{who} needs tensors hidden_states and grid_thw")
        # (any real dtype: the patch embedding casts it to the weights', as in eager)
        if x.dim() != 2 or x.shape[1] != self.patch_dim or x.is_complex():
            raise ValueError(
                f"{who}: hidden_states must be real [num_patches, {self.patch_dim}], got {x.dtype} {tuple(x.shape)}"
            )
        if grid.dim() != 2 or grid.shape[1] != 3 or grid.is_floating_point():
            raise ValueError(
                f"{who}: grid_thw must be an integer [num_images, 3], got {grid.dtype} {tuple(grid.shape)}"
            )
        if bool((grid <= 0).any()) or bool((grid[:, 1:] % self.merge != 0).any()):
            raise ValueError(
                f"{who}: every grid_thw entry must be positive with h and w divisible by the spatial "
                f"merge size {self.merge}, got {grid.tolist()}"
            )
        patches = int(grid.prod(-1).sum())
        if patches != x.shape[0]:
            raise ValueError(
                f"{who}: grid_thw {grid.tolist()} describes {patches} patches but hidden_states has {x.shape[0]} rows"
            )

    def _validate_given(self, given: dict[str, torch.Tensor], patches: int) -> None:
        for name, t in given.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"amxopt: {self.model_name}: a precomputed {name} must be a tensor, got {type(t)}")
            if name == "cu_seqlens":
                if t.dim() != 1 or t.is_floating_point() or len(t) < 2 or t[0] != 0 or t[-1] != patches:
                    raise ValueError(
                        f"amxopt: {self.model_name}: a precomputed cu_seqlens must be integer offsets from 0 to "
                        f"the {patches} patches, got {t.dtype} {t.tolist()}"
                    )
            elif t.dim() != 2 or t.shape[0] != patches:
                raise ValueError(
                    f"amxopt: {self.model_name}: a precomputed {name} must have one row per patch "
                    f"({patches}), got shape {tuple(t.shape)}"
                )

    def export_module(self, model: nn.Module) -> nn.Module:
        return _VisionGraph(model)


class _VisionGraph(nn.Module):
    """The part of the vision encoder that is captured: everything after the eager metadata."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, hidden_states, cu_seqlens, position_ids, interp_indices, interp_weights):
        # grid_thw is only read by the metadata helpers, all of which get their result precomputed;
        # max_seqlen=0 means "unknown" to amxopt.varlen_attention (kernels read cu_seqlens).
        # The per-patch inputs come grouped by merge window (QwenVisionAdapter.graph_inputs).
        return self.model(
            hidden_states.flatten(0, 1),
            grid_thw=None,
            cu_seqlens=cu_seqlens,
            position_ids=position_ids.flatten(0, 1),
            interp_indices=interp_indices.flatten(0, 1),
            interp_weights=interp_weights.flatten(0, 1),
            max_seqlen=0,
        )


# A part of a call QwenAudioAdapter.split cut: the whole call's chunk width (graph_inputs pads to it).
_WIDTH = "_amxopt_chunk_width"


class QwenAudioAdapter(_QwenAdapter):
    """Qwen3-Omni audio encoder: ``(input_features [mel, frames], feature_lens [batch])``."""

    name = "qwen3_omni_audio"
    classes = ("Qwen3OmniMoeAudioEncoder",)
    dynamic_dims = {"padded_feature": (0, 2), "chunk_lengths": (0,), "valid_indices": (0,), "cu_seqlens": (0,)}
    arguments = {"padded_feature": "input_features"}

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        cfg = model.config
        self.n_mels = cfg.num_mel_bins
        self.n_window = cfg.n_window
        self.n_window_infer = cfg.n_window_infer
        self.conv_chunksize = model.conv_chunksize

    def split(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """Calls of at most ``conv_chunksize`` chunks each. The forward runs its convolutions over
        the chunks in a Python loop of ``conv_chunksize`` at a time, which export unrolls: a graph
        of one round takes no call of more chunks, and past 500 s of audio (one clip or a batch)
        every 500 s cost one or two more graphs until ``max_recaptures`` refused the call. Every chunk's
        convolutions and every attention window are independent, so clips are grouped, and a clip
        longer than a call is cut at attention-window boundaries: the parts' tokens, in order, are
        the call's."""
        feats, lens = call.get("input_features"), call.get("feature_lens")
        self._validate(feats, lens)  # (the caller's whole input, before it is cut)
        chunk = 2 * self.n_window
        window = self.n_window_infer // chunk  # chunks of one attention window (as eager rounds it down)
        if window == 0 or self.conv_chunksize < window:
            return [call]  # (no cut that keeps the windows: not a released config)
        most = self.conv_chunksize // window * window  # chunks of a cut clip's part
        parts: list[list[int]] = [[]]
        used = 0  # chunks in parts[-1]
        for n in lens.tolist():
            while -(-n // chunk) > self.conv_chunksize:
                parts.append([most * chunk])
                used, n = most, n - most * chunk
            if used + -(-n // chunk) > self.conv_chunksize:
                parts.append([])
                used = 0
            parts[-1].append(n)
            used += -(-n // chunk)
        parts = [p for p in parts if p]
        if len(parts) == 1:
            return [call]
        frames = feats.split([sum(p) for p in parts], dim=1)
        width = min(chunk, int(lens.max()))  # the call's longest chunk, which eager pads every chunk to
        return [
            {**call, "input_features": f, "feature_lens": torch.tensor(p, dtype=lens.dtype), _WIDTH: width}
            for f, p in zip(frames, parts)
        ]

    def join(self, outputs: list[Any]) -> Any:
        if len(outputs) == 1:
            return outputs[0]
        # Every field is per token (pooler_output is last_hidden_state itself): concatenated, one
        # tensor where the parts' fields were one.
        leaves, spec = pytree.tree_flatten(outputs[0])
        rest = [pytree.tree_leaves(o) for o in outputs[1:]]
        joined: dict[int, torch.Tensor] = {}
        out = []
        for i, leaf in enumerate(leaves):
            if id(leaf) not in joined:
                joined[id(leaf)] = torch.cat([leaf, *(r[i] for r in rest)])
            out.append(joined[id(leaf)])
        return pytree.tree_unflatten(out, spec)

    def graph_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        from transformers.models.qwen3_omni_moe import modeling_qwen3_omni_moe as qo

        width = call.pop(_WIDTH, None)
        self._reject_extras(call, {"input_features", "feature_lens"})
        feats, lens = call.get("input_features"), call.get("feature_lens")
        self._validate(feats, lens)
        padded, chunk_lengths = qo.chunk_and_pad_features(feats, lens, self.n_window)
        if width is not None and width > padded.shape[-1]:
            # A part of a cut call whose chunks are all shorter than the call's longest: eager pads
            # every chunk to that one, and the convolutions' biases make the padding nonzero, which
            # the stride-2 convolutions carry into each clip's last token. So the part is padded so
            # too, and its valid tokens are indexed in the wider grid.
            padded = torch.nn.functional.pad(padded, (0, width - padded.shape[-1]))
            tokens = qo._get_feat_extract_output_lengths(chunk_lengths, self.n_window)
            grid = int(qo._get_feat_extract_output_lengths(torch.tensor(width), self.n_window))
            valid_indices = (torch.arange(grid) < tokens[:, None]).flatten().nonzero().squeeze(-1)
        else:
            valid_indices = qo.get_valid_indices(chunk_lengths, self.n_window)
        return {
            "padded_feature": padded,
            "chunk_lengths": chunk_lengths,
            "valid_indices": valid_indices,
            "cu_seqlens": qo.get_audio_cu_seqlens(chunk_lengths, lens, self.n_window_infer, self.n_window),
        }

    def _validate(self, feats, lens) -> None:
        who = f"amxopt: {self.model_name}"
        if not isinstance(feats, torch.Tensor) or not isinstance(lens, torch.Tensor):
            raise TypeError(f"{who} needs tensors input_features and feature_lens")
        if feats.dim() != 2 or feats.shape[0] != self.n_mels or not feats.is_floating_point():
            raise ValueError(
                f"{who}: input_features must be float [{self.n_mels}, frames], got {feats.dtype} {tuple(feats.shape)}"
            )
        if lens.dim() != 1 or lens.is_floating_point() or bool((lens <= 0).any()):
            raise ValueError(f"{who}: feature_lens must be positive integers [batch], got {lens}")
        if int(lens.sum()) != feats.shape[1]:
            raise ValueError(
                f"{who}: feature_lens {lens.tolist()} sum to {int(lens.sum())} frames but input_features has "
                f"{feats.shape[1]}"
            )

    def export_module(self, model: nn.Module) -> nn.Module:
        return _AudioGraph(model)


class _AudioGraph(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, padded_feature, chunk_lengths, valid_indices, cu_seqlens):
        return self.model(
            input_features=None,
            feature_lens=None,
            padded_feature=padded_feature,
            chunk_lengths=chunk_lengths,
            valid_indices=valid_indices,
            cu_seqlens=cu_seqlens,
            max_seqlen=0,
        )
