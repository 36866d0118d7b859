"""Rewritten graphs as data: the on-disk graph cache and the graphs saved in an artifact."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import logging
import operator
import os
import subprocess
import sys

import pytest
import torch
import torch.utils._pytree as pytree
from hypothesis import given
from hypothesis import strategies as st

import amxopt
from amxopt import models
from amxopt.capture import prepare
from amxopt.capture.base import export
from amxopt.ops import native
from amxopt.runtime import graph_store, weights
from amxopt.runtime import module as runtime_module
from tests.helpers import CONFIG

FAMILIES = ("tiny-qwen3-vl-vision", "tiny-qwen3-omni-vision", "tiny-qwen3-omni-audio", "tiny-wan")
RESTORED = "graph restored from the graph cache"


def _equal(a, b) -> bool:
    la, lb = pytree.tree_leaves(a), pytree.tree_leaves(b)
    return len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb))


@pytest.mark.parametrize("name, provider", [(n, "reference") for n in FAMILIES] + [("tiny-qwen3-vl-vision", "auto")])
def test_a_cached_graph_restored_on_other_weights_equals_a_fresh_capture(name, provider, tmp_path):
    config = dataclasses.replace(CONFIG, provider=provider, autotune_cache=str(tmp_path))
    inputs = models.example_inputs(name, torch.float32)
    first = amxopt.optimize(models.build_model(name, torch.float32, seed=0), inputs, config)
    assert not any(RESTORED in n for n in first.report.notes)
    model = models.build_model(name, torch.float32, seed=1)  # same structure, other weights
    restored = amxopt.optimize(model, inputs, config)
    fresh = amxopt.optimize(model, inputs, dataclasses.replace(config, graph_cache=False))
    origins = [n for n in restored.report.notes if n.startswith("graph restored from ")]
    assert len(origins) == 1 and RESTORED in origins[0], restored.report.notes  # not also the capture child's
    assert restored.report.counts() == fresh.report.counts()
    with torch.no_grad():
        got, want = restored(**inputs), fresh(**inputs)
    assert type(got) is type(want)
    assert _equal(got, want), f"{name}: the restored graph differs from a fresh capture"


def test_a_restored_dynamic_graph_takes_other_sizes(tmp_path):
    name = "tiny-qwen3-vl-vision"
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path))
    model = models.build_model(name, torch.float32)
    amxopt.optimize(model, models.example_inputs(name, torch.float32), config)
    restored = amxopt.optimize(model, models.example_inputs(name, torch.float32), config)
    other = models.example_inputs(name, torch.float32, size=[(64, 96), (32, 32)])
    with torch.no_grad():
        got, want = restored(**other), model(**other)
    assert len(restored.graphs) == 1  # the restored graph's guards accepted the new sizes
    for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want), strict=True):
        torch.testing.assert_close(a, b)


@pytest.fixture(scope="module")
def qwen_capture():
    model = models.build_model("tiny-qwen3-vl-vision", torch.float32)
    adapter, graph_inputs = prepare(model, models.example_inputs("tiny-qwen3-vl-vision", torch.float32))
    return export(model, adapter, graph_inputs, dynamic=True), graph_inputs


def _accepts(check, graph_inputs) -> bool:
    try:
        check(*pytree.tree_leaves(graph_inputs))
    except AssertionError:
        return False
    return True


@given(rows=st.integers(1, 96), width=st.sampled_from([1536, 1535]), skew=st.sampled_from([None, "position_ids"]))
def test_stored_guards_decide_like_exports(qwen_capture, rows, width, skew):
    # The tower's inputs are grouped by merge window ([N, 4, ...]); 2-D ones failed both checks on rank alone.
    captured, example = qwen_capture
    inputs = {
        "hidden_states": torch.zeros(rows, 4, width),
        "cu_seqlens": example["cu_seqlens"],
        "position_ids": torch.zeros(rows + (skew == "position_ids"), 4, 2, dtype=torch.long),
        "interp_indices": torch.zeros(rows, 4, 4, dtype=torch.long),
        "interp_weights": torch.zeros(rows, 4, 4),
    }
    assert {k: v.dim() for k, v in inputs.items()} == {k: v.dim() for k, v in example.items()}
    stored = graph_store.GuardCheck(captured.guard_code)
    accepted = _accepts(captured.guards, inputs)
    assert _accepts(stored, inputs) == accepted, inputs["hidden_states"].shape
    assert accepted == (width == 1536 and skew is None)  # what decides, so that the comparison can fail


@pytest.mark.parametrize(
    "code",
    [
        "__import__('os').system('true')",
        "args[0].numpy()",
        "args[0].size()[0] == 'x'",
        "(lambda: 1)() == 1",
        # parsed, then raised in the evaluator as optimize() ran (helper review, stop 61)
        "args[0].size(0) >= 1",
        "args[0].dim >= 1",
        "args[0].size()[0](1) >= 1",
        "max(1, key=abs) == 1",
    ],
)
def test_a_guard_outside_the_vocabulary_is_refused(code):
    with pytest.raises(graph_store.GraphStoreError, match="outside what amxopt evaluates"):
        graph_store.GuardCheck([code])


@pytest.mark.parametrize("size, ok", [(1, False), (2, True), (4, True), (8, False)])
def test_a_chained_comparison_holds_each_link(size, ok):
    # (mutant: each link compared with the chain's first value, accepting 8 under 2 <= s <= 4)
    check = graph_store.GuardCheck(["2 <= args[0].size()[0] <= 4"])
    if ok:
        check(torch.zeros(size))
    else:
        with pytest.raises(AssertionError, match="Guard failed"):
            check(torch.zeros(size))


def test_a_guard_that_raises_as_it_is_evaluated_fails_as_a_guard():
    # A damaged entry's division by zero ended optimize() (helper review, stop 61): the graph rejects the call.
    with pytest.raises(AssertionError, match="Guard failed"):
        graph_store.GuardCheck(["args[0].size()[0] // 0 >= 0"])(torch.zeros(2))


@pytest.mark.parametrize("code", ["args[0].size()[0] ==", "args[0]\x00"])
def test_a_guard_that_does_not_parse_is_refused_as_damage(code):
    # A SyntaxError escaped read_cache and ended optimize(): a damaged entry is captured again.
    with pytest.raises(graph_store.GraphStoreError, match="is not an expression"):
        graph_store.GuardCheck([code])


def _cache_entry(tmp_path) -> tuple:
    name = "tiny-qwen3-omni-audio"
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path))
    model = models.build_model(name, torch.float32)
    inputs = models.example_inputs(name, torch.float32)
    amxopt.optimize(model, inputs, config)
    (path,) = (tmp_path / "graphs").glob("*.json")
    return model, inputs, config, path


def _exported(model, inputs):
    return prepare(model, inputs)[0].export_module(model)


def test_a_stored_graph_naming_a_foreign_function_is_refused_and_recaptured(tmp_path, caplog):
    model, inputs, config, path = _cache_entry(tmp_path)
    entry = json.loads(path.read_text())
    node = next(n for n in entry["nodes"] if n[0] == "call_function")
    node[2] = "builtins.eval"
    path.write_text(json.dumps(entry))
    with pytest.raises(graph_store.GraphStoreError, match="builtins.eval"):
        graph_store.restore(entry, _exported(model, inputs), "reference", {}, "a test")
    with caplog.at_level(logging.WARNING):
        opt = amxopt.optimize(model, inputs, config)
    assert "unusable" in caplog.text and "builtins.eval" in caplog.text
    assert not any(RESTORED in n for n in opt.report.notes)  # captured again, and it runs
    with torch.no_grad():
        assert _equal(
            opt(**inputs), amxopt.optimize(model, inputs, dataclasses.replace(config, graph_cache=False))(**inputs)
        )


@pytest.mark.parametrize("content", ["[]", "null", '{"nodes": 3}'])
def test_a_cached_graph_of_valid_json_and_another_shape_is_captured_again(tmp_path, content, caplog):
    model, inputs, config, path = _cache_entry(tmp_path)
    path.write_text(content)
    with caplog.at_level(logging.WARNING):
        opt = amxopt.optimize(model, inputs, config)
    assert "unusable" in caplog.text
    assert not any(RESTORED in n for n in opt.report.notes)


def test_the_cache_drops_its_least_recently_used_entries_over_its_limit(tmp_path):
    for i, stem in enumerate(["a.1", "b.1", "c.1"]):
        (tmp_path / f"{stem}.json").write_bytes(b"x" * 100)
        (tmp_path / f"{stem}.safetensors").write_bytes(b"x" * 400)
        os.utime(tmp_path / f"{stem}.json", (1000 + i, 1000 + i))
        os.utime(tmp_path / f"{stem}.safetensors", (1000 + i, 1000 + i))
    os.utime(tmp_path / "a.1.json")  # a restored entry: used just now
    graph_store._prune(tmp_path, keep="c.1", limit=1000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.1.json", "a.1.safetensors", "c.1.json", "c.1.safetensors"]


def test_the_cache_keeps_the_entry_just_written_and_files_being_written(tmp_path):
    # An entry alone over the limit is kept (it was just written, and is about to be read); another
    # writer's temporary file (replacing() writes ".{name}.{random}.tmp" beside it) is not an entry.
    for i, stem in enumerate(["a.1", "b.1"]):
        for suffix, size in ((".json", 100), (".safetensors", 400)):
            (tmp_path / f"{stem}{suffix}").write_bytes(b"x" * size)
            os.utime(tmp_path / f"{stem}{suffix}", (1000 + i, 1000 + i))
    writing = tmp_path / ".c.1.safetensors.k3j9.tmp"
    writing.write_bytes(b"x" * 4000)
    os.utime(writing, (900, 900))
    graph_store._prune(tmp_path, keep="a.1", limit=100)
    assert sorted(p.name for p in tmp_path.iterdir()) == [writing.name, "a.1.json", "a.1.safetensors"]


def test_a_stored_graph_on_a_model_of_another_shape_is_refused(tmp_path):
    model, inputs, _, path = _cache_entry(tmp_path)
    entry = json.loads(path.read_text())
    config = models.ZOO["tiny-qwen3-omni-audio"].config()
    config.d_model *= 2
    wider = type(model)(config).eval()
    with pytest.raises(graph_store.GraphStoreError, match="the stored graph reads"):
        graph_store.restore(entry, _exported(wider, inputs), "reference", {}, "a test")


def test_a_model_with_a_weight_on_the_meta_device_is_refused_though_the_cache_holds_its_graph(tmp_path):
    # The key holds shapes and dtypes, not devices: a cached graph packed the meta weight (no values)
    # and every call returned garbage (NaN), where a capture refuses the model.
    model, inputs, config, path = _cache_entry(tmp_path)
    linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    linear.weight = torch.nn.Parameter(torch.empty_like(linear.weight, device="meta"))  # offloaded
    with pytest.raises(graph_store.GraphStoreError, match=r"weight is on the meta device: no values to pack"):
        graph_store.restore(json.loads(path.read_text()), _exported(model, inputs), "reference", {}, "a test")
    with pytest.raises(RuntimeError, match=r"weight is on the meta device.*init_empty_weights, or offloaded"):
        amxopt.optimize(model, inputs, config)


def test_cache_key_follows_structure_and_options_not_weights():
    name = "tiny-wan"
    a, b = (models.build_model(name, torch.float32, seed=s) for s in (0, 1))
    inputs = models.example_inputs(name, torch.float32)
    adapter, graph_inputs = prepare(a, inputs)

    def key(model, config=CONFIG, graph_inputs=graph_inputs):
        return graph_store.cache_key(model, adapter.name, graph_inputs, config)

    assert key(a) == key(b)
    assert key(a) != key(a, dataclasses.replace(CONFIG, fuse_activation=False))
    assert key(a) != key(a.to(torch.bfloat16))
    assert key(b) != key(b, graph_inputs={**graph_inputs, "timestep": graph_inputs["timestep"].float()[:, None]})
    # A graph autotune chose for at one thread count is not restored at another.
    tuned = dataclasses.replace(CONFIG, autotune=True, provider="native")
    threads = torch.get_num_threads()
    try:
        at_two, untuned = key(a, tuned), key(a)
        torch.set_num_threads(threads + 1)
        assert key(a, tuned) != at_two and key(a) == untuned
    finally:
        torch.set_num_threads(threads)
    # Every option but where the caches live: a config without a pass must not get the graph
    # the passes rewrote (an A/B baseline), nor one without fusions a fused graph.
    other = {bool: lambda v: not v, int: lambda v: v + 1, float: lambda v: v / 2}
    values = {"provider": "native", "passes": (), "tp": "env", "cpu_bind": "none", "tp_group": "g"}
    for f in dataclasses.fields(CONFIG):
        if f.name not in ("autotune_cache", "graph_cache"):
            v = getattr(CONFIG, f.name)
            changed = values[f.name] if f.name in values else other[type(v)](v)
            assert key(a) != key(a, dataclasses.replace(CONFIG, **{f.name: changed})), f.name
    # A released weight (amxopt.from_pretrained packs them as it reads them): a graph optimize()
    # stored may read it unpacked where autotune left its Linear to ATen ("unusable", a warning).
    proj, before = b.blocks[0].attn1.to_q, key(b)
    proj.weight = weights.placeholder(proj.weight, {})
    assert key(b) != before


def test_cache_key_follows_amxopts_code_the_libraries_the_cpu_and_the_tier(monkeypatch):
    name = "tiny-qwen3-vl-vision"
    model = models.build_model(name, torch.float32)
    adapter, graph_inputs = prepare(model, models.example_inputs(name, torch.float32))
    native_config = dataclasses.replace(CONFIG, provider="native")

    def key(config=CONFIG):
        return graph_store.cache_key(model, adapter.name, graph_inputs, config)

    auto_config = dataclasses.replace(CONFIG, provider="auto")
    before, native_before, auto_before = key(), key(native_config), key(auto_config)
    versions = graph_store._versions()
    for target, value in [
        ("code_hash", lambda: "another amxopt"),
        ("_versions", lambda: {**versions, "torch": "2.14.0"}),
        ("_versions", lambda: {**versions, "transformers": "6.0.0"}),
    ]:
        with monkeypatch.context() as m:
            m.setattr(graph_store, target, value)
            assert key() != before, target
    with monkeypatch.context() as m:
        m.setattr(native, "cpu_model", lambda: "another CPU")
        assert key() != before
    tier = native.active_tier()
    with monkeypatch.context() as m:
        m.setattr(native, "active_tier", lambda: "fp32" if tier != "fp32" else "amx")
        assert key(native_config) != native_before and key() == before  # (the reference has no tier)
        assert key(auto_config) != auto_before  # (auto runs the native kernels here)
    with native.use_amx_schedule("rows"):  # a schedule pinned for the process
        assert key(native_config) != native_before


class _BothWays(torch.nn.Module):
    """A weight packed as it is and transposed: the transposed packing is a constant of the graph."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(48, 48) / 7)

    def forward(self, x):
        return torch.nn.functional.linear(torch.nn.functional.linear(x, self.w), self.w.t())


