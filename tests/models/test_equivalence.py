"""End to end: every tiny zoo model optimized, nothing of a replaceable kind left, outputs equal.

fp32: the optimized model matches the original within torch.testing.assert_close defaults.
bf16: its max abs error against the fp32 original is at most 1.5x that of the original bf16 model.
Each model is checked at two or more input sizes (dynamic shapes or transparent re-capture).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.utils._pytree as pytree

import amxopt
from amxopt import models
from tests.helpers import CONFIG, check_rewrite, max_abs_error, targets

# name -> (expected replaced counts, input sizes: the first is the capture example)
CASES = {
    "tiny-qwen3-vl-vision": (
        # 3 blocks x 4 + merger 2 + 2 deepstack mergers x 2; 3 blocks x 2 LN + 3 merger LNs; q and k
        # rotated in 3 blocks
        dict(linear=18, attention=3, patch_embed=1, layer_norm=9, rms_norm=0, rotary=6),
        [64, (96, 64), [64, 32]],
    ),
    "tiny-qwen3-omni-vision": (dict(attention=3, patch_embed=1, rms_norm=0), [64, (64, 128)]),
    # 3 convs, each with its gelu fused
    "tiny-qwen3-omni-audio": (
        dict(linear=2 * 6 + 3, attention=2, layer_norm=2 * 2 + 1, conv2d=3),
        [2, 3.3, [1.2, 0.4]],
    ),
    "tiny-wan": (
        dict(attention=4, patch_embed=1, rms_norm=8, layer_norm=2, modulate=5, residual=4, rotary=4),
        [None, (2, 6, 10, 20), (3, 8, 8, 7)],
    ),
}


def _outputs_close(actual, expected) -> None:
    assert type(actual) is type(expected)
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("name", list(CASES))
def test_fp32_equivalence(name, provider):
    counts, sizes = CASES[name]
    model = models.build_model(name, torch.float32)
    opt = check_rewrite(model, models.example_inputs(name, size=sizes[0]), counts, provider=provider)
    with torch.no_grad():
        for size in sizes[1:]:
            inputs = models.example_inputs(name, size=size, seed=1)
            _outputs_close(opt(**inputs), model(**inputs))
    assert len(opt.graphs) == 1, f"{name}: dynamic capture did not cover the other sizes ({len(opt.graphs)} graphs)"


@pytest.mark.parametrize("name", list(CASES))
def test_bf16_error_bound(name, provider):
    _, sizes = CASES[name]
    fp32 = models.build_model(name, torch.float32)
    bf16 = models.build_model(name, torch.bfloat16)
    config = amxopt.AmxConfig(
        provider=provider, autotune=False, keep_source=True
    )  # every node replaced, whatever is faster
    opt = amxopt.optimize(bf16, models.example_inputs(name, torch.bfloat16, size=sizes[0]), config)
    assert not opt.report.left, str(opt.report)
    with torch.no_grad():
        for size in sizes[:2]:
            x32 = models.example_inputs(name, torch.float32, size=size, seed=2)
            x16 = models.example_inputs(name, torch.bfloat16, size=size, seed=2)
            ref = fp32(**x32)
            eager_err = max_abs_error(bf16(**x16), ref)
            opt_err = max_abs_error(opt(**x16), ref)
            assert opt_err <= 1.5 * eager_err, f"{name} {size}: optimized {opt_err:.3e} vs eager bf16 {eager_err:.3e}"


def test_omni_audio_fuses_every_gelu():
    """The 3 conv + gelu pairs and the layers' fc1 + gelu each become one op: no gelu is left."""
    name = "tiny-qwen3-omni-audio"
    opt = amxopt.optimize(models.build_model(name), models.example_inputs(name, size=2), CONFIG)
    assert torch.ops.aten.gelu.default not in targets(opt.graph_module)
    fused = [n.args[7] for n in opt.graph_module.graph.nodes if n.target == torch.ops.amxopt.conv2d.default]
    assert fused == ["gelu"] * 3


@pytest.mark.parametrize("lens", [[5], [3, 7]], ids=["one-clip", "two-clips"])
def test_omni_audio_clips_of_at_most_8_frames(lens):
    """Time width 1 after the convs: export leaves out the no-op ``.contiguous()`` before a view,
    which must still apply to the channels-last output of the native conv (it crashed)."""
    name = "tiny-qwen3-omni-audio"
    model = models.build_model(name)
    inputs = {"input_features": torch.randn(128, sum(lens)), "feature_lens": torch.tensor(lens)}
    opt = amxopt.optimize(model, inputs, dataclasses.replace(CONFIG, provider="native"))
    with torch.no_grad():
        _outputs_close(opt(**inputs), model(**inputs))


def test_positional_and_keyword_calls_agree():
    name = "tiny-qwen3-vl-vision"
    model = models.build_model(name)
    inputs = models.example_inputs(name)
    opt = amxopt.optimize(model, (inputs["hidden_states"], inputs["grid_thw"]), CONFIG)
    with torch.no_grad():
        _outputs_close(opt(inputs["hidden_states"], inputs["grid_thw"]), opt(**inputs))


def test_wan_return_dict_false_reuses_the_graph():
    name = "tiny-wan"
    model = models.build_model(name)
    inputs = models.example_inputs(name)
    opt = amxopt.optimize(model, inputs, CONFIG)
    with torch.no_grad():
        out = opt(**inputs, return_dict=False)
        assert isinstance(out, tuple)
        torch.testing.assert_close(out[0], model(**inputs).sample)
        assert type(opt(**inputs, return_dict=True)) is type(model(**inputs))
    assert len(opt.graphs) == 1  # return_dict only shapes the output: one graph serves both


