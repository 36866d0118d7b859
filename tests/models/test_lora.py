"""LoRA adapters (peft, through diffusers' API) with an optimized Wan transformer and pipeline:
loaded before or after optimize, rescaled, disabled, fused, unloaded; each call equal to eager."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

import amxopt
from amxopt import models, pipelines
from amxopt.runtime import max_abs_error
from tests.helpers import CONFIG

peft = pytest.importorskip("peft", reason="peft is not installed (pip install peft)")

WAN = "tiny-wan"
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.2"]


def _with_adapter(seed: int = 0) -> torch.nn.Module:
    model = models.build_model(WAN, torch.float32)
    torch.manual_seed(seed)  # random B as well as A: the adapter changes the output from the start
    lora = peft.LoraConfig(r=4, lora_alpha=32, target_modules=TARGETS, init_lora_weights=False)
    model.add_adapter(lora, adapter_name="style")
    return model.eval()


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)


def _config(keep_source: bool, tmp_path) -> amxopt.AmxConfig:
    return dataclasses.replace(CONFIG, keep_source=keep_source, autotune_cache=str(tmp_path))


@pytest.mark.parametrize("keep_source", [True, False], ids=["kept", "released"])
def test_adapter_scale_and_switches_after_optimize_are_used(keep_source, tmp_path):
    model, inputs = _with_adapter(), models.example_inputs(WAN, torch.float32)
    eager = copy.deepcopy(model)
    opt = amxopt.optimize(model, inputs, _config(keep_source, tmp_path))
    assert max_abs_error(_run(opt, inputs), _run(eager, inputs)) < 1e-5
    for change in (
        lambda m: m.set_adapters(["style"], weights=[0.3]),  # through the optimized module, as a user calls it
        lambda m: m.disable_adapters(),
        lambda m: m.enable_adapters(),
    ):
        before = _run(eager, inputs)
        change(opt), change(eager)
        assert max_abs_error(_run(eager, inputs), before) > 1e-3  # the change matters
        assert max_abs_error(_run(opt, inputs), _run(eager, inputs)) < 1e-5  # was the graph's constant


@pytest.mark.parametrize("keep_source", [True, False], ids=["kept", "released"])
def test_a_scaling_held_as_a_tensor_and_changed_in_place_is_used(keep_source, tmp_path):
    # After enable_lora_hotswap peft keeps each scaling as a tensor, which scale_lora_layers changes in place.
    from diffusers.utils.peft_utils import scale_lora_layers

    inputs = models.example_inputs(WAN, torch.float32)
    donor = peft.utils.get_peft_model_state_dict(_with_adapter(), adapter_name="style")
    model, eager = models.build_model(WAN, torch.float32), models.build_model(WAN, torch.float32)
    for m in (model, eager):
        m.enable_lora_hotswap(target_rank=4)
        m.load_lora_adapter(donor, adapter_name="style", prefix=None)
    assert isinstance(model.blocks[0].attn1.to_q.scaling["style"], torch.Tensor)
    opt = amxopt.optimize(model, inputs, _config(keep_source, tmp_path))
    before = _run(opt, inputs)
    scale_lora_layers(model, 0.25), scale_lora_layers(eager, 0.25)
    assert max_abs_error(_run(eager, inputs), before) > 1e-3  # the change matters
    assert max_abs_error(_run(opt, inputs), _run(eager, inputs)) < 1e-5


def test_released_weights_keep_the_adapters_own(tmp_path):
    # peft reads LoRA's A and B to save, merge or combine adapters: released to meta placeholders,
    # saving failed, and add_weighted_adapter failed halfway, leaving an adapter that ran wrong.
    model, inputs = _with_adapter(), models.example_inputs(WAN, torch.float32)
    expected = {k: v.clone() for k, v in peft.utils.get_peft_model_state_dict(model, adapter_name="style").items()}
    opt = amxopt.optimize(model, inputs, _config(False, tmp_path))
    _run(opt, inputs)
    assert model.blocks[0].attn1.to_q.base_layer.weight.device.type == "meta"  # the base weights were released
    saved = peft.utils.get_peft_model_state_dict(model, adapter_name="style")
    assert saved.keys() == expected.keys() and all(torch.equal(saved[k], expected[k]) for k in expected)


def test_a_save_with_an_adapter_says_to_fuse_it_first(tmp_path):
    opt = amxopt.optimize(_with_adapter(), models.example_inputs(WAN), _config(False, tmp_path))
    with pytest.raises(RuntimeError, match=r"a LoRA adapter's layers: fuse the adapter .* before amxopt.optimize"):
        opt.save(tmp_path / "artifact")


def test_a_fuse_after_optimize_packs_the_fused_weights_or_is_refused_where_they_were_released(tmp_path):
    inputs = models.example_inputs(WAN, torch.float32)
    kept, eager = _with_adapter(), _with_adapter()
    opt = amxopt.optimize(kept, inputs, _config(True, tmp_path))
    _run(opt, inputs)
    opt.fuse_lora(), eager.fuse_lora()  # base.weight.data += delta: no version bump to see
    opt.unload_lora(), eager.unload_lora()
    assert max_abs_error(_run(opt, inputs), _run(eager, inputs)) < 1e-5  # stale packings: the adapter lost

    released = amxopt.optimize(_with_adapter(), inputs, _config(False, tmp_path))
    expected = _run(released, inputs)
    released.fuse_lora()
    with pytest.raises(RuntimeError, match="merged into .*released, which changed nothing: undo it"):
        _run(released, inputs)
    released.unfuse_lora()
    assert max_abs_error(_run(released, inputs), expected) == 0.0
    released.fuse_lora()
    released.unload_lora()  # no call between: the merge is lost for good
    with pytest.raises(RuntimeError, match="merged into weights .* and the model changed since"):
        _run(released, inputs)


@pytest.mark.parametrize("keep_source", [True, False], ids=["kept", "released"])
def test_pipeline_lora_calls_reach_the_optimized_transformer(keep_source, tmp_path):
    call = dict(pipelines.wan_call(max_sequence_length=16, output_type="latent"))
    donor = _with_adapter(seed=1)
    lora = peft.utils.get_peft_model_state_dict(donor, adapter_name="style")
    lora = {f"transformer.{k}": v for k, v in lora.items()}

    def latents(pipe):
        return pipe(**call, generator=torch.Generator().manual_seed(0)).frames

    eager, pipe = pipelines.build_wan_pipeline(WAN), pipelines.build_wan_pipeline(WAN)
    if not keep_source:
        pipe.load_lora_weights(dict(lora), adapter_name="style")  # adapters come before optimize here
    amxopt.optimize(pipe, config=_config(keep_source, tmp_path))
    latents(pipe)
    steps = [lambda p: p.set_adapters(["style"], [0.4]), lambda p: p.disable_lora(), lambda p: p.enable_lora()]
    if keep_source:
        steps = [lambda p: p.load_lora_weights(dict(lora), adapter_name="style"), *steps]
        steps += [lambda p: p.fuse_lora(), lambda p: p.unload_lora_weights()]
    else:
        eager.load_lora_weights(dict(lora), adapter_name="style")
    for step in steps:
        step(pipe), step(eager)
        assert max_abs_error(latents(pipe), latents(eager)) < 1e-5


def test_an_adapter_loaded_after_weights_were_released_is_a_clear_error(tmp_path):
    model, inputs = models.build_model(WAN, torch.float32), models.example_inputs(WAN, torch.float32)
    opt = amxopt.optimize(model, inputs, _config(False, tmp_path))
    model.add_adapter(peft.LoraConfig(r=4, target_modules=TARGETS), adapter_name="style")  # built on meta weights
    with pytest.raises(RuntimeError, match=r"lora_A\.style\.weight is on the meta device.*before amxopt\.optimize"):
        _run(opt, inputs)
    model.delete_adapters("style")
    _run(opt, inputs)
    # diffusers' fused q/k/v, built from released weights: the message guessed a LoRA adapter
    # (helper review, stop 61)
    model.fuse_qkv_projections()
    with pytest.raises(RuntimeError, match=r"to_qkv\.weight is on the meta device.*fuse_qkv_projections\(\)"):
        _run(opt, inputs)
    model.unfuse_qkv_projections()
    _run(opt, inputs)


def _adapter_weights(seed: int) -> dict:
    return peft.utils.get_peft_model_state_dict(_with_adapter(seed), adapter_name="style")


@pytest.mark.parametrize("keep_source", [True, False], ids=["kept", "released"])
def test_a_hotswap_through_the_optimized_module_is_used_or_refused(keep_source, tmp_path):
    # peft's hotswap copies the new adapter into the old one's tensors through .data: nothing sees it.
    inputs = models.example_inputs(WAN, torch.float32)
    model, eager = models.build_model(WAN, torch.float32), models.build_model(WAN, torch.float32)
    for m in (model, eager):
        m.enable_lora_hotswap(target_rank=4)
        m.load_lora_adapter(_adapter_weights(1), adapter_name="style", prefix=None)
    opt = amxopt.optimize(model, inputs, _config(keep_source, tmp_path))
    assert max_abs_error(_run(opt, inputs), _run(eager, inputs)) < 1e-5
    if not keep_source:
        with pytest.raises(RuntimeError, match="a hotswap writes the adapter's weights in place"):
            opt.load_lora_adapter(_adapter_weights(2), adapter_name="style", prefix=None, hotswap=True)
        return
    before = _run(eager, inputs)
    for m in (opt, eager):
        m.load_lora_adapter(_adapter_weights(2), adapter_name="style", prefix=None, hotswap=True)
    assert max_abs_error(_run(eager, inputs), before) > 1e-3
    assert max_abs_error(_run(opt, inputs), _run(eager, inputs)) < 1e-5


@pytest.mark.parametrize("copier", [copy.deepcopy, copy.copy], ids=["deepcopy", "copy"])
def test_a_copied_pipeline_routes_its_lora_calls_to_its_own_parts(copier, tmp_path):
    # The LoRA methods amxopt gives a pipeline must act on the pipeline they are read from.
    call = dict(pipelines.wan_call(max_sequence_length=16, output_type="latent"))
    lora = {f"transformer.{k}": v for k, v in _adapter_weights(1).items()}
    pipe = pipelines.build_wan_pipeline(WAN)
    amxopt.optimize(pipe, config=_config(True, tmp_path))
    twin = copier(pipe)
    del pipe
    twin.load_lora_weights(dict(lora), adapter_name="style")
    assert twin.transformer.__dict__["_source"].peft_config.keys() == {"style"}
    eager = pipelines.build_wan_pipeline(WAN)
    eager.load_lora_weights(dict(lora), adapter_name="style")
    runs = [p(**call, generator=torch.Generator().manual_seed(0)).frames for p in (twin, eager)]
    assert max_abs_error(*runs) < 1e-5
    assert type(twin).__name__ == "WanPipeline" and type(twin).__doc__ == type(eager).__doc__
    with pytest.raises(TypeError, match="WanPipeline with optimized parts cannot be pickled"):
        pickle.dumps(twin)


@pytest.mark.parametrize(
    "targets",
    ["all-linear", ["qkv", "q_proj", "v_proj", "linear_fc1"], r".*\.(qkv|q_proj|v_proj|linear_fc1)"],
    ids=["all", "named", "regex"],
)
def test_peft_on_a_whole_model_after_optimize_reaches_the_optimized_tower(targets, tmp_path):
    # get_peft_model walks the whole model's modules: the optimized tower must show its source's
    # layers (peft found none in it, or failed on the graph's holders of packed weights), and a
    # merge_and_unload, which merges and replaces layer after layer, must reach every packing.
    from amxopt import pipelines

    def logits(model, inputs):
        with torch.no_grad():
            return model(**inputs).logits

    def with_lora(model):
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=4, target_modules=targets, init_lora_weights=False)
        return peft.get_peft_model(model, lora).eval()

    for keep_source in (True, False):
        model, eager = pipelines.build_qwen3_vl("tiny"), pipelines.build_qwen3_vl("tiny")
        inputs = pipelines.qwen3_vl_prompt(model, images=[(64, 96)])
        amxopt.optimize(model, config=_config(keep_source, tmp_path))
        logits(model, inputs)  # captured before the adapter comes
        if keep_source:  # what a whole model lists is what the eager one lists
            assert [n for n, _ in model.named_parameters()] == [n for n, _ in eager.named_parameters()]
        if not keep_source and targets != "all-linear":
            with pytest.raises(ValueError, match=r"Target module Module\(\) is not supported"):
                with_lora(model)
            continue
        model = with_lora(model)
        tower = model.base_model.model.model.visual.__dict__["_source"]
        assert any(isinstance(m, peft.tuners.lora.LoraLayer) for m in tower.modules())
        if not keep_source:  # no values to adapt: amxopt says so, or peft fails on a graph's module
            with pytest.raises(RuntimeError, match="is on the meta device.*before amxopt.optimize"):
                logits(model, inputs)
            continue
        eager = with_lora(eager)
        assert max_abs_error(logits(model, inputs), logits(eager, inputs)) < 1e-5
        model, eager = model.merge_and_unload(), eager.merge_and_unload()
        assert max_abs_error(logits(model, inputs), logits(eager, inputs)) < 1e-5