class _SizeBranch(torch.nn.Module):
    """A branch on a dynamic size whose guard export writes with ``and``."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        n = x.shape[0]
        if (n != 4) & (n != 6):
            return self.fc(x) * 2
        return self.fc(x)


@pytest.mark.parametrize("isolate", [True, False])
def test_a_graph_packing_a_transformed_weight_is_not_served_to_other_weights(tmp_path, isolate):
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path), isolate_capture=isolate)
    x = torch.randn(8, 48)
    for seed in (0, 1):
        torch.manual_seed(seed)
        model = _BothWays().eval()
        opt = amxopt.optimize(model, (x,), config)
        assert not any(RESTORED in n for n in opt.report.notes)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


@pytest.mark.parametrize("isolate", [True, False])
def test_a_restored_graph_keeps_a_guard_of_two_conditions(tmp_path, isolate):
    # Captured at 5 rows (the doubling branch), the graph's guard is "n != 4 and n != 6": 4 rows
    # must be captured again, also once the graph comes from the cache.
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path), isolate_capture=isolate)
    torch.manual_seed(0)
    model = _SizeBranch().eval()
    for restored in (False, True):
        opt = amxopt.optimize(model, (torch.randn(5, 8),), config)
        assert any(RESTORED in n for n in opt.report.notes) == restored
        assert any(" and " in line for line in opt._graphs[0].captured.guard_code)
        x = torch.randn(4, 8)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
        assert len(opt.graphs) == 2


class _Width(torch.nn.Module):
    """A forward that reads a one-element tensor attribute as a Python number: export bakes it in."""

    def __init__(self, width: int):
        super().__init__()
        self.fc, self.width = torch.nn.Linear(8, 8), torch.tensor(width)

    def forward(self, x):
        return self.fc(x)[:, : int(self.width)]


def test_a_small_tensor_attribute_read_as_a_number_is_in_the_cache_key(tmp_path):
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path))
    x = torch.randn(3, 8)
    for width, restored in ((4, False), (4, True), (8, False)):
        for path in (tmp_path / "graphs").glob("*.json"):
            os.utime(path, (1000, 1000))
        model = _Width(width).eval()
        opt = amxopt.optimize(model, (x,), config)
        assert any(RESTORED in n for n in opt.report.notes) == restored
        if restored:  # a restore is a use, which pruning goes by
            assert [p.stat().st_mtime > 1000 for p in (tmp_path / "graphs").glob("*.json")] == [True]
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


_KEY_OF_TINY_MODELS = """
import torch
from amxopt import models
from amxopt.capture import prepare
from amxopt.runtime import graph_store
from tests.helpers import CONFIG
for name in ("tiny-wan", "tiny-qwen3-vl-vision"):
    model = models.build_model(name, torch.bfloat16)
    adapter, graph_inputs = prepare(model, models.example_inputs(name, torch.bfloat16))
    print(graph_store.cache_key(adapter.export_module(model), adapter.name, graph_inputs, CONFIG))