class _PlainBlock(torch.nn.Module):
    """A model amxopt has no adapter for: plain export, every matching pass still applies."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(32)
        self.qkv = torch.nn.Linear(32, 96)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 32))
        self.rms = torch.nn.RMSNorm(32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        x = x + torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, 32)
        return self.rms(x + self.mlp(x))


def test_model_without_adapter_gets_every_pass():
    model = _PlainBlock().eval()
    opt = check_rewrite(model, (torch.randn(2, 9, 32),), dict(linear=3, attention=1, layer_norm=1, rms_norm=1))
    assert opt.report.adapter == "plain"
    x = torch.randn(3, 5, 32)
    with torch.no_grad():
        torch.testing.assert_close(opt(x), model(x))


def test_optimize_without_example_inputs_captures_at_first_call():
    name = "tiny-qwen3-vl-vision"
    model = models.build_model(name)
    opt = amxopt.optimize(model, config=CONFIG)
    with pytest.raises(RuntimeError, match="captured at its first call"):
        opt.report
    inputs = models.example_inputs(name, size=64)
    with torch.no_grad():
        _outputs_close(opt(**inputs), model(**inputs))
        other = models.example_inputs(name, size=(96, 64), seed=1)
        _outputs_close(opt(**other), model(**other))
    assert opt.report.counts()["attention"] == 3
    assert len(opt.graphs) == 1  # the first capture is dynamic: the second size ran on it


def test_optimized_module_forwards_what_callers_read():
    # Qwen3-VL's get_image_features reads visual.dtype and visual.spatial_merge_size; pipelines read .config.
    model = models.build_model("tiny-qwen3-vl-vision", torch.bfloat16)
    opt = amxopt.optimize(model, config=CONFIG)
    assert opt.dtype == torch.bfloat16 and opt.spatial_merge_size == model.spatial_merge_size
    assert opt.config is model.config and opt.amx_config.provider == "reference"
    with pytest.raises(AttributeError):
        opt.no_such_attribute


def _vision(cls_name: str, **extra):
    import transformers

    config = getattr(transformers, f"{cls_name}Config")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=16
    )
    for k, v in extra.items():
        setattr(config, k, v)
    torch.manual_seed(0)
    return getattr(transformers, f"{cls_name}Model")._from_config(config, attn_implementation="sdpa").eval()


def test_clip_vision_tower_through_the_generic_passes(provider):
    # No adapter: plain export; the Conv2d patch embedding becomes one GEMM, attention one node per layer.
    model = _vision("CLIPVision")
    counts = dict(linear=12, attention=2, patch_embed=1, layer_norm=6)
    opt = check_rewrite(model, (torch.randn(2, 3, 64, 64),), counts, provider=provider)
    assert opt.report.adapter == "plain"


def test_a_tower_optimized_on_one_image_takes_any_batch_in_two_graphs():
    model = _vision("CLIPVision")
    opt = amxopt.optimize(model, (torch.randn(1, 3, 64, 64),), dataclasses.replace(CONFIG, max_recaptures=3))
    with torch.no_grad():
        for batch in range(1, 11):  # the first graph fixes the batch at 1 (export specializes a size of 1)
            x = torch.randn(batch, 3, 64, 64)
            torch.testing.assert_close(opt(x).last_hidden_state, model(x).last_hidden_state)
    assert len(opt.graphs) == 2


def test_wan_optimized_on_one_latent_frame_takes_other_resolutions_in_its_graph():
    # An image's one latent frame is fixed (export fixes a size-1 example); height and width stay dynamic.
    model = models.build_model("tiny-wan")
    opt = amxopt.optimize(model, models.example_inputs("tiny-wan", size=(1, 8, 8)), CONFIG)
    assert not any("shapes are static" in n for n in opt.report.notes), opt.report.notes
    other = models.example_inputs("tiny-wan", size=(1, 6, 10))
    with torch.no_grad():
        torch.testing.assert_close(opt(**other).sample, model(**other).sample)
    assert len(opt.graphs) == 1


def test_transformers_own_output_hooks_are_not_taken_for_a_users(caplog):
    model, x = _vision("CLIPVision"), torch.randn(2, 3, 64, 64)
    opt = amxopt.optimize(model, (x,), CONFIG)
    with torch.no_grad():
        model(x, output_hidden_states=True)  # transformers installs its output-recording hooks now
        assert any(m._forward_hooks for m in model.modules())
        with caplog.at_level(logging.INFO, logger="amxopt"):
            torch.testing.assert_close(opt(x).last_hidden_state, model(x).last_hidden_state)
    assert "captured anew" not in caplog.text and "forward hooks" not in caplog.text


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_siglip_vision_tower_reports_what_it_leaves(dynamic):
    model = _vision("SiglipVision")
    opt = amxopt.optimize(model, (torch.randn(1, 3, 64, 64),), dataclasses.replace(CONFIG, dynamic=dynamic))
    counts = opt.report.counts()
    assert counts["patch_embed"] == 1 and counts["attention"] == 2 and counts["linear"] == 15
    # The pooling head's nn.MultiheadAttention slices its in-projection weight inside the graph.
    assert {e.detail for e in opt.report.left} == {"weight is computed in the graph, not a constant"}
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        _outputs_close(opt(x), model(x))
