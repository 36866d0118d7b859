"""Weights from disk: from_pretrained packs as it reads, save/load keep the packed form, bad files are named."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.utils._pytree as pytree
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLVisionModel

import amxopt
from amxopt import models
from amxopt.ops import packed
from amxopt.runtime import loading
from tests.helpers import CONFIG

RELEASE = dataclasses.replace(CONFIG, keep_source=False)
FAMILIES = {"tiny-qwen3-vl-vision": Qwen3VLVisionModel, "tiny-wan": WanTransformer3DModel}


def _leaves(out):
    return pytree.tree_leaves(out)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen")
    models.build_model("tiny-qwen3-vl-vision", torch.bfloat16).save_pretrained(path)
    return path


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_optimize_from_pretrained_and_load_give_identical_outputs(name, dtype, tmp_path, provider):
    config = dataclasses.replace(RELEASE, provider=provider)
    model = models.build_model(name, dtype)
    inputs = models.example_inputs(name, dtype)
    model.save_pretrained(tmp_path / "hf")
    routes = {"optimize": amxopt.optimize(model, config=config)}
    routes["from_pretrained"] = amxopt.from_pretrained(FAMILIES[name], tmp_path / "hf", dtype, config)
    with torch.no_grad():
        outputs = {k: opt(**inputs) for k, opt in routes.items()}
    routes["from_pretrained"].save(tmp_path / "artifact")
    routes["load"] = amxopt.load(tmp_path / "artifact", config)
    with torch.no_grad():
        outputs["load"] = routes["load"](**inputs)
    for route in ("from_pretrained", "load"):
        for a, b in zip(_leaves(outputs[route]), _leaves(outputs["optimize"])):
            assert torch.equal(a, b), f"{name} {dtype}: {route} differs from optimize"
    for route, opt in routes.items():  # one copy of each packed weight: the source holds placeholders
        source = opt.__dict__["_source"]
        linears = [m.weight for m in source.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(w.device.type == "meta" and packed.is_released(w) for w in linears), route


def test_sharded_checkpoint_and_a_missing_shard(tmp_path):
    model = models.build_model("tiny-qwen3-vl-vision")
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    inputs = models.example_inputs("tiny-qwen3-vl-vision")
    opt = amxopt.from_pretrained(Qwen3VLVisionModel, tmp_path, torch.float32, RELEASE)
    with torch.no_grad():
        torch.testing.assert_close(opt(**inputs).pooler_output, model(**inputs).pooler_output)
    (tmp_path / shards[1]).unlink()
    with pytest.raises(amxopt.CheckpointError, match=f"shard {shards[1]} .* is missing"):
        amxopt.from_pretrained(Qwen3VLVisionModel, tmp_path, torch.float32, RELEASE)


def _rewrite(path, edit):
    tensors = load_file(path / "model.safetensors")
    edit(tensors)
    save_file(tensors, path / "model.safetensors")


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.pop("blocks.0.attn.qkv.weight"), r"missing 1 tensor\(s\) \['blocks.0.attn.qkv.weight'\]"),
        (lambda t: t.update(extra=torch.zeros(2)), r"unexpected 1 \['extra'\]"),
        (
            lambda t: t.update({"blocks.0.attn.qkv.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}),
            r"tensor blocks.0.attn.qkv.weight has shape \(3, 3\), the model expects \(192, 64\)",
        ),
        (
            lambda t: t.update({"blocks.0.norm1.weight": torch.zeros(64, dtype=torch.int64)}),
            r"tensor blocks.0.norm1.weight is torch.int64, the model expects torch.bfloat16",
        ),
    ],
    ids=["missing", "unexpected", "shape", "dtype"],
)
def test_bad_checkpoints_name_the_tensor(checkpoint, tmp_path, edit, message):
    for f in checkpoint.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    _rewrite(tmp_path, edit)
    with pytest.raises(amxopt.CheckpointError, match=message):
        amxopt.from_pretrained(Qwen3VLVisionModel, tmp_path, torch.bfloat16, RELEASE)


@pytest.fixture
def artifact(checkpoint, tmp_path):
    opt = amxopt.from_pretrained(Qwen3VLVisionModel, checkpoint, torch.bfloat16, RELEASE)
    return opt.save(tmp_path / "artifact")


def _edit_manifest(directory, **values):
    manifest = json.loads((directory / loading.MANIFEST).read_text())
    manifest.update(values)
    (directory / loading.MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    "values,message",
    [
        (dict(tier="amx9"), "saved for tier 'amx9'"),
        (dict(layout_version=0), "packed layout version 0"),
        (dict(provider="native" if CONFIG.provider == "reference" else "reference"), "saved for provider"),
    ],
)
def test_load_refuses_another_machine_or_layout(artifact, values, message):
    _edit_manifest(artifact, **values)
    with pytest.raises(amxopt.CheckpointError, match=message):
        amxopt.load(artifact, RELEASE)


def test_load_refuses_truncated_or_incomplete_artifacts(artifact):
    weights = artifact / loading.WEIGHTS
    data = weights.read_bytes()
    weights.write_bytes(data[:-100])
    with pytest.raises(amxopt.CheckpointError, match="truncated"):
        amxopt.load(artifact, RELEASE)
    weights.write_bytes(data)
    stored = load_file(weights)
    del stored["packed::blocks.0.attn.qkv.weight"]
    save_file(stored, weights)
    _edit_manifest(artifact, file_bytes=weights.stat().st_size)
    with pytest.raises(amxopt.CheckpointError, match=r"missing 1 tensor\(s\) \['blocks.0.attn.qkv.weight'\]"):
        amxopt.load(artifact, RELEASE)
    (artifact / loading.MANIFEST).write_text("{not json")
    with pytest.raises(amxopt.CheckpointError, match="not an amxopt artifact"):
        amxopt.load(artifact, RELEASE)


def test_save_before_the_first_call_says_why(tmp_path):
    opt = amxopt.optimize(models.build_model("tiny-qwen3-vl-vision"), config=RELEASE)
    with pytest.raises(RuntimeError, match="call it once before save"):
        opt.save(tmp_path / "x")


def test_the_loaded_source_refuses_eager_calls(checkpoint):
    opt = amxopt.from_pretrained(Qwen3VLVisionModel, checkpoint, torch.bfloat16, RELEASE)
    inputs = models.example_inputs("tiny-qwen3-vl-vision", torch.bfloat16)
    with torch.no_grad(), pytest.raises(RuntimeError, match="weights were released"):
        opt.__dict__["_source"](**inputs)
    with torch.no_grad():
        opt(**inputs)  # the optimized module runs on the packed weights


def test_pipeline_from_pretrained_gives_the_same_frames(tmp_path):
    from diffusers import WanPipeline

    from amxopt import pipelines

    call = pipelines.wan_call(max_sequence_length=16)
    pipe = pipelines.build_wan_pipeline("tiny-wan", torch.float32)
    pipe.save_pretrained(tmp_path)  # UMT5 stores its tied embedding once
    expected = pipe(**call, generator=torch.Generator().manual_seed(0)).frames
    loaded = amxopt.from_pretrained(WanPipeline, tmp_path, torch.float32, RELEASE)
    assert sorted(loaded.amxopt_report.optimized) == ["text_encoder", "transformer"]
    assert packed.is_released(loaded.transformer.__dict__["_source"].blocks[0].ffn.net[2].weight)
    torch.testing.assert_close(loaded(**call, generator=torch.Generator().manual_seed(0)).frames, expected)


def test_save_and_load_a_model_with_tied_weights(tmp_path):
    from amxopt import pipelines

    encoder = pipelines.build_wan_pipeline("tiny-wan", torch.float32).text_encoder  # UMT5: shared == embed_tokens
    ids = torch.tensor([[3, 4, 5, 1, 0, 0]])
    mask = (ids > 0).long()
    with torch.no_grad():
        expected = encoder(ids, mask).last_hidden_state
    amxopt.optimize(encoder, (ids, mask), RELEASE).save(tmp_path)
    manifest = json.loads((tmp_path / loading.MANIFEST).read_text())
    assert manifest["tensors"]["encoder.embed_tokens.weight"]["tied_to"] == "shared.weight"
    with torch.no_grad():
        torch.testing.assert_close(amxopt.load(tmp_path, RELEASE)(ids, mask).last_hidden_state, expected)