"""


@pytest.mark.parametrize("name", ["tiny-wan", "tiny-qwen3-vl-vision"])
def test_cache_key_of_a_model_loaded_from_a_directory_is_that_of_the_model_built_in_code(name, tmp_path):
    # The loaders set bookkeeping attributes on every module (_is_hf_initialized, ...) and read
    # tuples back from JSON as lists: neither is what the model computes.
    built = models.build_model(name, torch.float32)
    built.save_pretrained(tmp_path)
    loaded = type(built).from_pretrained(tmp_path).eval()
    inputs = models.example_inputs(name, torch.float32)
    keys = []
    for model in (models.build_model(name, torch.float32), built, loaded):  # save_pretrained edits built's config
        adapter, graph_inputs = prepare(model, inputs)
        keys.append(graph_store.cache_key(adapter.export_module(model), adapter.name, graph_inputs, CONFIG))
    assert keys[0] == keys[1] == keys[2]


def test_cache_key_is_the_same_in_another_process():
    # A process's string hashes order its sets (diffusers keeps one in the config it stores).
    keys = [
        subprocess.run(
            [sys.executable, "-c", _KEY_OF_TINY_MODELS],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        for seed in ("1", "2")
    ]
    assert keys[0] == keys[1] and len(keys[0]) == 2


class _Scaled(torch.nn.Module):
    """A constant the forward reads from a Python attribute: not in repr, config or state_dict."""

    def __init__(self, k: float):
        super().__init__()
        self.fc, self.k = torch.nn.Linear(8, 8), k

    def forward(self, x):
        return self.fc(x) * self.k


def _defined(body: str):
    """A model class defined without a source file (a notebook cell), forward ``body``."""
    scope = {"torch": torch}
    exec(
        "class Net(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.fc = torch.nn.Linear(8, 8)\n"
        f"    def forward(self, x):\n        return {body}\n",
        scope,
    )
    return scope["Net"]()


def test_cache_key_follows_settings_code_and_training_and_hooks_turn_it_off():
    graph_inputs = {"x": torch.randn(2, 8)}

    def key(model):
        return graph_store.cache_key(model, "plain", graph_inputs, CONFIG)

    assert key(_Scaled(2.0)) == key(_Scaled(2.0)) and key(_Scaled(2.0)) != key(_Scaled(3.0))
    assert key(_defined("torch.relu(self.fc(x))")) != key(_defined("torch.sigmoid(self.fc(x))"))
    model = _Scaled(2.0)
    model.fc.train(False)
    assert key(model) != key(_Scaled(2.0))
    handle = model.fc.register_forward_hook(lambda m, i, o: o * 3)
    assert key(model) is None  # what a hook computes cannot be told from its name
    handle.remove()
    assert key(model) is not None


class _Held(torch.nn.Module):
    """An activation the forward calls through ``self.act``: not a registered submodule of the model."""

    def __init__(self, act):
        super().__init__()
        self.fc, self.act = torch.nn.Linear(8, 8), act

    def forward(self, x):
        act = self.act[0] if isinstance(self.act, tuple) else self.act
        return act(self.fc(x))


class _Config:
    def __init__(self, inner=None, slope=0.01):
        self.inner, self.slope = inner, slope

    def leaky(self, x):
        return torch.nn.functional.leaky_relu(x, self.slope)


def _nested(slope: float, depth: int) -> _Config:
    config = _Config(slope=slope)
    for _ in range(depth):
        config = _Config(config)
    return config


class _NestedSlope(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.fc, self.config = torch.nn.Linear(8, 8), config

    def forward(self, x):
        config = self.config
        while config.inner is not None:
            config = config.inner
        return torch.nn.functional.leaky_relu(self.fc(x), config.slope)


def test_cache_key_follows_what_a_setting_holds_or_is_not_made():
    # Each keyed by its type alone, and served another model's graph: a module in a tuple (its slope,
    # or its weights lifted into the cached entry), the object a method is bound to, an object of C
    # code, a config nested deeper than the key looked, torch's default dtype (0.88 to 3.5 off eager).
    graph_inputs = {"x": torch.randn(2, 8)}

    def key(model):
        return graph_store.cache_key(model, "plain", graph_inputs, CONFIG)

    assert key(_Held((torch.nn.LeakyReLU(0.01),))) is None  # its weights, were it a Linear: not a key's
    assert key(_Held(torch.nn.LeakyReLU(0.01).forward)) is None
    assert key(_Held(_Config(slope=0.01).leaky)) != key(_Held(_Config(slope=0.5).leaky))
    assert key(_Held(operator.itemgetter(0))) != key(_Held(operator.itemgetter(1)))
    assert key(_NestedSlope(_nested(0.01, 3))) != key(_NestedSlope(_nested(0.5, 3)))
    assert key(_NestedSlope(_nested(0.01, 20))) is None
    model, before = _Held(torch.relu), key(_Held(torch.relu))
    torch.set_default_dtype(torch.float64)
    try:
        assert key(model) != before
    finally:
        torch.set_default_dtype(torch.float32)


_NET = (
    "import torch\nfrom {helper} import act\n"
    "class Net(torch.nn.Module):\n"
    "    def __init__(self):\n        super().__init__(); self.fc = torch.nn.Linear(8, 8)\n"
    "    def forward(self, x):\n        return act(self.fc(x))\n"
)


@pytest.mark.parametrize("layout", ["package", "installed", "namespace", "beside"])
def test_cache_key_follows_a_helper_file_the_model_imports(tmp_path, monkeypatch, layout):
    # A helper of the model's package (installed, or without __init__.py), or a module beside a
    # script's model (not a package): edits count.
    if layout == "beside":
        root, where, module, helper = tmp_path, tmp_path, "net_beside_key", "act_beside_key"
    else:
        root = tmp_path / "site-packages" if layout == "installed" else tmp_path
        package = f"userpkg_{layout}_key"
        where, module, helper = root / package, f"{package}.model", f"{package}.helpers"
        where.mkdir(parents=True)
        if layout != "namespace":
            (where / "__init__.py").write_text("")
    helper_file = where / f"{helper.rpartition('.')[2]}.py"
    helper_file.write_text("import torch\ndef act(h):\n    return torch.relu(h)\n")
    (where / f"{module.rpartition('.')[2]}.py").write_text(_NET.format(helper=helper))
    monkeypatch.syspath_prepend(str(root))
    net = importlib.import_module(module).Net

    def key():
        return graph_store.cache_key(net(), "plain", {"x": torch.randn(2, 8)}, CONFIG)

    before = key()
    assert key() == before
    helper_file.write_text("import torch\ndef act(h):\n    return torch.sigmoid(h)\n")
    assert key() != before


def test_cache_key_follows_a_class_built_by_exec_in_a_module():
    # Its module's file is not its code: the class's compiled methods are.
    keys = set()
    for act in ("relu", "sigmoid"):
        text = (
            "class Net(torch.nn.Module):\n"
            "    def __init__(self):\n        super().__init__(); self.fc = torch.nn.Linear(8, 8)\n"
            f"    def forward(self, x):\n        return torch.{act}(self.fc(x))\n"
        )
        namespace = {"torch": torch, "__name__": __name__}
        exec(text, namespace)
        keys.add(graph_store.cache_key(namespace["Net"](), "plain", {"x": torch.randn(2, 8)}, CONFIG))
    assert len(keys) == 2


def _zoo_key(model: torch.nn.Module | None = None, name: str = "tiny-qwen3-vl-vision") -> str:
    """The graph cache key of a tiny zoo model, Qwen3-VL vision unless named (built anew unless
    given), as optimize computes it."""
    model = model or models.build_model(name, torch.float32)
    adapter, graph_inputs = prepare(model, models.example_inputs(name, torch.float32))
    return graph_store.cache_key(adapter.export_module(model), adapter.name, graph_inputs, CONFIG)


def test_cache_key_follows_library_code_patched_in_this_process(monkeypatch):
    # Attention or kernel swaps patch a library's class or module function; the versions in the key
    # cannot tell. A patched instance forward is a setting, with its code.
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    key = _zoo_key

    plain = key()
    mlp = qwen.Qwen3VLVisionMLP.forward
    monkeypatch.setattr(qwen.Qwen3VLVisionMLP, "forward", lambda self, x: mlp(self, x) * 0.5)
    halved = key()
    assert halved != plain
    monkeypatch.setattr(qwen.Qwen3VLVisionMLP, "forward", lambda self, x: mlp(self, x) * 0.25)
    assert key() not in (plain, halved)  # the same name, other code
    monkeypatch.undo()
    assert key() == plain
    rotary = qwen.apply_rotary_pos_emb_vision
    monkeypatch.setattr(qwen, "apply_rotary_pos_emb_vision", lambda q, k, cos, sin: rotary(q, k, cos, sin))
    assert key() != plain
    monkeypatch.undo()
    model = models.build_model("tiny-qwen3-vl-vision", torch.float32)
    model.blocks[0].mlp.forward = lambda x: x
    assert key(model) != plain


def test_cache_key_follows_a_decorated_patch_by_the_code_it_wraps(monkeypatch):
    # A decorator's wrapper is torch's or the stdlib's code, and functools.wraps gives it the name of
    # what it wraps: the key must see the wrapped function's code, as with any patch.
    import contextlib

    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    key = _zoo_key

    def traced(f):  # a decorator without functools.wraps: the function is only in its closure
        return lambda *a: f(*a)

    plain, mlp, rotary = key(), qwen.Qwen3VLVisionMLP.forward, qwen.apply_rotary_pos_emb_vision
    keys = {plain}
    for scale in (0.5, 0.25):

        def forward(self, x, scale=scale):
            return mlp(self, x) * scale

        for decorate in (torch.no_grad(), functools.lru_cache(maxsize=None), traced):
            monkeypatch.setattr(qwen.Qwen3VLVisionMLP, "forward", decorate(forward))
            keys.add(key())
        monkeypatch.undo()

        @contextlib.contextmanager
        def ignored(scale=scale):
            yield scale

        monkeypatch.setattr(qwen, "apply_rotary_pos_emb_vision", functools.wraps(rotary)(ignored))
        keys.add(key())
        monkeypatch.undo()
    assert len(keys) == 9  # every patch its own key
    assert key() == plain


def test_cache_key_follows_what_a_patch_reads(tmp_path, monkeypatch):
    # A patch's helpers and constants (in its own module), a partial's arguments or an object's
    # state, a library function put in a method's place, an attention function registered in
    # transformers' place: each is code the graph was captured from.
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    key = _zoo_key

    plain, mlp, rotary = key(), qwen.Qwen3VLVisionMLP.forward, qwen.apply_rotary_pos_emb_vision
    patch = tmp_path / "patch_reads_key.py"
    patch.write_text("SCALE = 1.0\ndef scaled(x):\n    return x * SCALE\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from patch_reads_key import scaled

    keys = {plain}
    monkeypatch.setattr(qwen.Qwen3VLVisionMLP, "forward", lambda self, x: scaled(mlp(self, x)))
    keys.add(key())
    patch.write_text("SCALE = 3.0\ndef scaled(x):\n    return x * SCALE\n")
    keys.add(key())
    monkeypatch.setattr(qwen.Qwen3VLVisionMLP, "forward", torch.nn.Identity.forward)
    keys.add(key())
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))

    def rope(q, k, cos, sin, scale):
        return rotary(q * scale, k, cos, sin)

    class Rope:  # a callable object, or a method bound to one: its state counts
        def __init__(self, scale):
            self.scale = scale

        def __call__(self, q, k, cos, sin):
            return rope(q, k, cos, sin, self.scale)

        def method(self, q, k, cos, sin):
            return rope(q, k, cos, sin, self.scale)

    for scale in (1.0, 2.0):
        for patched in (functools.partial(rope, scale=scale), Rope(scale), Rope(scale).method):
            monkeypatch.setattr(qwen, "apply_rotary_pos_emb_vision", patched)
            keys.add(key())
    monkeypatch.undo()
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", lambda *a, **k: sdpa(*a, **k))  # a registered kernel
    keys.add(key())
    monkeypatch.undo()
    assert len(keys) == 11  # every patch its own key
    assert key() == plain


def test_a_model_with_another_setting_is_not_served_the_first_ones_graph(tmp_path):
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path))
    x = torch.randn(2, 8)
    for k in (2.0, 3.0):
        model = _Scaled(k).eval()
        opt = amxopt.optimize(model, (x,), config)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))


class _Table(torch.nn.Module):
    """A tensor the forward reads from a plain attribute: neither parameter nor buffer, and too
    large for the key to hold its values."""

    def __init__(self, seed: int):
        super().__init__()
        self.fc, self.table = torch.nn.Linear(128, 128), torch.randn(128, generator=torch.Generator().manual_seed(seed))

    def forward(self, x):
        return self.fc(x) + self.table


@pytest.mark.parametrize("isolate", [True, False])
def test_a_plain_tensor_attribute_is_read_from_the_model_a_graph_serves(tmp_path, isolate):
    # Cached by name, not by value: the second model's own table, and changes made in place after.
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path), isolate_capture=isolate)
    x = torch.randn(4, 128)
    for seed in (0, 1):
        model = _Table(seed).eval()
        opt = amxopt.optimize(model, (x,), config)
        assert any(RESTORED in n for n in opt.report.notes) == (seed == 1)
        with torch.no_grad():
            torch.testing.assert_close(opt(x), model(x))
            model.table.mul_(3)
            torch.testing.assert_close(opt(x), model(x))


def test_cache_key_follows_tied_weights():
    graph_inputs = {"x": torch.randn(2, 8)}
    untied, tied = _Scaled(2.0), _Scaled(2.0)
    untied.fc2 = torch.nn.Linear(8, 8)
    tied.fc2 = torch.nn.Linear(8, 8)
    tied.fc2.weight = tied.fc.weight
    assert graph_store.cache_key(untied, "plain", graph_inputs, CONFIG) != graph_store.cache_key(
        tied, "plain", graph_inputs, CONFIG
    )


_GLOBALS = """
import logging, sys, torch
SCALE = float(sys.argv[1])
TABLE = torch.full((100,), SCALE)
logger = logging.getLogger(__name__)
fc = torch.randn(4)  # a global named like an attribute the forward reads: not read
def shift(x):
    return x + TABLE
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.fc = torch.nn.Linear(100, 100)
    def forward(self, x):
        logger.debug("forward")
        return shift(self.fc(x)) * SCALE
