"""Whole models and pipelines, called the way users call them: ``generate`` and ``pipe(...)``.

``amxopt.optimize(model)`` (no example inputs) replaces the supported towers / pipeline components in
place; these tests then run the caller's own code path and compare what the user sees:
fp32 gives the same tokens / frames as the original, bf16 stays within 1.5x eager bf16's error
(against the fp32 original) on the logits / frames.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import amxopt
from amxopt import pipelines
from tests.helpers import CONFIG, max_abs_error

_NEW_TOKENS = 4
# Qwen3-VL prompts: one image; two images of different sizes; a video (frames, h, w in patches) and an image.
VL_PROMPTS = {
    "one image": dict(images=[(64, 96)]),
    "two images": dict(images=[(64, 96), (32, 64)]),
    "video": dict(videos=[(4, 4, 6)], images=[(32, 32)]),
}
_WAN_CALL = pipelines.wan_call(max_sequence_length=16)


def _generate(model, inputs):
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=_NEW_TOKENS, do_sample=False)


def _logits(model, inputs):
    with torch.no_grad():
        return model(**inputs).logits.float()


def _frames(pipe, **kw):
    return pipe(**{**_WAN_CALL, **kw}, generator=torch.Generator().manual_seed(0)).frames


@pytest.fixture(scope="module")
def qwen3_vl():
    return pipelines.build_qwen3_vl("tiny", torch.float32)


@pytest.mark.parametrize("prompt", list(VL_PROMPTS))
def test_qwen3_vl_generate_same_tokens_fp32(prompt, provider):
    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    inputs = pipelines.qwen3_vl_prompt(model, **VL_PROMPTS[prompt])
    expected = _generate(model, inputs)
    opt = amxopt.optimize(model, config=dataclasses.replace(CONFIG, provider=provider))
    assert opt is model and isinstance(model.model.visual, amxopt.OptimizedModule)
    assert torch.equal(_generate(opt, inputs), expected)
    report = opt.amxopt_report
    assert list(report.optimized) == ["model.visual"]
    assert "model.language_model" in report.left and "KV cache" in report.left["model.language_model"]
    assert report.optimized["model.visual"].report.counts()["attention"] == 3
    assert "model.visual" in str(report) and "amxopt.varlen_attention" in str(report)
    again = amxopt.optimize(opt)  # optimizing twice (without another config) keeps the same parts
    assert again is model and again.amxopt_report.optimized["model.visual"] is report.optimized["model.visual"]


def test_qwen3_vl_moe_tower_is_optimized_and_generates_the_same_tokens():
    # Qwen3-VL-30B-A3B's class: its tower (Qwen3VLMoeVisionModel, the dense tower's architecture) was
    # matched by no adapter, so the whole model was wrapped and every call failed to export; and its
    # calls pass output_router_logits on to the tower, which has no router.
    model = pipelines.build_qwen3_vl("tiny", torch.float32, moe=True)
    inputs = pipelines.qwen3_vl_prompt(model, **VL_PROMPTS["video"])
    expected, logits = _generate(model, inputs), _logits(model, inputs)
    opt = amxopt.optimize(model, config=CONFIG)
    assert type(opt.model.visual._source).__name__ == "Qwen3VLMoeVisionModel"
    assert list(opt.amxopt_report.optimized) == ["model.visual"]
    assert torch.equal(_generate(opt, inputs), expected)
    assert max_abs_error(_logits(opt, inputs), logits) <= 1e-4


def test_a_video_prompt_pads_its_frames_as_the_video_processor_does():
    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    assert pipelines.qwen3_vl_prompt(model, videos=[(5, 4, 4)])["video_grid_thw"].tolist() == [[3, 4, 4]]
    assert pipelines.qwen3_vl_prompt(model, videos=[(1, 4, 4)])["video_grid_thw"].tolist() == [[1, 4, 4]]
    with pytest.raises(ValueError, match=r"a video needs at least one frame, got videos=\[\(0, 4, 4\)\]"):
        pipelines.qwen3_vl_prompt(model, videos=[(0, 4, 4)])


@pytest.mark.parametrize("build", [pipelines.build_qwen3_vl, pipelines.build_qwen3_omni_thinker])
def test_a_bf16_whole_model_is_built_as_from_pretrained_builds_it(build):
    # model.to(bf16) cast the rotary and position tables, which from_pretrained(dtype=bf16) keeps fp32.
    fp32, bf16 = build(dtype=torch.float32), build(dtype=torch.bfloat16)
    assert {n: b.dtype for n, b in bf16.named_buffers()} == {n: torch.float32 for n, _ in fp32.named_buffers()}
    weights = dict(fp32.named_parameters())
    assert all(torch.equal(p, weights[n].to(p.dtype)) for n, p in bf16.named_parameters())


def test_prompts_resize_images_as_the_released_processor_does():
    # the real 2B tower's prompts took the tiny towers' one-patch minimum: 128 x 128 gave 8 x 8 patches
    model = pipelines.build_qwen3_vl("tiny")
    assert pipelines.qwen3_vl_prompt(model, images=[(128, 128)])["image_grid_thw"].tolist() == [[1, 8, 8]]
    model.model.visual.zoo_name = "qwen3-vl-2b-vision"  # the small variant's tower
    assert pipelines.qwen3_vl_prompt(model, images=[(128, 128)])["image_grid_thw"].tolist() == [[1, 16, 16]]


def test_a_whole_models_state_dict_round_trips_through_its_optimized_tower():
    # save_pretrained / load_state_dict of the whole model see the tower under its own names.
    eager, model = (pipelines.build_qwen3_vl("tiny", torch.float32) for _ in range(2))
    opt = amxopt.optimize(model, config=CONFIG)
    inputs = pipelines.qwen3_vl_prompt(model, **VL_PROMPTS["two images"])
    _logits(opt, inputs)  # captured
    assert opt.state_dict().keys() == eager.state_dict().keys()
    state = {k: v * 1.5 if ".visual." in k and v.is_floating_point() else v for k, v in eager.state_dict().items()}
    assert not opt.load_state_dict(state).missing_keys
    eager.load_state_dict(state)
    assert max_abs_error(_logits(opt, inputs), _logits(eager, inputs)) < 1e-4
    unexpected = opt.load_state_dict({"model.visual.nothing": torch.zeros(1)}, strict=False).unexpected_keys
    assert unexpected == ["model.visual.nothing"]


def test_qwen3_vl_bf16_logits_within_eager_error(qwen3_vl, provider):
    inputs32 = pipelines.qwen3_vl_prompt(qwen3_vl, **VL_PROMPTS["two images"])
    bf16 = pipelines.build_qwen3_vl("tiny", torch.bfloat16)
    inputs16 = pipelines.qwen3_vl_prompt(bf16, **VL_PROMPTS["two images"])
    ref = _logits(qwen3_vl, inputs32)
    eager_err = max_abs_error(_logits(bf16, inputs16), ref)
    opt = amxopt.optimize(bf16, config=dataclasses.replace(CONFIG, provider=provider))
    opt_err = max_abs_error(_logits(opt, inputs16), ref)
    assert opt_err <= 1.5 * eager_err, f"optimized {opt_err:.3e} vs eager bf16 {eager_err:.3e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwen3_omni_thinker_audio_and_image(dtype):
    fp32 = pipelines.build_qwen3_omni_thinker(torch.float32)
    model = pipelines.build_qwen3_omni_thinker(dtype)
    prompt = dict(images=[(64, 64)], audio_seconds=[1.3])
    inputs, inputs32 = pipelines.qwen3_omni_prompt(model, **prompt), pipelines.qwen3_omni_prompt(fp32, **prompt)
    expected, ref = _generate(model, inputs), _logits(fp32, inputs32)
    eager_err = max_abs_error(_logits(model, inputs), ref)
    opt = amxopt.optimize(model, config=CONFIG)
    assert sorted(opt.amxopt_report.optimized) == ["model.audio_tower", "model.visual"]
    if dtype == torch.float32:
        assert torch.equal(_generate(opt, inputs), expected)
        torch.testing.assert_close(_logits(opt, inputs), ref)
    else:
        opt_err = max_abs_error(_logits(opt, inputs), ref)
        assert opt_err <= 1.5 * eager_err, f"optimized {opt_err:.3e} vs eager bf16 {eager_err:.3e}"


@pytest.mark.parametrize(
    "variant", [dict(), dict(two_experts=True), dict(expand_timesteps=True)], ids=["wan2.1", "wan2.2-a14b", "ti2v"]
)
def test_wan_pipeline_frames_fp32(variant, provider):
    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.float32, **variant)
    expected = _frames(pipe)
    assert amxopt.optimize(pipe, config=dataclasses.replace(CONFIG, provider=provider)) is pipe
    torch.testing.assert_close(_frames(pipe), expected)
    report = pipe.amxopt_report
    parts = ["text_encoder", "transformer"] + (["transformer_2"] if variant.get("two_experts") else [])
    assert sorted(report.optimized) == parts and "not a part amxopt optimizes in a pipeline" in report.left["vae"]
    for name in parts:
        assert len(report.optimized[name].graphs) == 1, f"{name}: cond, uncond and both steps share one graph"
    assert report.optimized["transformer"].report.counts()["attention"] == 4
    assert "attention mask" in report.optimized["text_encoder"].report.left[0].detail  # UMT5's position bias


def test_wan_pipeline_bf16_frames_within_eager_error():
    ref = _frames(pipelines.build_wan_pipeline("tiny-wan", torch.float32))
    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.bfloat16)
    eager_err = max_abs_error(_frames(pipe), ref)
    amxopt.optimize(pipe, config=CONFIG)
    opt_err = max_abs_error(_frames(pipe), ref)
    assert opt_err <= 1.5 * eager_err, f"optimized {opt_err:.3e} vs eager bf16 {eager_err:.3e}"


def test_wan_transformer_takes_a_guidance_batch_of_two():
    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.float32)
    model = pipe.transformer
    amxopt.optimize(pipe, config=CONFIG)
    gen = torch.Generator().manual_seed(0)
    x = dict(
        hidden_states=torch.randn(2, 16, 2, 8, 8, generator=gen),
        timestep=torch.tensor([500.0, 500.0]),
        encoder_hidden_states=torch.randn(2, 16, 64, generator=gen),
    )
    with torch.no_grad():
        out = pipe.transformer(**x, return_dict=False, attention_kwargs=None)
        torch.testing.assert_close(out[0], model(**x).sample)
    assert pipe.transformer.dtype == torch.float32 and pipe.transformer.config is model.config


def test_whole_model_takes_no_example_inputs(qwen3_vl):
    with pytest.raises(ValueError, match="part by part"):
        amxopt.optimize(qwen3_vl, {"input_ids": torch.ones(1, 3, dtype=torch.long)}, CONFIG)


class _DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        return self.proj(x[: int(x.sum() > 0) + 1])  # a Python branch on data: export cannot capture it


class _Pipeline:
    """The part of a diffusers pipeline amxopt reads: ``components``."""

    def __init__(self, text_encoder):
        self.text_encoder = text_encoder

    @property
    def components(self):
        return {"text_encoder": self.text_encoder, "tokenizer": None}


def test_pipeline_part_export_cannot_capture_runs_eager_and_says_why():
    source = _DataDependent().eval()
    pipe = amxopt.optimize(_Pipeline(source), config=CONFIG)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(pipe.text_encoder(x), source(x))
    opt = pipe.amxopt_report.optimized["text_encoder"]
    assert opt.eager_reason and "could not capture _DataDependent" in opt.eager_reason
    assert "runs as eager PyTorch" in str(pipe.amxopt_report)
    # the summary does not count it as optimized
    assert "0 part(s) optimized, 1 run as eager PyTorch (capture failed)" in str(pipe.amxopt_report)
    assert "text_encoder | eager " in str(pipe.amxopt_report)


def _data_dependent_hook(module, args, out):  # Python on a value: export cannot trace it
    return out * 2 if float(out.abs().max()) > 1e9 else out


@pytest.mark.parametrize("keep_source", [True, False])
def test_a_part_that_a_later_hook_makes_uncapturable_runs_eager_until_it_is_removed(keep_source):
    source = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    pipe = amxopt.optimize(_Pipeline(source), config=dataclasses.replace(CONFIG, keep_source=keep_source))
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = pipe.text_encoder(x)
        hook = source[0].register_forward_hook(_data_dependent_hook)
        if keep_source:
            torch.testing.assert_close(pipe.text_encoder(x), expected)
            assert pipe.text_encoder.eager_reason
        else:  # said to come from from_pretrained or load, which the user had not called
            with pytest.raises(amxopt.CaptureError, match="amxopt.optimize packed its weights and released"):
                pipe.text_encoder(x)
        hook.remove()  # captured again at the next call: it ran eagerly for good
        torch.testing.assert_close(pipe.text_encoder(x), expected)
    assert pipe.text_encoder.eager_reason is None and len(pipe.text_encoder.graphs) == 1


def test_a_part_loaded_packed_that_cannot_be_captured_says_how_to_run_it():
    from amxopt.runtime import weights

    source = _DataDependent().eval()
    weights.guard(source)  # as from_pretrained leaves a part: packed placeholders, eager calls refused
    source.proj.weight = weights.placeholder(source.proj.weight, {})
    pipe = amxopt.optimize(_Pipeline(source), config=CONFIG)
    with torch.no_grad(), pytest.raises(amxopt.CaptureError, match="packed as they were loaded"):
        pipe.text_encoder(torch.randn(3, 8))


def test_a_text_encoder_left_in_a_pipeline_is_not_called_a_language_model():
    from transformers import CLIPTextConfig, CLIPTextModel

    from amxopt.runtime import components

    config = CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    reason = components._left_reason("text_encoder_2", CLIPTextModel(config), pipeline=True)  # SDXL's second one
    assert "KV cache" not in reason and "not a part amxopt optimizes in a pipeline" in reason, reason


@pytest.mark.parametrize("part, cls", [("transformer", "WanTransformer3DModel"), ("vae", "AutoencoderKLWan")])
def test_a_part_optimized_and_assigned_by_the_caller_keeps_its_class_in_the_pipeline_config(part, cls):
    # The VAE is no part optimize(pipe) takes itself: one the caller optimized is kept and reported all the same.
    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.float32)
    setattr(pipe, part, amxopt.optimize(getattr(pipe, part), config=CONFIG))  # diffusers records OptimizedModule
    amxopt.optimize(pipe, config=CONFIG)
    assert getattr(pipe.config, part) == ("diffusers", cls), getattr(pipe.config, part)
    assert isinstance(getattr(pipe, part), amxopt.OptimizedModule) and part in pipe.amxopt_report.optimized


def test_a_pipeline_built_from_an_optimized_ones_parts_is_routed_by_optimizing_it(tmp_path):
    # diffusers' from_pipe (or Cls(**pipe.components)) records OptimizedModule as the parts' class, and
    # its LoRA and save methods skip them: optimize() routes it, keeping the parts as optimized.
    from diffusers import WanPipeline

    pipe = amxopt.optimize(pipelines.build_wan_pipeline("tiny-wan", torch.float32), config=CONFIG)
    derived = WanPipeline.from_pipe(pipe)
    assert derived.config.transformer == ("amxopt.runtime.module", "OptimizedModule")  # diffusers' record
    derived.save_pretrained(tmp_path / "skipped")  # diffusers skips the parts and records (None, None)
    assert derived.config.transformer == (None, None)
    assert amxopt.optimize(derived) is derived
    assert derived.config.transformer == ("diffusers", "WanTransformer3DModel"), derived.config.transformer
    assert derived.transformer is pipe.transformer and type(derived).__name__ == "WanPipeline"
    assert type(derived) is not WanPipeline  # its LoRA methods and save_pretrained reach the sources
    derived.save_pretrained(tmp_path / "routed")
    assert (tmp_path / "routed" / "transformer").is_dir()


def test_an_optimized_pipeline_saves_its_parts_as_their_source_models(tmp_path):
    from diffusers import WanPipeline

    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.float32)
    expected = _frames(pipe)
    amxopt.optimize(pipe, config=CONFIG)  # keep_source: the weights diffusers saves are still there
    pipe.save_pretrained(tmp_path / "kept")
    assert pipe.config.transformer == ("diffusers", "WanTransformer3DModel")  # the live config is untouched
    torch.testing.assert_close(_frames(WanPipeline.from_pretrained(tmp_path / "kept")), expected)

    released = pipelines.build_wan_pipeline("tiny-wan", torch.float32)
    amxopt.optimize(released, config=dataclasses.replace(CONFIG, keep_source=False))
    _frames(released)  # captured: the weights are packed and released
    with pytest.raises(RuntimeError, match=r"packed the weights of \['text_encoder', 'transformer'\].*before amxopt"):
        released.save_pretrained(tmp_path / "released")
    assert not (tmp_path / "released").exists()


def test_a_part_compiled_after_optimize_is_saved_kept_and_reported(tmp_path):
    # torch.compile(pipe.transformer) after optimize(): save_pretrained skipped the part (diffusers
    # unwraps the compile, then finds amxopt's class) and recorded (None, None); optimize(pipe) again
    # wrapped the compile in a second optimized module, whose calls failed (helper review, stop 61).
    from diffusers import WanPipeline
    from torch._dynamo.eval_frame import OptimizedModule as Compiled

    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.float32)
    expected = _frames(pipe)
    amxopt.optimize(pipe, config=CONFIG)
    optimized = pipe.transformer
    pipe.transformer = torch.compile(pipe.transformer, backend="eager")
    pipe.save_pretrained(tmp_path / "saved")
    assert pipe.config.transformer == ("diffusers", "WanTransformer3DModel"), pipe.config.transformer
    torch.testing.assert_close(_frames(WanPipeline.from_pretrained(tmp_path / "saved")), expected)
    amxopt.optimize(pipe)
    assert isinstance(pipe.transformer, Compiled) and pipe.transformer._orig_mod is optimized
    assert pipe.amxopt_report.optimized["transformer"] is optimized and "replaced" not in str(pipe.amxopt_report)
    torch.testing.assert_close(_frames(pipe), expected, atol=1e-5, rtol=1e-5)
    assert optimized.graphs


def test_a_tower_compiled_before_optimize_is_replaced_compile_and_all(qwen3_vl, caplog):
    # Its forward is the compiled tower's own: optimize() put its module inside the compile, which never
    # called it, and the report said "optimized" (helper review, stop 61).
    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    model.model.visual = torch.compile(model.model.visual, backend="eager")
    inputs = pipelines.qwen3_vl_prompt(model, images=[(64, 96)])
    amxopt.optimize(model, config=CONFIG)
    assert isinstance(model.model.visual, amxopt.OptimizedModule)
    assert "Qwen3VLModel.visual was compiled by torch.compile; amxopt's optimized module replaces it" in caplog.text
    with torch.no_grad():
        assert max_abs_error(model(**inputs).logits, qwen3_vl(**inputs).logits) < 1e-4
    assert model.model.visual.graphs


def test_a_whole_model_call_asking_for_hidden_states_runs_its_tower_without_them(qwen3_vl, caplog):
    """transformers passes the call's output_hidden_states on to the vision tower and returns the
    language model's: the tower's graph has none to give and says so."""
    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    inputs = pipelines.qwen3_vl_prompt(model, images=[(64, 96)])
    amxopt.optimize(model, config=CONFIG)
    with torch.no_grad():
        got = model(**inputs, output_hidden_states=True)
        expected = qwen3_vl(**inputs, output_hidden_states=True)
        tower = model.model.visual(inputs["pixel_values"], inputs["image_grid_thw"], output_hidden_states=True)
    torch.testing.assert_close(got.logits, expected.logits)
    assert len(got.hidden_states) == len(expected.hidden_states)
    assert tower.hidden_states is None
    assert "computes its outputs without per-layer states: output_hidden_states ignored" in caplog.text


def test_optimizing_a_pipeline_again_with_another_config_optimizes_its_parts_again():
    source = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()
    pipe = amxopt.optimize(_Pipeline(source), config=CONFIG)
    first = pipe.text_encoder
    assert amxopt.optimize(pipe).text_encoder is first  # no config given: the part stays as it was
    assert amxopt.optimize(pipe, config=CONFIG).text_encoder is first  # the same config
    other = dataclasses.replace(CONFIG, fuse_activation=False)
    amxopt.optimize(pipe, config=other)
    assert pipe.text_encoder is not first and pipe.text_encoder.amx_config == other
    assert pipe.amxopt_report.optimized["text_encoder"] is pipe.text_encoder
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(pipe.text_encoder(x), source(x))
    targets = [n.target for n in pipe.text_encoder.graphs[0].graph.nodes]
    assert torch.ops.aten.gelu.default in targets  # not fused into the Linear, as configured

    config = dataclasses.replace(CONFIG, keep_source=False)
    released = amxopt.optimize(_Pipeline(nn.Linear(8, 8).eval()), config=config)
    with torch.no_grad():
        released.text_encoder(x)  # captured: its weights are packed and released
    with pytest.raises(ValueError, match=r"_Pipeline.text_encoder was optimized before with another config \(autotune"):
        amxopt.optimize(released, config=dataclasses.replace(config, autotune=True))


def test_a_part_in_training_mode_is_refused_at_optimize_and_at_a_call_after_train():
    with pytest.raises(ValueError, match=r"_Pipeline.text_encoder \(Linear\) is in training mode.*\.eval\(\)"):
        amxopt.optimize(_Pipeline(nn.Linear(8, 8)), config=CONFIG)
    pipe = amxopt.optimize(_Pipeline(nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)).eval()), config=CONFIG)
    pipe.text_encoder.train()  # eager would drop activations now; the graph computes inference
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"Sequential is in training mode.*call \.eval\(\)"):
        pipe.text_encoder(torch.randn(3, 8))
    with torch.no_grad():
        assert pipe.text_encoder.eval()(torch.randn(3, 8)).shape == (3, 8)


def test_train_on_the_source_or_one_of_its_layers_is_refused_as_on_the_optimized_model():
    # The source's flags were not read: eager dropped activations (1.13 off) while the graph ran inference.
    source = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8)).eval()
    opt = amxopt.optimize(source, {"input": torch.randn(3, 8)}, dataclasses.replace(CONFIG, keep_source=True))
    for train, refused in [
        (source, "Sequential"),
        (source[1], r"Sequential\.1"),
        (getattr(opt, "1"), r"Sequential\.1"),
    ]:
        train.train()
        with torch.no_grad(), pytest.raises(RuntimeError, match=rf"{refused} is in training mode.*call \.eval\(\)"):
            opt(torch.randn(3, 8))
        source.eval()
        with torch.no_grad():
            torch.testing.assert_close(opt(x := torch.randn(3, 8)), source(x))
    source[2] = nn.Linear(8, 8)  # a new layer, in training mode as built: captured again, not refused
    with torch.no_grad():
        torch.testing.assert_close(opt(x := torch.randn(3, 8)), source(x))
    # With no graph to compare against (before the first call; after a load dropped them): the
    # graph was captured in training mode, and ran its dropout.
    uncalled = amxopt.optimize(source, config=dataclasses.replace(CONFIG, keep_source=True))
    source[1].train()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"Sequential\.1 is in training mode"):
        uncalled(torch.randn(3, 8))
    source.eval()
    opt.load_state_dict(source.state_dict())
    source[1].train()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"Sequential\.1 is in training mode"):
        opt(torch.randn(3, 8))


def test_a_text_decoder_with_no_supported_tower_is_told_to_run_generate_eagerly(caplog):
    # Qwen2.5-VL's whole model was wrapped whole: its generate() ran eagerly, and nothing said so.
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64,
    )  # fmt: skip
    opt = amxopt.optimize(Qwen2ForCausalLM(config).eval(), config=CONFIG)
    assert "Qwen2ForCausalLM decodes text with a KV cache" in caplog.text
    assert "generate() runs the model's own forward as eager PyTorch" in caplog.text
    assert isinstance(opt, amxopt.OptimizedModule)
    caplog.clear()
    amxopt.optimize(nn.Sequential(nn.Linear(8, 8)).eval(), config=CONFIG)
    assert "decodes text" not in caplog.text


class _TwoPartPipeline(_Pipeline):
    def __init__(self, text_encoder, transformer):
        super().__init__(text_encoder)
        self.transformer = transformer

    @property
    def components(self):
        return {"text_encoder": self.text_encoder, "transformer": self.transformer}


def test_a_refused_part_leaves_every_part_as_it_was():
    # optimize(pipe, config=other) replaced the parts before the one it refused, and raised: the
    # pipeline then ran a mix, and its report named parts it no longer held.
    pipe = _TwoPartPipeline(nn.Linear(8, 8).eval(), nn.Linear(8, 8).eval())
    pipe = amxopt.optimize(pipe, config=CONFIG)
    pipe.transformer = amxopt.optimize(pipe.transformer.__dict__["_source"], config=_RELEASED)
    with torch.no_grad():
        pipe.transformer(torch.randn(3, 8))  # captured: its weights are packed and released
    before = dict(pipe.components)
    with pytest.raises(ValueError, match=r"_TwoPartPipeline.transformer was optimized before with another config"):
        amxopt.optimize(pipe, config=dataclasses.replace(CONFIG, autotune=True))
    assert pipe.components == before


_RELEASED = dataclasses.replace(CONFIG, keep_source=False)


def test_a_tensor_parallel_part_the_caller_assigned_is_kept_and_said():
    # Its rank 0 module was taken for a part (at model.visual.module), and optimized again at tp=1
    # when the config differed: the other ranks then waited for a collective it never made.
    from amxopt.runtime.tp import TPModule

    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    rank0 = amxopt.optimize(model.model.visual, config=CONFIG)
    part = TPModule.__new__(TPModule)  # what optimize of the whole model reads of one: no workers needed
    nn.Module.__init__(part)
    part.module, part.tp = rank0, 2
    model.model.visual = part
    amxopt.optimize(model, config=dataclasses.replace(CONFIG, fuse_activation=False))
    assert model.model.visual is part and part.module is rank0
    report = model.amxopt_report
    assert not report.optimized and "TPModule of Qwen3VLVisionModel (tp=2)" in report.left["model.visual"]


def test_the_report_says_which_parts_were_replaced_since():
    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    eager_tower = model.model.visual
    amxopt.optimize(model, config=CONFIG)
    model.model.visual = eager_tower
    said = str(model.amxopt_report)
    assert "0 part(s) optimized, 1 replaced by the caller since, 2 left as they are" in said
    assert "model.visual         | replaced  | by the caller since optimize" in said


def test_saving_a_whole_model_whose_tower_released_its_weights_names_the_tower():
    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    amxopt.optimize(model, config=_RELEASED)
    with torch.no_grad():
        model(**pipelines.qwen3_vl_prompt(model, images=[(64, 96)]))
    with pytest.raises(
        RuntimeError, match=r"the optimized part model\.visual \(Qwen3VLVisionModel\) has no state dict"
    ):
        model.state_dict()


def test_the_report_of_a_copy_or_of_a_collected_model_marks_no_part_replaced():
    import copy
    import gc

    model = pipelines.build_qwen3_vl("tiny", torch.float32)
    amxopt.optimize(model, config=CONFIG)
    twin = copy.deepcopy(model)  # its report's part is its own (it was compared with the original's)
    assert twin.amxopt_report.optimized["model.visual"] is twin.model.visual
    assert "1 part(s) optimized, 2 left as they are" in str(twin.amxopt_report)
    report = model.amxopt_report
    del model, twin
    gc.collect()
    assert "1 part(s) optimized, 2 left as they are" in str(report)
