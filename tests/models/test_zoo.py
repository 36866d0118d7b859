"""Fast tests for amxopt.models (tiny zoo entries only; real entries are checked by config)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from amxopt import models, pipelines

TINY = ["tiny-qwen3-vl-vision", "tiny-qwen3-omni-vision", "tiny-qwen3-omni-audio", "tiny-wan"]
DTYPES = [torch.float32, torch.bfloat16]

# Two input sizes per tiny model: the default one and a second, multi-item/odd-shaped one.
SIZES = {
    "tiny-qwen3-vl-vision": [None, [64, (32, 96)]],
    "tiny-qwen3-omni-vision": [None, (96, 64)],
    "tiny-qwen3-omni-audio": [None, [1.0, 2.5]],
    "tiny-wan": [None, (1, 4, 6, 7)],
}


@functools.lru_cache(maxsize=None)
def _model(name: str, dtype: torch.dtype) -> torch.nn.Module:
    return models.build_model(name, dtype)


def _audio_tokens(frames: int, n_window: int = 50) -> int:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths,
    )

    return int(_get_feat_extract_output_lengths(torch.tensor(frames), n_window))


def _check_forward(name: str, model: torch.nn.Module, inputs: dict, dtype: torch.dtype) -> None:
    config = model.config
    with torch.inference_mode():
        out = model(**inputs)
    family = models.ZOO[name].family
    if family in ("qwen3_vl_vision", "qwen3_omni_vision"):
        grid = inputs["grid_thw"]
        patches = int(grid.prod(-1).sum())
        assert inputs["hidden_states"].shape == (patches, 3 * 2 * 16 * 16)
        merged = patches // config.spatial_merge_size**2
        assert out.last_hidden_state.shape == (patches, config.hidden_size)
        assert out.pooler_output.shape == (merged, config.out_hidden_size)
        assert len(out.deepstack_features) == len(config.deepstack_visual_indexes)
        tensors = [out.last_hidden_state, out.pooler_output, *out.deepstack_features]
    elif family == "qwen3_omni_audio":
        lens = inputs["feature_lens"]
        assert lens.dtype == torch.long
        assert inputs["input_features"].shape == (128, int(lens.sum()))
        tokens = sum(_audio_tokens(int(n)) for n in lens)
        assert out.last_hidden_state.shape == (tokens, config.output_dim)
        tensors = [out.last_hidden_state]
    else:
        assert inputs["timestep"].dtype == torch.float32
        assert out.sample.shape == inputs["hidden_states"].shape
        tensors = [out.sample]
    for t in tensors:
        assert t.dtype == dtype
        assert torch.isfinite(t.float()).all()
        assert t.float().std() > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", TINY)
def test_tiny_forward(name: str, dtype: torch.dtype) -> None:
    model = _model(name, dtype)
    assert not model.training
    assert model.zoo_name == name
    for size in SIZES[name]:
        inputs = models.example_inputs(name, dtype, size=size)
        for key, value in inputs.items():
            if value.is_floating_point() and key != "timestep":
                assert value.dtype == dtype, key
        _check_forward(name, model, inputs, dtype)


def test_tiny_vision_default_grid() -> None:
    inputs = models.example_inputs("tiny-qwen3-vl-vision")
    assert inputs["grid_thw"].tolist() == [[1, 4, 4]]
    two = models.example_inputs("tiny-qwen3-vl-vision", size=[64, (32, 96)])
    assert two["grid_thw"].tolist() == [[1, 4, 4], [1, 2, 6]]
    assert two["hidden_states"].shape[0] == 16 + 12


@pytest.mark.parametrize("name", TINY)
def test_bf16_is_rounded_fp32_and_seeded(name: str) -> None:
    fp32 = _model(name, torch.float32)
    bf16 = _model(name, torch.bfloat16)
    fp32_params = dict(fp32.named_parameters())
    for pname, param in bf16.named_parameters():
        ref = fp32_params[pname]
        assert torch.equal(ref.to(param.dtype), param), pname
    again = models.build_model(name, torch.float32, seed=0)
    other = models.build_model(name, torch.float32, seed=1)
    for pname, param in again.named_parameters():
        assert torch.equal(param, fp32_params[pname]), pname
    pname = next(n for n, p in again.named_parameters() if p.dim() >= 2)
    assert not torch.equal(dict(other.named_parameters())[pname], fp32_params[pname])


def test_wan_bf16_keeps_fp32_modules() -> None:
    model = _model("tiny-wan", torch.bfloat16)
    keep = ("time_embedder", "scale_shift_table", "norm1", "norm2", "norm3")
    fp32 = {n for n, p in model.named_parameters() if p.dtype == torch.float32}
    expected = {n for n in dict(model.named_parameters()) if set(n.split(".")) & set(keep)}
    assert fp32 == expected
    assert "scale_shift_table" in fp32
    assert "blocks.0.norm2.weight" in fp32
    assert "condition_embedder.time_embedder.linear_1.weight" in fp32
    assert model.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert model.blocks[0].attn1.norm_q.weight.dtype == torch.bfloat16
    assert model.patch_embedding.weight.dtype == torch.bfloat16


def test_qwen_bf16_is_all_bf16() -> None:
    for name in ("tiny-qwen3-vl-vision", "tiny-qwen3-omni-audio"):
        model = _model(name, torch.bfloat16)
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_real_configs() -> None:
    c = models.ZOO["qwen3-vl-2b-vision"].config()
    assert type(c).__name__ == "Qwen3VLVisionConfig"
    assert (c.depth, c.hidden_size, c.num_heads, c.intermediate_size) == (24, 1024, 16, 4096)
    assert (c.patch_size, c.temporal_patch_size, c.spatial_merge_size) == (16, 2, 2)
    assert (c.out_hidden_size, list(c.deepstack_visual_indexes)) == (2048, [5, 11, 17])
    assert (c.hidden_act, c.in_channels, c.num_position_embeddings) == (
        "gelu_pytorch_tanh",
        3,
        2304,
    )

    c = models.ZOO["qwen3-vl-8b-vision"].config()
    assert (c.depth, c.hidden_size, c.num_heads, c.intermediate_size) == (27, 1152, 16, 4304)
    assert (c.out_hidden_size, list(c.deepstack_visual_indexes)) == (4096, [8, 16, 24])
    assert c.num_position_embeddings == 2304

    c = models.ZOO["qwen3-omni-vision"].config()
    assert type(c).__name__ == "Qwen3OmniMoeVisionEncoderConfig"
    assert (c.depth, c.hidden_size, c.num_heads, c.intermediate_size) == (27, 1152, 16, 4304)
    assert (c.out_hidden_size, list(c.deepstack_visual_indexes)) == (2048, [8, 16, 24])
    assert (c.patch_size, c.temporal_patch_size, c.spatial_merge_size) == (16, 2, 2)

    c = models.ZOO["qwen3-omni-audio"].config()
    assert type(c).__name__ == "Qwen3OmniMoeAudioEncoderConfig"
    assert (c.d_model, c.encoder_layers, c.encoder_attention_heads, c.encoder_ffn_dim) == (
        1280,
        32,
        20,
        5120,
    )
    assert (c.num_mel_bins, c.n_window, c.n_window_infer, c.conv_chunksize) == (128, 50, 800, 500)
    assert (c.downsample_hidden_size, c.output_dim, c.max_source_positions) == (480, 2048, 1500)
    assert (c.activation_function, c.scale_embedding) == ("gelu", False)

    common = dict(
        patch_size=(1, 2, 2),
        attention_head_dim=128,
        text_dim=4096,
        freq_dim=256,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        rope_max_seq_len=1024,
    )
    for name, heads, ffn, layers, channels in [
        ("wan2.1-t2v-1.3b", 12, 8960, 30, 16),
        ("wan2.1-t2v-14b", 40, 13824, 40, 16),
        ("wan2.2-ti2v-5b", 24, 14336, 30, 48),
    ]:
        c = models.ZOO[name].config()
        assert {k: c[k] for k in common} == common, name
        assert (c["num_attention_heads"], c["ffn_dim"], c["num_layers"]) == (heads, ffn, layers)
        assert (c["in_channels"], c["out_channels"]) == (channels, channels)


def test_tiny_configs_keep_structure() -> None:
    for name in ("tiny-qwen3-vl-vision", "tiny-qwen3-omni-vision"):
        c = models.ZOO[name].config()
        assert (c.patch_size, c.temporal_patch_size, c.spatial_merge_size) == (16, 2, 2)
        assert len(c.deepstack_visual_indexes) >= 2
    c = models.ZOO["tiny-qwen3-omni-audio"].config()
    assert (c.num_mel_bins, c.n_window, c.n_window_infer) == (128, 50, 800)
    model = _model("tiny-qwen3-omni-audio", torch.float32)
    assert all(hasattr(model, f"conv2d{i}") for i in (1, 2, 3))
    c = models.ZOO["tiny-wan"].config()
    assert (c["cross_attn_norm"], c["qk_norm"], tuple(c["patch_size"])) == (
        True,
        "rms_norm_across_heads",
        (1, 2, 2),
    )


def test_image_processor_448() -> None:
    inputs = models.example_inputs("qwen3-vl-2b-vision")
    assert inputs["grid_thw"].tolist() == [[1, 28, 28]]
    assert inputs["hidden_states"].shape == (784, 3 * 2 * 16 * 16)
    assert inputs["hidden_states"].dtype == torch.float32
    image = models.synthetic_image(448, 448)
    direct = models.image_inputs(models.ZOO["qwen3-omni-vision"].config(), [image, image])
    assert direct["grid_thw"].tolist() == [[1, 28, 28], [1, 28, 28]]
    assert direct["hidden_states"].shape[0] == 2 * 784
    # Normalized with mean = std = 0.5: values within [-1, 1].
    assert direct["hidden_states"].abs().max() <= 1.0 + 1e-6
    bf16 = models.example_inputs("qwen3-vl-8b-vision", torch.bfloat16, size=(448, 448))
    assert bf16["hidden_states"].dtype == torch.bfloat16


def test_audio_features_30s() -> None:
    inputs = models.example_inputs("qwen3-omni-audio")
    assert inputs["input_features"].shape == (128, 3000)
    assert inputs["feature_lens"].tolist() == [3000]
    two = models.example_inputs("qwen3-omni-audio", torch.bfloat16, size=[30, 2.0])
    assert two["input_features"].shape == (128, 3200)
    assert two["input_features"].dtype == torch.bfloat16
    assert two["feature_lens"].tolist() == [3000, 200]


def test_wan_default_inputs() -> None:
    inputs = models.example_inputs("wan2.1-t2v-1.3b", torch.bfloat16)
    assert inputs["hidden_states"].shape == (1, 16, 5, 32, 32)
    assert inputs["encoder_hidden_states"].shape == (1, 512, 4096)
    assert inputs["hidden_states"].dtype == torch.bfloat16
    assert inputs["timestep"].tolist() == [500.0]
    assert models.example_inputs("wan2.2-ti2v-5b", size=(5, 32, 32))["hidden_states"].shape == (
        1,
        48,
        5,
        32,
        32,
    )
    a = models.example_inputs("tiny-wan", seed=3)
    b = models.example_inputs("tiny-wan", seed=3)
    assert torch.equal(a["hidden_states"], b["hidden_states"])
    with pytest.raises(ValueError):
        models.example_inputs("tiny-wan", size=(2, 7, 8))
    with pytest.raises(ValueError):
        models.example_inputs("tiny-wan", size=(2, 8))
    with pytest.raises(ValueError, match="whole numbers"):  # was cut to 5 frames
        models.example_inputs("tiny-wan", size=(5.5, 8, 8))
    assert models.example_inputs("tiny-wan", size=(2.0, 8, 8))["hidden_states"].shape[2] == 2


@pytest.mark.parametrize(
    "name, size, error",
    [
        ("tiny-qwen3-vl-vision", 0, "bad image size 0: sides must be >= 1 pixel"),  # (a ZeroDivisionError)
        ("tiny-qwen3-vl-vision", [64, (0, 64)], r"bad image size \(0, 64\)"),
        ("tiny-qwen3-omni-audio", -5, "bad audio length -5: seconds must be positive"),  # (numpy's words)
        ("tiny-qwen3-omni-audio", [1.0, float("inf")], "bad audio length"),
    ],
)
def test_example_inputs_refuse_sizes_below_one(name, size, error):
    with pytest.raises(ValueError, match=error):
        models.example_inputs(name, size=size)


def test_synthetic_data() -> None:
    a = np.asarray(models.synthetic_image(64, 96, seed=1))
    assert a.shape == (64, 96, 3) and a.dtype == np.uint8
    assert np.array_equal(a, np.asarray(models.synthetic_image(64, 96, seed=1)))
    assert not np.array_equal(a, np.asarray(models.synthetic_image(64, 96, seed=2)))
    assert a.std() > 20
    w = models.synthetic_waveform(1.5, seed=4)
    assert w.shape == (24000,) and w.dtype == np.float32
    assert np.array_equal(w, models.synthetic_waveform(1.5, seed=4))
    assert 0.4 < np.abs(w).max() <= 0.5 + 1e-6


@pytest.mark.parametrize(
    "name, config, key, width",
    [
        ("tiny-qwen3-vl-vision", dict(patch_size=8), "hidden_states", 3 * 2 * 8 * 8),
        ("tiny-wan", dict(in_channels=8), "hidden_states", 8),
    ],
)
def test_example_inputs_follow_the_config_the_model_is_built_with(name, config, key, width) -> None:
    # bench_models --config built the changed model but fed it the zoo config's inputs.
    inputs = models.example_inputs(name, config=config)
    assert inputs[key].shape[1] == width
    model = models.build_model(name, **config)
    with torch.no_grad():
        model(**inputs)
    with pytest.raises(KeyError, match=r"example_inputs\('tiny-wan'\): WanTransformer3DModel has no 'in_chans'"):
        models.example_inputs("tiny-wan", config=dict(in_chans=8))


@pytest.mark.parametrize(
    "name, grids",
    [
        ("qwen3-vl-2b-vision", [[1, 28, 28], [1, 18, 16], [1, 16, 16]]),
        ("qwen3-omni-vision", [[1, 28, 28], [1, 12, 10], [1, 6, 6]]),  # its processor's own bounds: 3136 pixels up
    ],
)
def test_image_inputs_resize_as_the_released_processor_does(name, grids):
    # Qwen3-Omni's preprocessor_config.json: min_pixels 3136, max_pixels 12845056 (Qwen3-VL's: 65536, 16777216).
    assert [models.example_inputs(name, size=s)["grid_thw"].tolist()[0] for s in (448, (200, 160), 96)] == grids


def test_a_clip_too_short_for_the_feature_extractor_raises() -> None:
    # Whisper's extractor reflect-pads 200 samples on each side: a shorter clip failed inside numpy/torch.
    config = models.ZOO["tiny-qwen3-omni-audio"].config()
    with pytest.raises(ValueError, match=r"audio_inputs: clip 1 has shape \(160,\).*at least 201 samples"):
        models.audio_inputs(config, [models.synthetic_waveform(1.0), models.synthetic_waveform(0.01)])
    assert models.audio_inputs(config, [np.zeros(201, np.float32)])["feature_lens"].tolist() == [1]


def test_spec_build_and_zoo() -> None:
    assert list(models.ZOO)[:3] == ["qwen3-vl-2b-vision", "qwen3-vl-8b-vision", "qwen3-omni-vision"]
    for name, spec in models.ZOO.items():
        assert spec.name == name
        assert spec.family in ("qwen3_vl_vision", "qwen3_omni_vision", "qwen3_omni_audio", "wan")
        assert spec.description
    model = models.ZOO["tiny-wan"].build()
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_unknown_name_raises() -> None:
    with pytest.raises(KeyError, match="tiny-wan"):
        models.build_model("no-such-model")
    with pytest.raises(KeyError, match="qwen3-vl-2b-vision"):
        models.example_inputs("no-such-model")


@pytest.mark.parametrize("name, key", [("tiny-wan", "num_heads"), ("tiny-qwen3-vl-vision", "num_head")])
def test_a_misspelt_config_key_raises(name, key) -> None:
    # diffusers' from_config drops a key its class does not take: the model was built unchanged.
    with pytest.raises(KeyError, match=rf"build_model\('{name}'\): \w+ has no '{key}'"):
        models.build_model(name, **{key: 8})
    assert models.build_model("tiny-wan", num_attention_heads=4).config.num_attention_heads == 4


def test_the_wan_pipeline_builder_builds_what_it_is_asked_for() -> None:
    # Each a mutant no test caught: experts of one seed (a graph bound to the wrong expert would pass),
    # expand_timesteps dropped (ti2v's per-token timesteps never ran), the encoder left in fp32.
    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.bfloat16, two_experts=True, expand_timesteps=True)
    assert pipe.text_encoder.dtype == pipe.transformer.dtype == torch.bfloat16
    a, b = pipe.transformer.state_dict(), pipe.transformer_2.state_dict()
    assert not any(torch.equal(a[k], b[k]) for k in a if a[k].numel() > 1 and a[k].std() > 0)
    assert pipe.config.expand_timesteps and pipe.config.boundary_ratio == 0.875
    with pytest.raises(ValueError, match=r"tiny-wan reads text_dim 64 but the xxl-2 UMT5 encoder writes 4096"):
        pipelines.build_wan_pipeline("tiny-wan", torch.bfloat16, text_encoder="xxl-2")
    call = pipelines.wan_call(guidance_scale=1.0, height=32)
    assert (call["guidance_scale"], call["height"], call["width"]) == (1.0, 32, 64)


def test_wan_inputs_refuse_a_latent_the_patch_does_not_divide_and_size_the_text() -> None:
    config = models.ZOO["tiny-wan"].config()
    with pytest.raises(ValueError):
        models.wan_inputs(config, 3, 8, 7, 5)
    assert models.example_inputs("tiny-wan", size=(1, 8, 8))["encoder_hidden_states"].shape[1] == 16
    assert models.example_inputs("tiny-wan", size=(1, 8, 8, 9))["encoder_hidden_states"].shape[1] == 9