"""


def test_cache_key_follows_the_globals_a_forward_reads(tmp_path, monkeypatch):
    # Set at run time (from argv, a notebook cell): in no file's bytes. A helper's global counts too.
    (tmp_path / "globals_net.py").write_text(_GLOBALS)
    monkeypatch.syspath_prepend(str(tmp_path))
    keys = set()
    for scale in ("1.0", "3.0"):
        monkeypatch.setattr(sys, "argv", ["net", scale])
        sys.modules.pop("globals_net", None)
        net = importlib.import_module("globals_net").Net()
        keys.add(graph_store.cache_key(net, "plain", {"x": torch.randn(2, 100)}, CONFIG))
    sys.modules.pop("globals_net", None)
    assert len(keys) == 2
    # What the forward reads is what counts: not a logger's state, nor a global named like an attribute.
    net = importlib.import_module("globals_net").Net()
    key = graph_store.cache_key(net, "plain", {"x": torch.randn(2, 100)}, CONFIG)
    logging.getLogger("another.logger").setLevel(logging.INFO)
    net(torch.randn(2, 100))
    sys.modules["globals_net"].fc = torch.randn(4)
    assert graph_store.cache_key(net, "plain", {"x": torch.randn(2, 100)}, CONFIG) == key
    sys.modules.pop("globals_net", None)


def _module_key(tmp_path, monkeypatch, files: dict[str, str], value: str) -> str:
    """The cache key of ``net_key.build()`` after writing ``files`` (module name -> text), each in
    its own directory (not a package, nor beside another: not the model's user code by location),
    and importing them afresh with ``AMXOPT_TEST_VALUE=value``, as a new process would."""
    monkeypatch.setenv("AMXOPT_TEST_VALUE", value)
    for name, text in files.items():
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / f"{name}.py").write_text(text)
        monkeypatch.syspath_prepend(str(tmp_path / name))
        sys.modules.pop(name, None)
    importlib.invalidate_caches()
    try:
        net = importlib.import_module("net_key").build()
        return graph_store.cache_key(net, "plain", {"x": torch.randn(2, 8)}, CONFIG)
    finally:
        for name in files:
            sys.modules.pop(name, None)


_FC = (
    "import os, torch\nVALUE = float(os.environ['AMXOPT_TEST_VALUE'])\n"
    "class Fc(torch.nn.Module):\n    def __init__(self):\n        super().__init__(); self.fc = torch.nn.Linear(8, 8)\n"
)
_BUILD = "def build():\n    return Net()\n"


@pytest.mark.parametrize(
    "files, changed",
    [
        # a user base class in another file: its code, and the globals its methods read
        (
            {"base_key": _FC + "    def forward(self, x):\n        return torch.relu(self.fc(x))\n",
             "net_key": "import base_key\nclass Net(base_key.Fc):\n    pass\n" + _BUILD},
            {"base_key": _FC + "    def forward(self, x):\n        return torch.sigmoid(self.fc(x))\n"},
        ),
        (
            {"base_key": _FC + "    def forward(self, x):\n        return self.fc(x) * VALUE\n",
             "net_key": "import base_key\nclass Net(base_key.Fc):\n    pass\n" + _BUILD},
            {},
        ),
        # what a forward reads through a module: a helper module's function, another module's setting
        (
            {"helper_key": "import torch\ndef act(x):\n    return torch.relu(x)\n",
             "net_key": "import helper_key\n" + _FC
                        + "    def forward(self, x):\n        return helper_key.act(self.fc(x))\n"
                        "Net = Fc\n" + _BUILD},
            {"helper_key": "import torch\ndef act(x):\n    return torch.sigmoid(x)\n"},
        ),
        (
            {"settings_key": _FC,
             "net_key": "import settings_key\n" + _FC
                        + "    def forward(self, x):\n        return self.fc(x) * settings_key.VALUE\n"
                        "Net = Fc\n" + _BUILD},
            {},
        ),
        # a dict global, a class attribute, tensors in a tuple attribute, a numpy number, a slotted setting
        (
            {"net_key": _FC + "    def forward(self, x):\n        return self.fc(x) * OPTIONS['scale']\n"
                        "OPTIONS = {'scale': VALUE}\nNet = Fc\n" + _BUILD},
            {},
        ),
        (
            {"net_key": _FC + "    scale = 1.0\n    def forward(self, x):\n        return self.fc(x) * self.scale\n"
                        "Fc.scale = VALUE\nNet = Fc\n" + _BUILD},
            {},
        ),
        (
            {"net_key": _FC + "    def forward(self, x):\n        return self.fc(x) + self.feats[0][:8]\n"
                        "def build():\n    net = Fc()\n"
                        "    net.feats = (torch.randn(128, generator=torch.Generator().manual_seed(int(VALUE))),)\n"
                        "    return net\n"},
            {},
        ),
        (
            {"net_key": "import numpy\n" + _FC
                        + "    def forward(self, x):\n        return self.fc(x) * float(self.scale)\n"
                        "def build():\n    net = Fc(); net.scale = numpy.float32(VALUE)\n    return net\n"},
            {},
        ),
        (
            {"net_key": "import dataclasses\n" + _FC
                        + "    def forward(self, x):\n        return self.fc(x) * self.options.scale\n"
                        "@dataclasses.dataclass(slots=True)\nclass Options:\n    scale: float\n"
                        "def build():\n    net = Fc(); net.options = Options(VALUE)\n    return net\n"},
            {},
        ),
        # a function held by the model: the globals it reads
        (
            {"act_key": _FC.split("class")[0] + "def act(x):\n    return x * VALUE\n",
             "net_key": "import act_key\n" + _FC + "    def forward(self, x):\n        return self.act(self.fc(x))\n"
                        "def build():\n    net = Fc(); net.act = act_key.act\n    return net\n"},
            {},
        ),
        # a global class's attribute, a global options object
        (
            {"net_key": _FC + "    def forward(self, x):\n        return self.fc(x) * Options.scale\n"
                        "class Options:\n    scale = 1.0\nOptions.scale = VALUE\nNet = Fc\n" + _BUILD},
            {},
        ),
        (
            {"net_key": "import dataclasses\n" + _FC
                        + "    def forward(self, x):\n        return self.fc(x) * ARGS.scale\n"
                        "@dataclasses.dataclass\nclass Args:\n    scale: float\n"
                        "ARGS = Args(VALUE)\nNet = Fc\n" + _BUILD},
            {},
        ),
    ],
    ids=["base-code", "base-global", "helper-module", "module-setting", "dict-global", "class-attribute",
         "tensor-tuple", "numpy-number", "slotted-setting", "held-function", "global-class", "global-object"],
)  # fmt: skip
def test_cache_key_follows_what_a_user_class_reads_beyond_its_file(tmp_path, monkeypatch, files, changed):
    # Each pair computes differently with the same model file; a restored graph of the first served the second.
    first = _module_key(tmp_path, monkeypatch, files, "1")
    assert _module_key(tmp_path, monkeypatch, files, "1") == first
    assert _module_key(tmp_path, monkeypatch, files | changed, "1" if changed else "2") != first


_CHAIN = (
    "import torch\n"
    + "".join(f"def h{i}(x):\n    return h{i + 1}(x) + {i}\n" for i in range(16))
    + (
        "def h16(x):\n    return x\n"
        "class Net(torch.nn.Module):\n    def __init__(self):\n"
        "        super().__init__(); self.fc = torch.nn.Linear(8, 8)\n"
        "    def forward(self, x):\n        return h0(self.fc(x))\n"
        "REGISTRY = {h0: 'first', h16: 'last'}\n"
    )
)


def test_cache_key_reads_each_helper_once_and_no_address(tmp_path, monkeypatch):
    # Each description of a helper read the helpers it calls again (2^16 reads for a chain of 16),
    # and a dict keyed by functions put their addresses (repr) into the key.
    (tmp_path / "chain_key.py").write_text(_CHAIN)
    monkeypatch.syspath_prepend(str(tmp_path))
    net = importlib.import_module("chain_key").Net()
    calls = {"globals": 0, "files": 0}
    reads, digest = graph_store._globals_read, graph_store._top_digest

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    monkeypatch.setattr(graph_store, "_globals_read", counted("globals", reads))
    monkeypatch.setattr(graph_store, "_top_digest", counted("files", digest))
    assert graph_store.cache_key(net, "plain", {"x": torch.randn(2, 8)}, CONFIG) is not None
    assert calls["globals"] <= 4 and calls["files"] <= 4, calls
    described = json.dumps(graph_store._global_value(sys.modules["chain_key"].REGISTRY), default=str)
    assert "0x" not in described and "chain_key.h16" in described
    sys.modules.pop("chain_key", None)


@dataclasses.dataclass
class _Options:
    width: int = 8


class _OptionsConfigured(torch.nn.Module):
    """A model whose ``config`` is a dataclass, not a transformers or diffusers config."""

    def __init__(self):
        super().__init__()
        self.config, self.fc = _Options(), torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


def test_a_model_with_a_dataclass_config_is_cached(tmp_path):
    # dict(config) raised TypeError out of optimize().
    model, x = _OptionsConfigured().eval(), torch.randn(2, 8)
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path))
    amxopt.optimize(model, (x,), config)
    again = amxopt.optimize(model, (x,), config)
    assert any(RESTORED in n for n in again.report.notes)
    model.config.width = 16
    assert not any(RESTORED in n for n in amxopt.optimize(model, (x,), config).report.notes)


class _Activations(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x)) + torch.nn.functional.silu(x)


def test_cache_key_follows_a_library_function_patched_in_this_process(monkeypatch):
    # torch.nn.functional.gelu = mine: a forward reading torch.nn.functional.gelu runs mine.
    def key():
        return graph_store.cache_key(_Activations(), "plain", {"x": torch.randn(2, 8)}, CONFIG)

    plain, gelu, silu = key(), torch.nn.functional.gelu, torch.nn.functional.silu
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda x: gelu(x) * 0.5)
    halved = key()
    monkeypatch.undo()
    monkeypatch.setattr(torch.nn.functional, "silu", lambda x: silu(x) * 0.5)
    assert len({plain, halved, key()}) == 3
    monkeypatch.undo()
    assert key() == plain


def test_cache_key_follows_library_functions_the_library_reads_elsewhere(monkeypatch):
    # F.scaled_dot_product_attention = sageattn, as attention-kernel packages advise: diffusers reads
    # it in the backend its processors dispatch to (found through its registry), transformers in the
    # function registered as "sdpa"; F.gelu in diffusers' GELU; rotate_half two calls below the
    # attention's forward. A graph captured before any of these patches computes without them.
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    wan = functools.partial(_zoo_key, name="tiny-wan")
    plain = {"wan": wan(), "vl": _zoo_key()}
    sdpa, gelu, rotate = torch.nn.functional.scaled_dot_product_attention, torch.nn.functional.gelu, qwen.rotate_half
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", lambda *a, **k: sdpa(*a, **k) * 2)
    assert wan() != plain["wan"] and _zoo_key() != plain["vl"]
    monkeypatch.undo()
    monkeypatch.setattr(torch.nn.functional, "gelu", lambda x, approximate="none": gelu(x, approximate=approximate))
    assert wan() != plain["wan"]
    monkeypatch.undo()
    monkeypatch.setattr(qwen, "rotate_half", lambda x: rotate(x) * 2)
    assert _zoo_key() != plain["vl"]
    monkeypatch.undo()
    assert {"wan": wan(), "vl": _zoo_key()} == plain


def test_cache_key_follows_a_library_function_builtin_or_op_put_in_anothers_place(monkeypatch):
    # Each is library code (the libraries' versions are keyed), so only where it is read tells the
    # patch: F.gelu = F.mish, F.silu = torch.sigmoid, F.scaled_dot_product_attention = an op.
    def key():
        return graph_store.cache_key(_Activations(), "plain", {"x": torch.randn(2, 8)}, CONFIG)

    plain, wan = key(), functools.partial(_zoo_key, name="tiny-wan")
    plain_wan = wan()
    for name, other in (("gelu", torch.nn.functional.mish), ("silu", torch.sigmoid)):
        monkeypatch.setattr(torch.nn.functional, name, other)
        assert key() != plain, name
        monkeypatch.undo()
    monkeypatch.setattr(
        torch.nn.functional, "scaled_dot_product_attention", torch.ops.aten._efficient_attention_forward
    )
    assert wan() != plain_wan
    monkeypatch.undo()
    assert key() == plain and wan() == plain_wan


def test_cache_key_follows_an_installed_packages_function_put_in_a_library_modules_place(tmp_path, monkeypatch):
    # A kernel package patches a modeling module's function with its own (liger-kernel does), which
    # the library reads as a bare global: an installed package's code, yet a patch. One the
    # modeling file imports itself is not (the key would then follow every helper package).
    from transformers.models.qwen3_vl import modeling_qwen3_vl as qwen

    package = tmp_path / "site-packages" / "kernels_pkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("def rotate_half(x):\n    return -x\n")
    monkeypatch.syspath_prepend(str(package.parent))
    kernels = importlib.import_module("kernels_pkg")
    plain = _zoo_key()
    monkeypatch.setattr(qwen, "rotate_half", kernels.rotate_half)
    assert _zoo_key() != plain
    monkeypatch.undo()
    sys.modules.pop("kernels_pkg", None)
    assert _zoo_key() == plain
    assert "torch" in graph_store._imported_names(qwen.__file__)
    assert "rotate_half" not in graph_store._imported_names(qwen.__file__)


def test_cache_key_follows_the_code_of_an_attention_processor(monkeypatch):
    # A processor is no module: its class's code (a user's, or a library's patched here) is keyed as
    # a module class's is.
    from diffusers.models.transformers.transformer_wan import WanAttnProcessor

    key = functools.partial(_zoo_key, name="tiny-wan")
    plain = key()
    call = WanAttnProcessor.__call__
    monkeypatch.setattr(WanAttnProcessor, "__call__", lambda self, *a, **k: call(self, *a, **k) * 2)
    assert key() != plain
    monkeypatch.undo()
    keys = {plain}
    for factor in (1, 2):
        scope = {"WanAttnProcessor": WanAttnProcessor}
        exec(  # a user's processor, as a notebook cell defines it
            "class Mine(WanAttnProcessor):\n"
            f"    def __call__(self, *a, **k):\n        return super().__call__(*a, **k) * {factor}\n",
            scope,
        )
        model = models.build_model("tiny-wan", torch.float32)
        model.set_attn_processor(scope["Mine"]())
        keys.add(key(model))
    assert len(keys) == 3


class _Windowed(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)
        self.register_buffer("window", torch.ones(width), persistent=False)

    def forward(self, x):
        return self.fc(x)[:, : self.window.shape[0]]


_TABLE = torch.arange(32.0).reshape(4, 8).t()  # a global read by a forward: a constant of the graph


class _Tabled(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) + _TABLE


_WHOLE = torch.arange(64.0) / 64
_HALF = _WHOLE[:32]  # globals of one memory: two constants of the graph that safetensors cannot write apart


class _Halves(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.fc(x) + _HALF + _WHOLE[32:]


@pytest.mark.parametrize("isolate", [True, False])
@pytest.mark.parametrize(
    "model_class, x", [(_Tabled, torch.randn(8, 4)), (_Halves, torch.randn(3, 32))], ids=["non-contiguous", "shared"]
)
def test_a_constant_of_the_graph_is_stored_and_restored(tmp_path, isolate, model_class, x):
    # Constants that share memory: optimize() itself raised safetensors' "Some tensors share memory"
    # (its graph cache write caught only OSError), or, isolated, captured twice.
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path), isolate_capture=isolate)
    for run in range(2):
        model = model_class().eval()
        opt = amxopt.optimize(model, (x,), config)
        with torch.no_grad():
            assert torch.equal(opt(x), model(x))
        assert any(RESTORED in note for note in opt.report.notes) == (run == 1)


def test_cache_key_follows_the_shapes_of_buffers_left_out_of_the_state_dict():
    # The graph reads only the buffer's shape, so a restore on another one would check nothing.
    def key(width):
        return graph_store.cache_key(_Windowed(width), "plain", {"x": torch.randn(2, 16)}, CONFIG)

    assert key(8) == key(8) != key(12)


def test_load_restores_the_saved_graph_without_capturing(tmp_path, monkeypatch):
    name = "tiny-wan"
    config = dataclasses.replace(CONFIG, keep_source=False, graph_cache=False)
    model = models.build_model(name, torch.float32)
    inputs = models.example_inputs(name, torch.float32)
    opt = amxopt.optimize(model, inputs, config)
    with torch.no_grad():
        want = opt(**inputs)
    opt.save(tmp_path / "artifact")
    manifest = json.loads((tmp_path / "artifact" / "amxopt.json").read_text())
    assert len(manifest["graphs"]) == 1 and manifest["graphs_not_saved"] is None

    def no_capture(*args, **kwargs):
        raise AssertionError("load() captured the model again")

    monkeypatch.setattr(runtime_module, "export", no_capture)
    loaded = amxopt.load(tmp_path / "artifact", config)
    assert any("the artifact" in n for n in loaded.report.notes)
    with torch.no_grad():
        assert _equal(loaded(**inputs), want)


def test_graphs_of_two_input_regions_are_both_kept_in_the_cache(tmp_path, caplog):
    """A batch-1 example's graph fixes the batch at 1 and the next takes the others: both under
    one key (same model, call structure and options), neither replacing the other. (The second
    takes a batch of 1 too, as export's own guards do: the next process may restore either first.)"""
    config = dataclasses.replace(CONFIG, autotune_cache=str(tmp_path))
    inputs = models.example_inputs("tiny-wan", torch.float32)
    two = {k: torch.cat([v, v]) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    for run in range(2):
        opt = amxopt.optimize(models.build_model("tiny-wan", torch.float32), None, config)
        with torch.no_grad(), caplog.at_level(logging.INFO, logger="amxopt"):
            caplog.clear()
            opt(**inputs), opt(**two)
        captures, restores = caplog.text.count("re-capturing"), caplog.text.count("restored from the graph cache")
        assert captures == 2 and restores == 0 if run == 0 else captures == restores >= 1, caplog.text
    assert len(list((tmp_path / "graphs").glob("*.json"))) == 2


def test_a_meta_tensor_attribute_is_described_without_its_values():
    # .tolist() of a small meta tensor raised, and the key (the cache) was silently off.
    net = _Scaled(2.0)
    net.table = torch.empty(3, device="meta")
    assert graph_store.cache_key(net, "plain", {"x": torch.randn(2, 8)}, CONFIG) is not None
