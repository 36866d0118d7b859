"""Bad input gets a clear error naming the model/op and the offending value; never a wrong answer."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

import pytest
import torch
from torch import nn

import amxopt
from amxopt import models
from amxopt.capture import base
from tests.helpers import CONFIG


@pytest.fixture(scope="module")
def qwen():
    name = "tiny-qwen3-vl-vision"
    model = models.build_model(name)
    inputs = models.example_inputs(name)
    return model, inputs, amxopt.optimize(model, inputs, CONFIG)


def test_another_input_dtype_runs_as_eager_runs_it(qwen):
    # Qwen's patch embedding casts its input to the weights' dtype: bf16 pixels into an fp32 tower
    # are not bad input (they were refused). One eager cannot take is: test_module_use.py.
    # Integer pixels too (they were refused as not float).
    _, inputs, opt = qwen
    for pixels in (inputs["hidden_states"].bfloat16(), (inputs["hidden_states"] * 10).long()):
        with torch.no_grad():
            got = opt(pixels, inputs["grid_thw"]).last_hidden_state
            want = models.build_model("tiny-qwen3-vl-vision")(pixels, inputs["grid_thw"]).last_hidden_state
        torch.testing.assert_close(got, want)


def test_grid_thw_not_matching_patches(qwen):
    _, inputs, opt = qwen
    grid = inputs["grid_thw"].clone()
    grid[0, 1] += 2
    with pytest.raises(ValueError, match=r"grid_thw .* describes \d+ patches but hidden_states has \d+ rows"):
        opt(inputs["hidden_states"], grid)


def test_grid_thw_not_divisible_by_merge(qwen):
    _, inputs, opt = qwen
    n = inputs["hidden_states"].shape[0]
    with pytest.raises(ValueError, match="spatial merge size 2"):
        opt(inputs["hidden_states"], torch.tensor([[1, 1, n]]))


def test_wrong_patch_width(qwen):
    _, inputs, opt = qwen
    with pytest.raises(ValueError, match=r"hidden_states must be real \[num_patches, 1536\]"):
        opt(inputs["hidden_states"][:, :100], inputs["grid_thw"])


def test_precomputed_vision_metadata_is_used_as_eager_uses_it(qwen):
    # transformers' vision_utils: the tower takes cu_seqlens, position_ids and the interpolation
    # taps precomputed (the whole model forwards image_cu_seqlens etc. as these). They were refused.
    # Ones that differ from what grid_thw gives show that the caller's are the ones used.
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    model, _, opt = qwen
    # two images: one segment over both differs from grid_thw's two
    inputs = models.example_inputs("tiny-qwen3-vl-vision", size=[(64, 64), (32, 64)])
    x, grid = inputs["hidden_states"], inputs["grid_thw"]
    n = x.shape[0]
    side = model.config.num_position_embeddings**0.5
    indices, weights = get_vision_interpolation_indices_and_weights(grid, num_grid_per_side=int(side))
    cases = {
        "cu_seqlens": {"cu_seqlens": get_vision_cu_seqlens(grid)[[0, -1]], "max_seqlen": n},
        "position_ids": {"position_ids": get_vision_position_ids(grid, 2).flip(0)},
        "interpolation taps": {"interp_indices": indices, "interp_weights": weights.flip(-1)},
    }
    with torch.no_grad():
        plain = opt(x, grid)
        torch.testing.assert_close(plain.last_hidden_state, model(x, grid).last_hidden_state)
        for case, given in cases.items():
            want, got = model(x, grid, **given), opt(x, grid, **given)
            torch.testing.assert_close(got.last_hidden_state, want.last_hidden_state, msg=case)
            torch.testing.assert_close(got.pooler_output, want.pooler_output, msg=case)
            assert not torch.allclose(plain.last_hidden_state, want.last_hidden_state), case
        # passed as None: computed from grid_thw, as eager does (a keyword given is not a value given)
        none = dict.fromkeys(("cu_seqlens", "position_ids", "max_seqlen", "interp_indices", "interp_weights"))
        torch.testing.assert_close(opt(x, grid, **none).last_hidden_state, plain.last_hidden_state)
    with pytest.raises(ValueError, match=rf"a precomputed position_ids must have one row per patch \({n}\)"):
        opt(x, grid, position_ids=cases["position_ids"]["position_ids"][:-4])
    with pytest.raises(ValueError, match=rf"a precomputed cu_seqlens must be integer offsets from 0 to the {n}"):
        opt(x, grid, cu_seqlens=torch.tensor([0, n - 4], dtype=torch.int32))


def test_audio_lengths_not_matching_features():
    name = "tiny-qwen3-omni-audio"
    model = models.build_model(name)
    inputs = models.example_inputs(name)
    opt = amxopt.optimize(model, inputs, CONFIG)
    with pytest.raises(ValueError, match=r"feature_lens \[\d+\] sum to \d+ frames but input_features has"):
        opt(inputs["input_features"], inputs["feature_lens"] + 5)


def test_wan_latent_shape_checked():
    name = "tiny-wan"
    model = models.build_model(name)
    inputs = models.example_inputs(name)
    opt = amxopt.optimize(model, inputs, CONFIG)
    bad = dict(inputs, hidden_states=inputs["hidden_states"][..., :7])
    with pytest.raises(
        ValueError, match=r"WanTransformer3DModel: latent .* not divisible by the patch size.*drops the"
    ):
        opt(**bad)
    three = dict(
        inputs,
        hidden_states=torch.cat([inputs["hidden_states"]] * 3),
        encoder_hidden_states=torch.cat([inputs["encoder_hidden_states"]] * 2),
    )
    with pytest.raises(ValueError, match=r"encoder_hidden_states .* for a batch of 2, hidden_states .* for 3"):
        opt(**three)
    x, text = inputs["hidden_states"], inputs["encoder_hidden_states"]
    # Each met only deep inside export ("too many values to unpack", a shape mismatch in a matmul).
    for bad, message in (
        (
            {"hidden_states": x[..., None]},
            r"hidden_states must be latents \[B, 16, F, H, W\], got .*\[1, 16, 2, 8, 8, 1\]",
        ),
        ({"hidden_states": x[:, :15]}, r"hidden_states must be latents \[B, 16, F, H, W\], got .*\[1, 15, "),
        (
            {"encoder_hidden_states": text[..., :32]},
            r"encoder_hidden_states must be \[B, L, 64\], got .*\[1, \d+, 32\]",
        ),
    ):
        with pytest.raises(ValueError, match=r"WanTransformer3DModel: " + message):
            opt(**{**inputs, **bad})


def test_one_prompt_for_a_batch_of_wan_latents_is_broadcast_as_eager_does():
    # It was refused ("give each latent its own text embeddings").
    name = "tiny-wan"
    model = models.build_model(name)
    inputs = models.example_inputs(name)
    opt = amxopt.optimize(model, inputs, CONFIG)
    two = dict(inputs, hidden_states=torch.cat([inputs["hidden_states"], -inputs["hidden_states"]]))
    with torch.no_grad():
        got = opt(**two, return_dict=False)[0]
        want = model(**dict(two, encoder_hidden_states=inputs["encoder_hidden_states"].expand(2, -1, -1)))[0]
    torch.testing.assert_close(got, want)


def test_a_qwen_tower_in_float16_is_refused_by_optimize_with_the_cast_to_make():
    # Refused before anything is replaced, with or without example inputs, alone or in a whole model:
    # the replaced tower failed every call, and the cast its error advised was refused on it.
    from amxopt import pipelines

    cast = r"is in torch.float16, and amxopt's attention takes float32 or bfloat16: cast the model \(model.to"
    model = models.build_model("tiny-qwen3-vl-vision", torch.float16)
    for inputs in (models.example_inputs("tiny-qwen3-vl-vision", torch.float16), None):
        with pytest.raises(ValueError, match=r"amxopt: Qwen3VLVisionModel " + cast):
            amxopt.optimize(model, inputs, CONFIG)
    whole = pipelines.build_qwen3_vl("tiny", torch.float16)
    with pytest.raises(ValueError, match=r"amxopt: model.visual: Qwen3VLVisionModel " + cast):
        amxopt.optimize(whole, config=CONFIG)
    assert type(whole.model.visual).__name__ == "Qwen3VLVisionModel" and not hasattr(whole, "amxopt_report")
    opt = amxopt.optimize(whole.to(torch.bfloat16), config=CONFIG)  # the advice can be followed
    assert "model.visual" in opt.amxopt_report.optimized


class DataDependent(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        # Python control flow on a tensor's value: torch.export cannot capture this as one graph.
        steps = int(x.abs().sum().item() * 3) % 4
        for _ in range(steps):
            x = self.fc(x)
        return x if x.sum() > 0 else -x


class Refusing(nn.Linear):
    def forward(self, x):
        raise ValueError("Refusing takes nothing")


def test_model_without_capturable_graph():
    with pytest.raises(amxopt.CaptureError, match=r"could not capture DataDependent"):
        amxopt.optimize(DataDependent().eval(), (torch.randn(2, 4),), CONFIG)
    # the dynamic and the static export failing alike: the cause said once
    with pytest.raises(amxopt.CaptureError, match=r"\): dynamic and static: ValueError: Refusing takes nothing$"):
        amxopt.optimize(Refusing(4, 4).eval(), (torch.randn(2, 4),), CONFIG)


def test_training_mode_refused():
    with pytest.raises(ValueError, match="training mode"):
        amxopt.optimize(nn.Linear(4, 4), (torch.randn(2, 4),), CONFIG)


def test_unknown_provider_and_pass():
    model = nn.Linear(4, 4).eval()
    with pytest.raises(ValueError, match="unknown provider 'amx9000'"):
        amxopt.optimize(model, (torch.randn(2, 4),), amxopt.AmxConfig(provider="amx9000"))
    with pytest.raises(ValueError, match="unknown passes"):
        amxopt.optimize(model, (torch.randn(2, 4),), amxopt.AmxConfig(passes=("fold_everything",)))


CORES = "None, 'none' or one entry of cores per rank, such as ('0-3', '4-7')"


@pytest.mark.parametrize(
    "field, value, wants",
    [
        (
            "passes",
            "replace_linear",
            "a sequence of pass names, such as ('replace_linear',)",
        ),  # a string is not a list of passes
        ("max_recaptures", 0, "an int >= 1"),
        ("tp", 0, "a positive int or 'env'"),
        ("tp", True, "a positive int or 'env'"),
        ("tp_timeout_s", -5, "a finite number of seconds > 0"),
        ("tp_timeout_s", True, "a finite number of seconds > 0"),  # bool is an int, not a duration
        ("tp_timeout_s", float("inf"), "a finite number of seconds > 0"),  # timedelta overflows
        ("autotune_cache", 5, "None or a directory path"),
        ("cpu_bind", 5, CORES),
        ("cpu_bind", "0-3", CORES),
        ("cpu_bind", ("0-3", "four"), CORES),
        ("dynamic", "no", "True or False"),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused_by_field(field, value, wants):
    with pytest.raises(
        ValueError, match=rf"AmxConfig\.{field} must be {re.escape(wants)}, got {re.escape(repr(value))}"
    ):
        amxopt.AmxConfig(**{field: value})
    assert amxopt.AmxConfig(passes=["replace_linear"]).passes == ("replace_linear",)
    for cpu_bind in (None, "none", ("0-3, 8", "4-7"), [[0, 1], (2,)], (0, 1), [range(0, 2), {2, 3}], [["0"], ["1"]]):
        assert amxopt.AmxConfig(cpu_bind=cpu_bind).cpu_bind == cpu_bind
    assert amxopt.AmxConfig(autotune_cache=pathlib.Path("/tmp/x")).cache_dir() == pathlib.Path("/tmp/x")


def test_vision_tower_without_adapter_says_why_it_cannot_be_captured(capfd):
    # Qwen2.5-VL's tower builds its window/segment metadata from grid_thw values inside forward.
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    config = Qwen2_5_VLVisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=32)
    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(config, attn_implementation="sdpa").eval()
    inputs = {"hidden_states": torch.randn(64, 3 * 2 * 14 * 14), "grid_thw": torch.tensor([[1, 8, 8]])}
    with pytest.raises(amxopt.CaptureError, match="Qwen2_5_VisionTransformerPretrainedModel.*adapter must compute"):
        amxopt.optimize(model, inputs, CONFIG)
    # torch.export printed its partial graph at each failed export: 8 copies of it came before the error
    assert "def forward" not in capfd.readouterr().err


class _Says(nn.Module):
    def forward(self, x):
        print("a word from forward", file=sys.stderr)
        return x * 2


def test_what_a_traced_forward_writes_to_stderr_is_kept(capfd, monkeypatch):
    amxopt.optimize(_Says().eval(), (torch.randn(2, 4),), CONFIG)
    assert "a word from forward" in capfd.readouterr().err
    # Held by another thread's trace meanwhile: written through once that trace ends (a second
    # thread's swap put the first one's buffer back for good, and stderr was lost)
    stream = sys.stderr
    with base._without_partial_graphs():
        print("held", file=sys.stderr)
        with base._without_partial_graphs():  # (as another thread's trace: the hold is taken)
            print("the other's", file=sys.stderr)
        saved = sys.stderr  # (as contextlib.redirect_stderr would, and puts back after the trace ended)
    assert sys.stderr is stream
    print("after", file=saved)
    assert capfd.readouterr().err.split() == ["held", "the", "other's", "after"]
    monkeypatch.setattr(sys, "stderr", None)  # (python 2>&-): every capture failed on its write
    amxopt.optimize(_Says().eval(), (torch.randn(2, 4),), dataclasses.replace(CONFIG, isolate_capture=False))


def test_misspelt_config_key_is_named():
    # a config object takes any attribute, so a misspelt override would build the unchanged model
    with pytest.raises(KeyError, match=r"tiny-qwen3-vl-vision.*Qwen3VLVisionConfig has no 'depht'"):
        models.build_model("tiny-qwen3-vl-vision", depht=1)
    assert len(models.build_model("tiny-qwen3-vl-vision", depth=1).blocks) == 1


def test_a_capture_failing_in_a_hook_names_the_hook():
    # A cache hook (diffusers' enable_cache after a first call) decides from tensor values: the
    # message pointed at amxopt's adapters, not at the hook.
    model = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8)).eval()

    def skip_when_small(module, args):
        return (args[0] * 2,) if bool(args[0].sum() > 0) else None

    model[2].register_forward_pre_hook(skip_when_small)
    with pytest.raises(amxopt.CaptureError, match=r"Forward hooks or replaced forwards on 2 are traced with the model"):
        amxopt.optimize(model, (torch.randn(4, 8),), CONFIG)
