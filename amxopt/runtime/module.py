"""OptimizedModule: the rewritten graph(s) behind the original model's call signature.

A call runs the adapter's eager part, checks the inputs against each captured graph's guards and
runs the first graph that accepts them. A call no graph accepts (a shape outside a static capture,
a new non-tensor argument) is captured and rewritten on the spot and cached, up to
``AmxConfig.max_recaptures`` graphs. The source model is referenced (not copied) for that purpose;
the graphs themselves hold only packed weights.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import operator
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.utils.hooks import RemovableHandle

from amxopt.capture import Adapter, CaptureError, export, refuse_inference_tensors, repeated, split_inputs
from amxopt.config import AmxConfig
from amxopt.ops import packed
from amxopt.passes import run_passes
from amxopt.passes._graph import dtype_of, fetch
from amxopt.runtime import graph_store, isolated, weights
from amxopt.runtime.graph_store import GraphEntry
from amxopt.runtime.profile import Profile, profile_graph
from amxopt.runtime.report import Report

logger = logging.getLogger(__name__)


def build_graph(
    model: nn.Module, adapter: Adapter, graph_inputs: dict, config: AmxConfig, keep_text: bool = False
) -> GraphEntry:
    """Capture ``model`` on ``graph_inputs`` and run the passes: one entry of the graph cache.

    With ``config.graph_cache``, a graph stored on disk for this model structure, call structure
    and options is restored instead (when its guards accept ``graph_inputs``), and a new graph is
    stored. ``keep_text`` (the CLI's dumps) always captures. A capture runs in a forked child where
    it can (``AmxConfig.isolate_capture``, ``amxopt/runtime/isolated.py``).
    """
    _refuse_meta(model, adapter.model_name)  # (before the cache: a stored graph would pack no values)
    module = adapter.export_module(model)
    refuse_inference_tensors(module, adapter.model_name)  # (before the cache too: writes to them are unseen)
    key = None
    if config.graph_cache and not keep_text and config.tp == 1:
        key = graph_store.cache_key(module, adapter.name, graph_inputs, config)
    if key is not None:
        restored = next((g for g in graph_store.read_cache(key, module, config) if _accepts(g, graph_inputs)), None)
        if restored is not None:
            logger.info("amxopt: %s restored from the graph cache (%s)", adapter.model_name, key)
            return restored
    if isolated.usable(config, keep_text):
        graph = isolated.capture(
            lambda: _capture_and_rewrite(model, adapter, graph_inputs, config, False),
            module,
            adapter.model_name,
            config,
        )
    else:
        graph = _capture_and_rewrite(model, adapter, graph_inputs, config, keep_text)
    if key is not None:
        graph_store.write_cache(key, graph, module, config)
    return graph


def _refuse_meta(model: nn.Module, name: str) -> None:
    on_meta = next(
        (n for n, p in model.named_parameters() if p.device.type == "meta" and not packed.is_released(p)), None
    )
    if on_meta is not None and weights.has_released(model):
        raise RuntimeError(
            f"amxopt: {name}: {on_meta} is on the meta device, with no values to capture: "
            "built from or beside weights amxopt.optimize packed and released (a LoRA adapter loaded after "
            "optimize, or layers fused after it, as fuse_qkv_projections() does). Load adapters and fuse layers "
            "before amxopt.optimize (or undo the change: unfuse_qkv_projections()), or optimize with "
            "AmxConfig(keep_source=True)"
        )
    if on_meta is not None:
        raise RuntimeError(
            f"amxopt: {name}: {on_meta} is on the meta device, with no values to capture (a "
            "model built under init_empty_weights, or offloaded by accelerate, keeps its weights elsewhere): "
            "load its weights, or remove the offload hooks, before amxopt.optimize"
        )


def _capture_and_rewrite(
    model: nn.Module, adapter: Adapter, graph_inputs: dict, config: AmxConfig, keep_text: bool
) -> GraphEntry:
    with weights.exportable(model):
        captured = export(model, adapter, graph_inputs, config.dynamic, config.stamp_blocks)
    _refuse_mixed_products(captured.gm, adapter.model_name)
    records = run_passes(captured.gm, config, keep_text=keep_text)
    _check_no_released_reads(captured.gm, adapter.model_name)
    notes = [captured.note] if captured.note else []
    report = Report.from_graph(
        captured.gm,
        model=adapter.model_name,
        adapter=adapter.name,
        provider=config.provider,
        dynamic=captured.dynamic,
        passes=[(r.name, r.modified) for r in records],
        notes=notes,
    )
    return GraphEntry(captured, _tensor_dtypes(graph_inputs), _signature(graph_inputs), report, records)


def _tensor_leaves(graph_inputs: dict) -> dict[str, torch.Tensor]:
    """Each tensor input by its name, one in a tuple, list or dict by its path (``extra[0]``)."""
    leaves = {}
    for name, value in graph_inputs.items():
        if isinstance(value, (torch.Tensor, int, float, str, type(None))):  # a leaf: no pytree walk (per call)
            if isinstance(value, torch.Tensor):
                leaves[name] = value
            continue
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if isinstance(leaf, torch.Tensor):
                leaves[name + pytree.keystr(path)] = leaf
    return leaves


def _tensor_dtypes(graph_inputs: dict) -> dict[str, torch.dtype]:
    return {path: leaf.dtype for path, leaf in _tensor_leaves(graph_inputs).items()}


_PRODUCTS = {
    torch.ops.aten.linear.default,
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.convolution.default,
    torch.ops.aten.conv2d.default,
    torch.ops.aten.conv3d.default,
}


def _refuse_mixed_products(gm: fx.GraphModule, model_name: str) -> None:
    """A matrix product or convolution of two floating dtypes, which export traces and eager refuses
    when it runs (fp16 encoder_hidden_states into an fp32 Wan): a failed capture, told by the
    caller as the input's dtype, not a graph that fails at every call."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _PRODUCTS:
            continue
        by_dtype: dict[torch.dtype, list[str]] = {}
        for a in node.args:  # (a bias in the weight's dtype goes with it)
            if isinstance(a, fx.Node) and (dtype := dtype_of(a)) is not None and dtype.is_floating_point:
                by_dtype.setdefault(dtype, []).extend(_roots(a))
        if len(by_dtype) > 1:
            operands = " by ".join(f"{d} (from {', '.join(dict.fromkeys(r))})" for d, r in by_dtype.items())
            raise CaptureError(
                f"amxopt: {model_name}: {node.name} ({node.target}) multiplies {operands}, which eager PyTorch "
                "refuses outside torch.autocast (amxopt runs its graphs without autocast)"
            )


def _roots(node: fx.Node, most: int = 3) -> list[str]:
    """The graph inputs and constants ``node`` is computed from (its first ``most``), for a message."""
    seen, todo, roots = set(), [node], []
    while todo and len(roots) < most:
        n = todo.pop(0)
        if n in seen:
            continue
        seen.add(n)
        if n.op in ("placeholder", "get_attr"):
            roots.append(str(n.target))
        todo.extend(n.all_input_nodes)
    return roots


def _check_no_released_reads(gm: fx.GraphModule, model_name: str) -> None:
    # A node other than a pack reading a released weight would compute with a placeholder.
    for node in gm.graph.nodes:
        if node.op == "get_attr" and packed.is_released(fetch(gm, node.target)):
            users = ", ".join(f"{u.name} ({u.target})" for u in node.users)
            raise RuntimeError(
                f"amxopt: {model_name}: {node.target} exists only packed (amxopt.optimize released its source, or "
                f"amxopt.load / from_pretrained packed it as they read it), but this graph reads it unpacked in "
                f"{users}. Keep the passes that read it packed (replace_linear, replace_patch_embed), or keep an "
                "unpacked copy: load the model with its own from_pretrained and optimize it with "
                "AmxConfig(keep_source=True)"
            )


def _signature(graph_inputs: dict) -> tuple:
    # A tensor by its rank: export's guards check sizes, not how many (a Wan timestep [B] or [B, T]).
    # Any other value by its type too (a graph of scale=1 computes x * 1, not x * 1.0 or x * True),
    # a float by its text (a NaN is itself).
    leaves, spec = pytree.tree_flatten(graph_inputs)
    return spec, tuple(_signature_leaf(x) for x in leaves)


def _signature_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return {"tensor_dims": x.dim()}
    return [type(x).__qualname__, repr(x) if isinstance(x, float) else x]  # (a list: as JSON reads it back)


def refuse_released_load(module: nn.Module, state_dict: Mapping, prefix: str, said: str, model_name: str) -> None:
    """Refuse a load of ``state_dict`` (``module``'s keys under ``prefix``) that writes a weight
    optimize released; ``said`` is the prefix the caller's keys have."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if prefix + name in state_dict and packed.is_released(p):
            raise RuntimeError(
                f"amxopt: cannot load {said + name} into {model_name}: amxopt.optimize packed that weight and "
                "released its source (one copy in memory). Load the new weights into a fresh model and optimize "
                "it, or optimize with AmxConfig(keep_source=True)"
            )


class _LoadWatch:
    """What changes the source model after optimize: a ``load_state_dict`` into it (whole or a
    submodule), or a submodule, parameter or buffer assigned in it (a LoRA adapter injected by peft,
    a weight replaced). Either makes the optimized modules watching drop their graphs, and their next
    call captures again from the new model (packing what changed). A load into a released weight is
    refused before anything is written (a no-op on its meta placeholder: the graphs would mix old
    packed weights with new norms and biases).

    A load pre-hook of each module of the source, and an entry of ``_WATCHED`` for each module (read
    by global registration hooks). The outermost module loaded checks its whole subtree (torch loads
    a module's own tensors, then its children's: a hook only on modules holding tensors let a root
    holding none load UMT5's embedding before the refusal came at its first released weight).
    Pickled or copied with the model, it keeps the refusal and watches nothing (an optimized module
    is not pickled; a copied one watches its own copy of the source).
    """

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.watchers: weakref.WeakSet = weakref.WeakSet()

    def __call__(self, module: nn.Module, state_dict: Mapping, prefix: str, *_) -> None:
        if not any(k.startswith(prefix) for k in state_dict):
            return
        for opt in list(self.watchers):
            opt._refuse_at_tp()
        refuse_released_load(module, state_dict, prefix, prefix, self.model_name)
        self.changed()

    def assigned(self, module: nn.Module, name: str, value: Any) -> None:
        """``module.name = value`` (a submodule, parameter or buffer) in the watched source."""
        if value is not module._modules.get(name, module._parameters.get(name, module._buffers.get(name))):
            self.changed()

    def changed(self) -> None:
        for opt in list(self.watchers):
            opt._drop_graphs()

    def __getstate__(self) -> dict:
        return {"model_name": self.model_name}

    def __setstate__(self, state: dict) -> None:
        self.model_name, self.watchers = state["model_name"], weakref.WeakSet()


# Every module of a watched source -> its _LoadWatch; read by the global registration hooks below.
_WATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Each optimized module's capture lock (not an attribute: a copy of the module gets its own): two
# threads' first calls with new shapes capture once, the second waiting for the first's graph.
_CAPTURING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _on_assign(module: nn.Module, name: str, value: Any) -> None:
    watch = _WATCHED.get(module)
    if watch is not None:
        watch.assigned(module, name, value)


_HOOKS = (
    torch.nn.modules.module.register_module_module_registration_hook(_on_assign),
    torch.nn.modules.module.register_module_parameter_registration_hook(_on_assign),
    torch.nn.modules.module.register_module_buffer_registration_hook(_on_assign),
)


def _adapter_layers(modules: Iterable[nn.Module]) -> list[nn.Module]:
    """peft's adapter layers (LoRA and its kin) among ``modules``; found by class, so peft need not be installed."""
    return [
        m
        for m in modules
        if any(c.__name__ == "BaseTunerLayer" and c.__module__.startswith("peft.") for c in type(m).__mro__)
    ]


def _adapter_weights(layer: nn.Module) -> Iterable[torch.Tensor]:
    """The weights of a peft layer's adapters (``lora_A``, ``lora_B``, ...), not of the layer it wraps."""
    for name in getattr(layer, "adapter_layer_names", ()):
        held = getattr(layer, name, None)
        if isinstance(held, nn.Module):  # (a ModuleDict or ParameterDict by adapter name)
            yield from held.parameters()


# Loaders of the source whose ``hotswap=True`` rewrites adapter weights in place (diffusers, transformers).
HOTSWAP_LOADERS = ("load_lora_adapter", "load_adapter")
_LOST_MERGE_ADVICE = "fuse adapters before amxopt.optimize, or optimize with AmxConfig(keep_source=True)"


def _merged_since(captured: tuple[list[nn.Module], list[tuple]] | None) -> list[nn.Module]:
    """The adapter layers whose merges differ from ``captured`` (layers and their _adapter_state)."""
    if not captured:
        return []
    layers, state = captured
    return [m for m, before, now in zip(layers, state, _adapter_state(layers), strict=True) if before[2] != now[2]]


class _Traced:
    """What torch.export traced into a source's graphs beyond its modules, parameters and buffers
    (the registration hooks watch those), as it was at the capture:

    - forward hooks and pre-hooks on its modules, by handle id. Not counted: amxopt's own guard on
      a released source, and transformers' output-recording hooks (installed the first time an
      eager call asks for hidden states, idle otherwise);
    - attention processors, which diffusers keeps as plain attributes (``set_attn_processor``);
    - forwards replaced on an instance (diffusers' hooks, e.g. ``enable_cache``; accelerate's);
    - its modules' training flags: ``.train()`` on one since is refused at the call (a layer added
      since, in training mode as built, is a new module: captured again);
    - the parameters, buffers and submodules of its modules, by identity: code that writes a module's
      ``_parameters`` or ``_modules`` directly (accelerate's ``set_module_tensor_to_device``, torch.ao's
      ``quantize_dynamic(inplace=True)``) bypasses the registration hooks; and whether one of those
      dicts that was empty holds something now.

    What they compute is in the graphs; they are not called when the graphs run. One changed since
    makes the graphs stale. ``changed()`` costs one dict lookup per module, an identity comparison
    per parameter, buffer and submodule (on a Zen 4: about 100 us a call for Wan 1.3B's 858 modules,
    against 20 us without the identities), a length per empty dict and a counter: hooks are scanned
    again only when torch's handle counter moved (a hook registered anywhere) or a hook dict that was not empty shrank (one
    removed)."""

    def __init__(self, source: nn.Module) -> None:
        self.next_id = RemovableHandle.next_id
        self.ids, self.dicts = _forward_hooks(source)
        self.lengths = [len(d) for d in self.dicts]
        modules = list(source.modules())
        self.attrs = [m.__dict__ for m in modules]
        self.dicts_of_members = [d for _, d in repeated.member_dicts(source)]
        self.settle()
        self.forwards = _values(self.attrs, "forward")
        self.with_processor = [d for d in self.attrs if "processor" in d]
        self.processors = _values(self.with_processor, "processor")
        self.training = _values(self.attrs, "training")

    def settle(self) -> None:
        """Take the parameters, buffers and submodules as they are now as the captured ones."""
        self.members = [d for d in self.dicts_of_members if d]
        self.empty = [d for d in self.dicts_of_members if not d]  # (their lengths: a third of the cost)
        self.held = _held(self.members)

    def changed(self, source: nn.Module) -> bool:
        if _values(self.attrs, "forward") != self.forwards or _values(self.attrs, "training") != self.training:
            return True
        held = _held(self.members)
        if len(held) != len(self.held) or not all(map(operator.is_, held, self.held)) or any(map(len, self.empty)):
            return True
        if _values(self.with_processor, "processor") != self.processors:
            return True
        if RemovableHandle.next_id == self.next_id and all(len(d) == n for d, n in zip(self.dicts, self.lengths)):
            return False
        ids, dicts = _forward_hooks(source)
        if ids != self.ids:
            return True
        self.next_id, self.dicts, self.lengths = RemovableHandle.next_id, dicts, [len(d) for d in dicts]
        return False

    def warn(self, source: nn.Module, model_name: str) -> None:
        """Say, at a capture, what of this the graphs hold as it ran then."""
        hooked, replaced = _hooked_and_replaced(source, model_name)
        what = [f"the forward hooks on {_some(hooked)}"] if hooked else []
        what += [f"the forwards replaced on {_some(replaced)} (diffusers' or accelerate's hooks)"] if replaced else []
        if what:
            logger.warning(
                "amxopt: %s: %s are traced into its graph as they ran at this capture: what they compute is kept, "
                "but they are not called when it runs (a hook that records outputs records nothing; a cache, such "
                "as diffusers' enable_cache, is not used); one added or removed later makes the next call capture "
                "again",
                model_name,
                " and ".join(what),
            )


def _held(dicts: list[dict]) -> list:
    return list(itertools.chain.from_iterable(map(dict.values, dicts)))


def _values(dicts: list[dict], key: str) -> list:
    return list(map(dict.get, dicts, itertools.repeat(key)))


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _forward_hooks(source: nn.Module) -> tuple[tuple[int, ...], list[dict]]:
    """The ids of the counted forward (pre-)hooks on ``source``'s modules (see :class:`_Traced`),
    and the hook dicts that hold any. torch's global module hooks are left out: they run on the
    optimized module's own call too."""
    dicts = [d for m in source.modules() for d in (m._forward_pre_hooks, m._forward_hooks) if d]
    return tuple(k for d in dicts for k in repeated.user_hooks(d, recorders=False)), dicts


def _hooked_and_replaced(source: nn.Module, root: str) -> tuple[list[str], list[str]]:
    """The paths of ``source``'s modules (``root`` for itself) with forward hooks (see
    :class:`_Traced`; torch's global ones left out), and those with a forward replaced on the instance."""
    hooked = [path or root for path in repeated.hooked(source, recorders=False) if path != "*"]
    return hooked, [name or root for name, m in source.named_modules() if _forward_replaced(m)]


def _forward_replaced(module: nn.Module) -> bool:
    """A forward set on the instance other than its class's own (diffusers' ``remove_hook`` puts
    that one back as an instance attribute)."""
    forward = module.__dict__.get("forward")
    own = getattr(forward, "__self__", None) is module and getattr(forward, "__func__", None) is type(module).forward
    return forward is not None and not own


def _forget_packings(modules: list[nn.Module]) -> None:
    for p in (p for m in modules for p in m.parameters()):
        packed.forget_all(p)


def _adapter_state(layers: list[nn.Module]) -> list[tuple]:
    # What peft's set_adapters / set_scale / disable / merge change: Python values a graph holds as constants.
    return [
        (
            tuple(m.active_adapters),
            bool(m.disable_adapters),
            tuple(m.merged_adapters),
            tuple(sorted((k, _scale_value(v)) for k, v in getattr(m, "scaling", {}).items())),
        )
        for m in layers
    ]


def _scale_value(v: Any) -> Any:
    # peft keeps scalings as tensors after enable_lora_hotswap, and scale_layer changes them in place
    return tuple(v.detach().flatten().tolist()) if isinstance(v, torch.Tensor) else v


class _NotCaptured(RuntimeError, AttributeError):
    """What exists once a graph is captured (``report``, ``graph_module``), read before: a
    RuntimeError, which ``hasattr`` and ``getattr(opt, name, default)`` take as absent."""


_CAPTURED_ONLY = {"report": "the report", "graph_module": "graph_module"}


class OptimizedModule(nn.Module):
    """An amxopt-optimized model: same call signature and output type as the original.

    Attributes:
        graph_module: the rewritten ``torch.fx.GraphModule`` of the first capture.
        report: the rewrite report of that graph.
    """

    def __init__(
        self,
        model: nn.Module,
        adapter: Adapter,
        first: GraphEntry | None,
        config: AmxConfig,
        eager_fallback: bool = False,
    ) -> None:
        super().__init__()
        self.adapter = adapter
        self.amx_config = config
        self._entries: list[GraphEntry] = []
        self._pending: list[Callable[[], GraphEntry]] = []  # stored graphs, restored at first use
        # A pipeline component that torch.export cannot capture runs as it was (reported, logged)
        # instead of failing the user's pipeline call; ``eager_reason`` says why.
        self.eager_fallback = eager_fallback
        self.eager_reason: str | None = None
        # peft adapter layers of the source and their state when the graphs were captured (a change
        # makes the next call capture again); None until a graph is added.
        self._adapters: tuple[list[nn.Module], list[tuple]] | None = None
        # Kept source weights the graphs read packed, with their version, data pointer and storage at
        # packing: an in-place write (``w.mul_(2)``, ``copy_``) or new data (``w.data = ...``) makes the
        # next call capture and pack again.
        self._packed_versions: list[tuple[torch.Tensor, int, int, packed.StorageRef]] = []
        self._placeholders: list[tuple[str, torch.Tensor, int, torch.dtype]] = []  # see _add
        self._traced: _Traced | None = None  # the source's hooks and processors the graphs traced
        # Kept for re-capture of calls no graph accepts; a plain ref, so that nn.Module does not
        # register the source model's weights as part of this module's state. Set after this
        # module's own attributes: from here on, a name the source has is assigned on the source.
        self.__dict__["_source"] = model
        # The modules in eval mode now (and at each capture): see _refuse_trained.
        self.__dict__["_eval_modules"] = weakref.WeakSet(m for m in model.modules() if not m.training)
        # The source's own parameters and buffers (Wan's ``scale_shift_table``) are this module's:
        # named_modules lists this module in the source's place, so a walk from here or from a parent
        # (``pipe.transformer.parameters()``, an EMA's, a count's) reads them from these dicts.
        self.__dict__["_parameters"], self.__dict__["_buffers"] = model._parameters, model._buffers
        self.train(model.training)
        self._watch_loads(model)
        self.register_load_state_dict_post_hook(OptimizedModule._skip_graph_keys)
        if first is not None:
            self._add(first)

    def _watch_loads(self, model: nn.Module) -> list[nn.Module]:
        """See :class:`_LoadWatch`: one per source, shared by its optimized modules. Returns the
        source's modules."""
        modules = list(model.modules())
        watch = next((_WATCHED[m] for m in modules if m in _WATCHED), None)
        if watch is None:  # a copied source carries its copy of the watch, watching nothing
            hooks = (h.hook for m in modules for h in m._load_state_dict_pre_hooks.values())
            watch = next((h for h in hooks if isinstance(h, _LoadWatch)), None) or _LoadWatch(type(model).__name__)
        watch.watchers.add(self)
        for module in modules:
            _WATCHED[module] = watch
            hooks = module._load_state_dict_pre_hooks.values()
            if not any(getattr(h, "hook", None) is watch for h in hooks):
                module.register_load_state_dict_pre_hook(watch)
        return modules

    def named_modules(self, memo: set | None = None, prefix: str = "", remove_duplicate: bool = True):
        """This module, then the source model's modules under their own names: a tool that walks a
        model to change its layers (peft's ``get_peft_model`` or ``PeftModel.from_pretrained`` on a
        whole model) finds the source's, and what it changes there is seen (``_LoadWatch``): the
        graphs are captured again at the next call. Where the source's first parameter was released,
        the graph's modules come first (``model.device`` reads the first parameter, and that one is a
        meta placeholder); an adapter put on released weights has no values, which the next call
        says. (One parameter looked at, not all: ``model.device`` walks this on every read.)"""
        source = self.__dict__["_source"]
        first = next(source.parameters(), None)
        if first is not None and packed.is_released(first):
            yield from super().named_modules(memo, prefix, remove_duplicate)
        elif not remove_duplicate or memo is None or self not in memo:
            if remove_duplicate and memo is not None:
                memo.add(self)
            yield prefix, self
        for name, module in source.named_modules(memo, prefix, remove_duplicate):
            if module is not source:
                yield name, module

    def named_children(self):
        """The source model's children, as :meth:`named_modules` lists its modules (the graph's
        first where the source's first weight was released): ``opt.apply(fn)``, and code that walks
        children to change layers, reach the source, and the next call sees what they changed."""
        source = self.__dict__["_source"]
        first = next(source.parameters(), None)
        if first is not None and packed.is_released(first):
            yield from super().named_children()
        yield from source.named_children()

    def train(self, mode: bool = True) -> OptimizedModule:
        # Only the flag, as the source's: the graphs compute inference whatever it says (a graph
        # from export refuses train()).
        self.training = mode
        return self

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The source model's state dict, under its own names (a whole model saved after optimize
        saves its towers as they were); refused when optimize released packed source weights."""
        source = self.__dict__["_source"]
        if weights.has_released(source):
            prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
            if prefix:  # a whole model's save_pretrained (its state dict): opt.save is this part's alone
                raise RuntimeError(
                    f"amxopt: the optimized part {prefix.removesuffix('.')} ({self.adapter.model_name}) has no state "
                    "dict: amxopt.optimize packed its weights and released their unpacked copies (one copy in "
                    "memory). Save the model before amxopt.optimize, or optimize it with AmxConfig(keep_source=True)"
                )
            save = "" if self.amx_config.tp != 1 else "save the optimized model with opt.save(directory), "
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name}'s packed weights were released by amxopt.optimize, so it has no "
                f"state dict (to save it, or to load a peft adapter into it): save the model before optimizing it, "
                f"{save}load adapters before optimizing it, or optimize with AmxConfig(keep_source=True)"
            )
        return source.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load into the source model; the graphs are captured again at the next call."""
        return self.__dict__["_source"].load_state_dict(state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        # A whole model loading its state: this part's keys (the source's names, as state_dict
        # gives them) go to the source; the graphs' own tensors are not state (_skip_graph_keys).
        inner = prefix + "graph_module."
        mine = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix) and not k.startswith(inner)}
        assign = local_metadata.get("assign_to_params_buffers", False)
        source = self.__dict__["_source"]
        refuse_released_load(source, mine, "", prefix, self.adapter.model_name)  # naming the caller's key
        result = source.load_state_dict(mine, strict=False, assign=assign)
        missing_keys += [prefix + k for k in result.missing_keys]
        unexpected_keys += [prefix + k for k in result.unexpected_keys]
        self.__dict__["_graph_keys"] = inner

    @staticmethod
    def _skip_graph_keys(module: OptimizedModule, incompatible) -> None:
        inner = module.__dict__.pop("_graph_keys", None)
        if inner is not None:
            incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(inner)]

    def _apply(self, fn: Callable, recurse: bool = True) -> OptimizedModule:
        # .to / .float / .half / .cpu / .cuda: the packed weights cannot follow; a move or cast that
        # changes nothing (a pipeline's .to("cpu") or .to(its own dtype)) is fine.
        dtype = self._dtype()
        moved = fn(torch.empty(0, dtype=dtype))
        if moved.dtype != dtype or moved.device.type != "cpu":
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name} runs its weights packed for {dtype} on the CPU and cannot be "
                f"moved or cast to {moved.dtype} on {moved.device}: cast the model before amxopt.optimize"
            )
        return self

    def _dtype(self) -> torch.dtype:
        source = self.__dict__["_source"]
        dtype = getattr(source, "dtype", None)
        if isinstance(dtype, torch.dtype):
            return dtype
        return next((p.dtype for p in source.parameters() if p.is_floating_point()), torch.float32)

    def __reduce_ex__(self, protocol: int):
        raise TypeError(
            f"amxopt: an optimized {self.adapter.model_name} cannot be pickled (its graphs would lose their output "
            "types): save it with opt.save(directory) and read it with amxopt.load"
        )

    def __copy__(self) -> OptimizedModule:
        raise TypeError(
            f"amxopt: an optimized {self.adapter.model_name} cannot be copied shallowly (the copy would share its "
            "graphs and the state that decides when they are stale): use copy.deepcopy"
        )

    def __deepcopy__(self, memo: dict) -> OptimizedModule:
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for p in self.__dict__["_source"].parameters():
            if packed.is_released(p):  # meta, shared: a copy would lose its packings and tag
                memo[id(p)] = p
        stale = self._traced is not None and self._traced.changed(self.__dict__["_source"])
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        new._watch_loads(new.__dict__["_source"])
        if new._traced is not None:  # of the copy's modules' own attribute dicts, not of copies of the originals'
            new._traced = _Traced(new.__dict__["_source"])
            if stale:  # a change the original has not been called since: the copy's graphs are as stale
                new._drop_graphs()
        return new

    def _refuse_at_tp(self) -> None:
        """A change to the source, refused before anything is written where the graphs run tensor-parallel."""
        if self.amx_config.tp != 1 and (self._entries or self._pending):
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name} runs tensor-parallel (tp={self.amx_config.tp}): every rank holds "
                "its own shards, packed when it was optimized, and would not follow a change to the model's weights, "
                "modules or adapters. Change the model before amxopt.optimize, then optimize it"
            )

    def _drop_graphs(self) -> None:
        self._refuse_at_tp()
        if self._entries or self._pending:
            logger.info("amxopt: %s changed after optimize: its graphs are captured anew", self.adapter.model_name)
        # The adapters as captured, kept until the next capture settles their merges (_settle_merges):
        # peft's merge_and_unload merges and replaces the layers one by one, each replacement a drop.
        if self._adapters is not None and "_dropped_adapters" not in self.__dict__:
            self.__dict__["_dropped_adapters"] = self._adapters
        self._entries, self._pending, self._adapters, self._packed_versions = [], [], None, []
        self._traced = None
        self.__dict__.pop("_refused_dtypes", None)  # the changed source may take a dtype it refused
        if "graph_module" in self._modules:  # (None, not removed: a load may be iterating the children)
            self._modules["graph_module"] = None

    def _settle_merges(self) -> None:
        """Before a capture: the adapter layers merged (or unmerged) since the last one wrote their
        base weights in place through ``.data``, which no packing's stamp sees, so they are packed
        again; where those weights were released the merge changed nothing, and the module refuses
        from then on."""
        merged = _merged_since(self.__dict__.pop("_dropped_adapters", None))
        if any(weights.has_released(layer) for layer in merged):
            self.__dict__["_lost_merge"] = (
                f"amxopt: {self.adapter.model_name}: a LoRA adapter was merged into weights amxopt.optimize packed "
                f"and released, which changed nothing, and the model changed since: {_LOST_MERGE_ADVICE}"
            )
            raise RuntimeError(self.__dict__["_lost_merge"])
        _forget_packings(merged)

    @torch.compiler.disable  # (under torch.compile of this module: run as Python, not traced)
    def _check_source(self) -> None:
        """What changed in the source since the graphs were captured and no hook saw: an adapter's
        state, a weight written in place; the graphs are dropped (or the change refused)."""
        if "_lost_merge" in self.__dict__:
            raise RuntimeError(self.__dict__["_lost_merge"])
        if self._adapters is not None and self._adapters[0]:
            self._check_adapters()
        for name, p, version, dtype in self._placeholders:
            if packed.version(p) != version or p.dtype != dtype:
                what = "written in place" if packed.version(p) != version else f"cast to {p.dtype}"
                raise RuntimeError(
                    f"amxopt: {self.adapter.model_name}: {name} was {what} after amxopt.optimize packed it and "
                    "released its source (one copy in memory), which changed nothing: the graphs still run the "
                    f"packed {dtype} values. Change the model before amxopt.optimize (load new weights into a "
                    "fresh one, or cast it), or optimize with AmxConfig(keep_source=True)"
                )
        if self._changed():
            # Seen again under the capture lock: what another thread's capture does to the source while
            # it holds the lock (stand-ins while it exports in process, its weights released before it
            # settles them) is not a change, and dropping its graph under it failed the capture.
            with self._lock():
                if self._changed():
                    self._drop_graphs()

    def _changed(self) -> bool:
        """Whether the source changed since the capture in what no hook sees; raises for ``.train()``."""
        if any(p._version != v or p.data_ptr() != d or ref.expired() for p, v, d, ref in self._packed_versions):
            return True
        traced = self._traced
        if traced is None or not traced.changed(self.__dict__["_source"]):
            return False
        self._refuse_trained()
        return True

    def _refuse_trained(self) -> None:
        """Refuse a call where a module of the source in eval mode at optimize() or a capture is in
        training mode now: ``.train()`` on the source or a layer of it, which this module's flag does
        not see (a layer added since is in training mode as built: not refused)."""
        was_eval = self.__dict__["_eval_modules"]
        path = next((p for p, m in self.__dict__["_source"].named_modules() if m.training and m in was_eval), None)
        if path is not None:
            self._refuse_training(f"{self.adapter.model_name}{'.' if path else ''}{path}")

    def _lock(self) -> threading.RLock:
        return _CAPTURING.setdefault(self, threading.RLock())

    def _check_adapters(self) -> None:
        """Capture again when a peft adapter's state changed since the graphs were captured (they hold
        its scale, active adapters and merges as constants). A merge (``fuse_lora``) wrote the base
        weights in place, so those are packed again; a merge into released weights changed nothing
        and is refused until it is undone."""
        if _adapter_state(self._adapters[0]) == self._adapters[1]:
            return
        self._refuse_at_tp()
        if any(weights.has_released(layer) for layer in _merged_since(self._adapters)):
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name}: a LoRA adapter was merged into (or unmerged from) weights "
                f"amxopt.optimize packed and released, which changed nothing: undo it (unfuse_lora / fuse_lora). "
                f"{_LOST_MERGE_ADVICE}"
            )
        self._drop_graphs()

    @property
    def _graphs(self) -> list[GraphEntry]:
        if self._pending:
            # Under the capture lock: a second thread's first call after load() found nothing pending
            # and no graph while the first restored it, and captured again.
            with self._lock():
                while self._pending:
                    self._add(self._pending.pop(0)())
        return self._entries

    def defer(self, restore: Callable[[], GraphEntry]) -> None:
        """Add a stored graph that ``restore`` rebuilds at its first use (a call, ``report``, ``graphs``)."""
        self._snapshot()  # now, as the stored graph was made: a hook added before its first use is a change
        self._pending.append(restore)

    def _snapshot(self) -> None:
        """Note the source's hooks, processors and forwards (:class:`_Traced`) as a capture sees them,
        warning about those it traces; kept until the graphs are dropped."""
        if self._traced is None:
            self._traced = _Traced(self.__dict__["_source"])
            self._traced.warn(self.__dict__["_source"], self.adapter.model_name)
            self.__dict__["_eval_modules"].update(m for m in self.__dict__["_source"].modules() if not m.training)

    def _add(self, graph: GraphEntry) -> None:
        if not self._entries:  # a submodule: its packed weights are among the module's buffers
            self._modules["graph_module"] = graph.captured.gm
        if self._adapters is None:
            modules = self._watch_loads(self.__dict__["_source"])  # and modules added since (LoRA layers)
            layers = _adapter_layers(modules)
            self._adapters = (layers, _adapter_state(layers))
        self._snapshot()  # (optimize()'s first capture; a recapture took it before capturing)
        self._entries.append(graph)
        if not self.amx_config.keep_source:
            # Weights some graph still reads unpacked (a node autotune kept on ATen) stay, and so do
            # adapters' own (LoRA's A and B: rank x K, small), which peft reads to merge, combine or
            # save them (on a placeholder its add_weighted_adapter failed halfway, leaving a broken adapter).
            keep = {id(t) for g in self._entries for t in (*g.captured.gm.parameters(), *g.captured.gm.buffers())}
            keep.update(id(p) for layer in self._adapters[0] for p in _adapter_weights(layer))
            freed = weights.release(self.__dict__["_source"], keep)
            self._traced.settle()  # (the placeholders are amxopt's own change)
            if freed:
                self.__dict__["_released_here"] = True  # (not by from_pretrained or load, which pack as they read)
                logger.info("amxopt: released %.1f MB of packed source weights", freed / 2**20)
        # Packed weights that stayed (all with keep_source; else those a graph also reads unpacked, as
        # a tied embedding, or packs in a computed form, as w.t(); a buffer, never released): after
        # release, which gave them storage of their own. Under tensor parallelism every weight and
        # buffer: the other ranks read their own copies (and rank 0 its shards), which a change here
        # does not reach.
        source = self.__dict__["_source"]
        every = self.amx_config.tp != 1
        self._packed_versions = [
            (p, p._version, p.data_ptr(), packed.StorageRef(p))
            for p in itertools.chain(source.parameters(), source.buffers())
            if not p.is_inference()
            and not packed.is_released(p)
            and (every or packed.packings(p) or packed.is_derived(p))
        ]
        # Released placeholders: a write into one (copy_, mul_ under no_grad) or a cast of the model
        # (model.to(bf16)) changes only the meta placeholder; the next call refuses, saying so.
        self._placeholders = [
            (n, p, packed.version(p), p.dtype)
            for n, p in self.__dict__["_source"].named_parameters()
            if packed.is_released(p)
        ]

    def save(self, directory: str) -> Any:
        """Write the packed weights and a manifest to ``directory``; :func:`amxopt.load` reads them back."""
        from amxopt.runtime.loading import save

        captured = bool(self._entries or self._pending)
        self._check_source()
        if captured and not (self._entries or self._pending):
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name} changed since its graphs were captured (a weight written in "
                "place, an adapter, a module): call it once, which captures and packs it again, then save"
            )
        return save(self, directory)

    def profile(self, example_inputs: Any, repeats: int = 3, by_shape: bool = False) -> Profile:
        """Where a call on ``example_inputs`` spends its time, per op of the rewritten graph.

        Args:
            example_inputs: as for :func:`amxopt.optimize`: a tuple of positional args, a dict of
                kwargs or a single tensor.
            repeats: timed runs; the rows are those of the run of median total.
            by_shape: one row per op and input shapes instead of per op.

        Returns:
            A :class:`~amxopt.runtime.profile.Profile`; ``print(profile)`` shows the table. Of a
            call the model runs in parts (the Omni audio tower's past ``conv_chunksize`` chunks),
            every part profiled and the rows of each op summed.

        Example::

            opt = amxopt.optimize(model, inputs)
            print(opt.profile(inputs))
        """
        args, kwargs = split_inputs(example_inputs)
        with torch.no_grad():  # (as the timed runs: grad enabled only warns that the output has none)
            self(*args, **kwargs)  # captures (or re-captures) the graph this call runs
            if self.eager_reason is not None:
                raise RuntimeError(
                    f"amxopt profile: {self.adapter.model_name} runs as eager PyTorch ({self.eager_reason})"
                )
            parts = self._graph_calls(args, kwargs)[2]
        profiles = []
        for graph_inputs in parts:
            graph = next(g for g in self._graphs if _accepts(g, graph_inputs))
            profiles.append(profile_graph(graph.captured.gm, graph_inputs, repeats=repeats, by_shape=by_shape))
        return Profile.merged(profiles)

    @property
    def device(self) -> torch.device:
        # amxopt runs on the CPU; the source's first parameter may be a released (meta) placeholder.
        return torch.device("cpu")

    def __getattr__(self, name: str) -> Any:
        # Drop-in: what callers read from the original model (dtype, device, config,
        # spatial_merge_size, cache_context, ...) comes from it.
        if name in _CAPTURED_ONLY:  # its property raised _NotCaptured: that error again, not the source's
            self._first_graph(_CAPTURED_ONLY[name])
        try:
            return super().__getattr__(name)
        except AttributeError:
            source = self.__dict__.get("_source")
            if source is None:
                raise
            value = getattr(source, name)
            if name in HOTSWAP_LOADERS and callable(value):
                return functools.partial(self.hotswap_watched, value)
            return value

    def __setattr__(self, name: str, value: Any) -> None:
        # Drop-in, as reads are: assigning what the source owns (``pipe.transformer.proj_out = ...``;
        # peft putting a LoRA layer on a direct child of a tower) changes the source, where _LoadWatch
        # sees it and the next call captures again. Kept here, it was read back but never run.
        if self._source_owns(name):
            setattr(self.__dict__["_source"], name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if self._source_owns(name):
            delattr(self.__dict__["_source"], name)
        else:
            super().__delattr__(name)

    def _source_owns(self, name: str) -> bool:
        """Whether ``name`` is the source's (a submodule, parameter, buffer or attribute of its own)
        and not this module's."""
        source = self.__dict__.get("_source")
        if source is None or name in self.__dict__ or hasattr(type(self), name):
            return False
        if name in self._modules:  # (its parameters and buffers are the source's own)
            return False
        return any(name in d for d in (source.__dict__, source._modules, source._parameters, source._buffers))

    def hotswap_watched(self, load: Callable, *args: Any, **kwargs: Any) -> Any:
        """``load(*args, **kwargs)``, an adapter loader of the source; with ``hotswap=True`` peft writes
        the loaded adapter's weights in place through ``.data``, which no version counter or hook
        sees: the adapter layers are packed and captured again (refused where they were released)."""
        if not kwargs.get("hotswap"):
            return load(*args, **kwargs)
        self._refuse_at_tp()
        layers = _adapter_layers(self.__dict__["_source"].modules())
        if any(weights.has_released(layer) for layer in layers):
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name}: a hotswap writes the adapter's weights in place, and "
                f"amxopt.optimize packed and released them: {_LOST_MERGE_ADVICE}"
            )
        try:
            return load(*args, **kwargs)
        finally:
            _forget_packings(layers)
            self._drop_graphs()

    @property
    def report(self) -> Report:
        return self._first_graph(_CAPTURED_ONLY["report"]).report

    @property
    def graph_module(self) -> fx.GraphModule:
        return self._first_graph(_CAPTURED_ONLY["graph_module"]).captured.gm

    def _first_graph(self, reading: str) -> GraphEntry:
        if not self._graphs:
            raise _NotCaptured(
                f"amxopt: {self.adapter.model_name} is captured at its first call (optimize() had no example "
                f"inputs, or the model changed since): call it once, or pass example inputs to optimize(), before "
                f"reading {reading}"
            )
        return self._graphs[0]

    @property
    def reports(self) -> list[Report]:
        """The rewrite report of each graph, in the order of ``graphs`` (``report`` is the first's: a
        call a graph could not take was captured again, and its graph may differ)."""
        return [g.report for g in self._graphs]

    @property
    def graphs(self) -> list[fx.GraphModule]:
        return [g.captured.gm for g in self._graphs]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.eager_reason is not None:
            if self._traced is None or not self._traced.changed(self.__dict__["_source"]):
                return self._run_eagerly(args, kwargs)
            # The hooks, processors or forwards that the failed capture saw changed (the hook that
            # export could not trace was removed): capture again rather than run eagerly for good.
            self.eager_reason, self._traced = None, None
        if torch.is_autocast_enabled("cpu"):
            # The graphs compute in the dtypes they were captured in, on weights packed for them:
            # autocast would hand their ATen nodes other dtypes than their amxopt ops take.
            asked, own = torch.get_autocast_dtype("cpu"), self._dtype()
            if asked != own and not self.__dict__.get("_told_autocast"):
                self.__dict__["_told_autocast"] = True
                logger.warning(
                    "amxopt: %s runs in %s as optimized, not in torch.autocast's %s (its weights are packed for "
                    "%s): to run in %s, cast the model to it before amxopt.optimize",
                    self.adapter.model_name,
                    own,
                    asked,
                    own,
                    asked,
                )
            with torch.autocast("cpu", enabled=False):
                return self._run(args, kwargs)
        return self._run(args, kwargs)

    def _run(self, args: tuple, kwargs: dict) -> Any:
        self._check_source()
        call, options, parts = self._graph_calls(args, kwargs)
        outputs = []
        with torch.no_grad():
            for graph_inputs in parts:
                graph = next((g for g in self._graphs if _accepts(g, graph_inputs)), None)
                if graph is None:
                    with self._lock():
                        graph = self._capture_for(graph_inputs, call)
                    if graph is None:
                        return self._run_eagerly(args, kwargs)
                outputs.append(graph.captured.gm(**graph_inputs))
            return self.adapter.format_output(self.adapter.join(outputs), options)

    def _graph_calls(self, args: tuple, kwargs: dict) -> tuple[dict, dict, list[dict]]:
        """A call's arguments by name, its output options and the graph inputs of its parts
        (``Adapter.split``), checked."""
        call = self.adapter.bind(args, kwargs)
        options = self.adapter.output_options(call)
        parts = [self.adapter.graph_inputs(part) for part in self.adapter.split(call)]
        for graph_inputs in parts:
            self._check_call(graph_inputs)
        return call, options, parts

    @torch.compiler.disable  # (under torch.compile of this module: run as Python, not traced)
    def _capture_for(self, graph_inputs: dict, call: dict) -> GraphEntry | None:
        """A graph for a call (``call``, the caller's arguments) no graph took: another thread's
        capture of the same shapes, done while this one waited for it, else a new capture; None
        where the call runs eagerly."""
        graph = next((g for g in self._graphs if _accepts(g, graph_inputs)), None)
        if graph is None:
            if self.eager_reason is not None:  # another thread's capture failed meanwhile
                return None
            try:
                graph = self._recapture(graph_inputs, call)
            except CaptureError as e:
                refusal = self._dtype_refusal(graph_inputs, e)
                if refusal is not None:
                    # the next call in these dtypes is refused at once (no export; at tp, before any rank runs)
                    self.__dict__.setdefault("_refused_dtypes", {})[_input_dtypes(graph_inputs)] = refusal
                    raise TypeError(refusal) from e
                if not self.eager_fallback or self._graphs:
                    raise
                source = self.__dict__["_source"]
                if self.__dict__.get("_released_here"):
                    raise CaptureError(
                        f"{e}; it cannot run as eager PyTorch either: amxopt.optimize packed its weights and "
                        "released their source (one copy in memory). Optimize it with "
                        "AmxConfig(keep_source=True) to keep the eager fallback"
                    ) from e
                if weights.has_released(source):
                    # from_pretrained / load packed its weights as they were read: no eager copy
                    raise CaptureError(
                        f"{e}; it cannot run as eager PyTorch either: its weights were packed as they were "
                        f"loaded (amxopt.from_pretrained or amxopt.load). Load {type(source).__name__} with "
                        "its own from_pretrained and pass it to amxopt.optimize, which keeps the eager "
                        "fallback"
                    ) from e
                self.eager_reason = str(e)
                logger.warning("%s; it runs as eager PyTorch", e)
        return graph

    def _run_eagerly(self, args: tuple, kwargs: dict) -> Any:
        """The source's own call, where export could not capture it; what the call itself changes
        (hooks it installs) is not a change that makes the next call try to capture again."""
        source = self.__dict__["_source"]
        out = source(*args, **kwargs)
        self._traced = _Traced(source)
        return out

    def check_inputs(self, *args: Any, **kwargs: Any) -> None:
        """Raise what a call with these arguments would raise before running anything: arguments
        the model does not take, an input that requires grad or in dtypes a capture failed on
        before, a change to the source a graph cannot follow."""
        if self.eager_reason is None:
            self._check_source()  # a tensor-parallel module refuses a change here, before any rank runs
            self._graph_calls(args, kwargs)

    def _refuse_training(self, where: str) -> None:
        raise RuntimeError(
            f"amxopt: {where} is in training mode (.train() was called after optimize), and "
            f"{self.adapter.model_name}'s graphs compute inference (no dropout, no gradients): call .eval() on it"
        )

    def _argument(self, path: str) -> str:
        """The caller's name for a graph input or a tensor inside one (``extra[0]``)."""
        name = re.match(r"[^[.]*", path).group()  # (up to the path inside it: pytree's `[0]`, `['k']`, `.a`)
        return self.adapter.arguments.get(name, name) + path[len(name) :]

    def _check_call(self, graph_inputs: dict) -> None:
        if self.training:
            self._refuse_training(self.adapter.model_name)
        if self._traced is None:  # (no capture yet, or its graphs dropped: _changed() compared no flags)
            self._refuse_trained()
        refused = self.__dict__.get("_refused_dtypes", {}).get(_input_dtypes(graph_inputs))
        if refused is not None:
            raise TypeError(refused)
        if torch.is_grad_enabled():
            wants_grad = [k for k, v in _tensor_leaves(graph_inputs).items() if v.requires_grad]
            if wants_grad:
                arg = self._argument(wants_grad[0])
                raise RuntimeError(
                    f"amxopt: {self.adapter.model_name} runs inference only, and {arg} requires grad: call "
                    "it under torch.no_grad() or with a detached input"
                )
            if not self.__dict__.get("_told_no_grad") and any(
                p.requires_grad for p in self.__dict__["_source"].parameters()
            ):
                # Eager's output would carry a gradient to the parameters; the graphs' does not.
                self.__dict__["_told_no_grad"] = True
                logger.warning(
                    "amxopt: %s was called with grad enabled and parameters that require grad; its graphs "
                    "compute inference, so the output carries no gradient (backward() through it fails): call it "
                    "under torch.no_grad() or torch.inference_mode()",
                    self.adapter.model_name,
                )

    def _dtype_refusal(self, graph_inputs: dict, error: Exception) -> str | None:
        """Why a call whose capture failed is refused, where an input the graphs took in a floating
        dtype comes in a dtype no graph took: a call in another dtype is captured again, as eager
        takes it (a bf16 Omni tower takes the processor's fp32 features and bf16 ones; Wan an integer
        timestep after a float one); where eager cannot run it either (fp32 latents into a bf16 Wan,
        int64 ones into any), the capture's error is told as the input's dtype. Integer inputs
        (ids, lengths) change between int32 and int64 and say nothing of why a capture failed."""
        leaves, took, got = _tensor_leaves(graph_inputs), [], []
        for name, dtype in self._graphs[0].dtypes.items() if self._graphs else ():
            tensor = leaves.get(name)
            # every such input: the graph may not say which one eager would refuse (a dtype read
            # through type_as is a constant in it)
            if (
                tensor is not None
                and dtype.is_floating_point
                and all(g.dtypes.get(name) != tensor.dtype for g in self._graphs)
            ):
                took.append((self._argument(name), dtype))
                got.append(tensor.dtype)
        if not took:
            return None
        wanted = " and ".join(f"{arg} in {dtype}" for arg, dtype in took)
        given = " and ".join(map(str, got))
        casts = " and ".join(f"{arg} to {dtype}" for arg, dtype in took)
        return (
            f"amxopt: {self.adapter.model_name} was optimized for {wanted}, got {given}, and its capture in "
            f"{given} failed (cast {casts}): {error}"
        )

    def _recapture(self, graph_inputs: dict, call: dict) -> GraphEntry:
        model = self.__dict__["_source"]
        self._settle_merges()
        # the caller's arguments, not the graph's (the Omni audio tower's input_features, not padded_feature)
        shapes = {k: tuple(v.shape) for k, v in _tensor_leaves(call).items()}
        if len(self._graphs) >= self.amx_config.max_recaptures:
            count = f"{len(self._graphs)} graph{'s' if len(self._graphs) != 1 else ''}"
            raise RuntimeError(
                f"amxopt: {self.adapter.model_name}: {count} cached and none accepts a call with tensors "
                f"{shapes} (AmxConfig(max_recaptures=...) allows more)"
            )
        logger.info("amxopt: re-capturing %s for a call with tensors %s", self.adapter.model_name, shapes)
        self._snapshot()
        # Dynamic where the config says so, as the first: a call the first graph cannot take is often
        # one of many like it (a batch-1 example's graph fixes the batch at 1: the next graph takes
        # every larger batch). Export falls back to a static capture where a dynamic one fails.
        graph = build_graph(model, self.adapter, graph_inputs, self.amx_config)
        self._add(graph)
        return graph


def _input_dtypes(graph_inputs: dict) -> tuple:
    return tuple(_tensor_dtypes(graph_inputs).items())


def _accepts(graph: GraphEntry, graph_inputs: dict) -> bool:
    if _signature(graph_inputs) != graph.signature:
        return False
    # export's guards check sizes, not dtypes: a graph traced on a float timestep is not one for an int
    if any(graph.dtypes.get(k, dtype) != dtype for k, dtype in _tensor_dtypes(graph_inputs).items()):
        return False
    try:
        graph.captured.check(graph_inputs)
    except AssertionError as e:  # export's guards: "Guard failed: ..."
        logger.debug("amxopt: graph rejects the call: %s", e)
        return False
    return True
