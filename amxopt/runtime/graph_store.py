"""A rewritten graph as data: stored in an artifact (``opt.save``) and in the on-disk graph cache.

A graph after the passes is a flat list of ``torch.ops`` calls, reads of weights (``get_attr``) and
a few integer ops on sizes. It is written as JSON: each node's op, target and arguments, where a
target is named (``aten::linear.default``, ``operator.mul``) and resolved on reading against a fixed
vocabulary (``torch.ops`` and an allow-list), so reading a stored graph runs no stored code and
unpickles nothing. Export's input guards are kept as expressions over the flat inputs and checked
by a small evaluator of the same vocabulary.

Weights are not in the entry: a ``get_attr`` names the source module's tensor by its qualified
name, and a packed buffer names the source weight it packs (re-packed, or taken from the packing
the source carries, when the graph is read). A tensor that is neither (a constant export lifted, a
packing of a transformed weight) goes to ``tensors``; the graph cache refuses graphs that need a
transformed weight's packing, since it would go stale when the weights change.

Why not ``torch.export.save``: it would re-trace the rewritten graph to build an ExportedProgram,
write every weight into its own archive (a second copy beside the packed safetensors), and rebuild
fake tensors for every node on load, which is the cost the cache exists to avoid.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import dis
import functools
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import math
import operator
import os
import pathlib
import re
import sys
import sysconfig
import threading
import types
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch._functorch import predispatch
from torch.fx.graph import _PyTreeCodeGen, _PyTreeInfo

from amxopt.capture import Captured
from amxopt.capture.repeated import MODULE_INTERNALS, hooked
from amxopt.config import AmxConfig
from amxopt.files import os_error, replacing, save_tensors
from amxopt.ops import library, native, packed
from amxopt.passes import PassRecord, _autotune
from amxopt.passes._graph import fetch
from amxopt.passes.pack_weights import DERIVED_FROM, PACKED_PREFIX
from amxopt.runtime import weights
from amxopt.runtime.report import Entry, Report

logger = logging.getLogger(__name__)

FORMAT = 1  # of a stored graph; bump when the encoding changes

_FUNCTIONS = {
    f"operator.{f.__name__}": f
    for f in (operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv, operator.truediv,
              operator.mod, operator.pow, operator.neg, operator.eq, operator.ne, operator.lt, operator.le,
              operator.gt, operator.ge, operator.and_, operator.or_, operator.not_)
} | {
    f"math.{f.__name__}": f for f in (math.floor, math.ceil, math.sqrt, math.trunc)
} | {
    f"torch.{f.__name__}": f for f in (torch.sym_max, torch.sym_min, torch.sym_float, torch.sym_int, torch.sym_not,
                                       torch.sym_ite, torch.sym_sum)
} | {  # a vmap as export writes it (its level counter and batch dims; passes/_graph.py keeps them)
    f"torch._functorch.predispatch.{f.__name__}": f
    for f in (predispatch.lazy_load_decompositions, predispatch._vmap_increment_nesting,
              predispatch._vmap_decrement_nesting, predispatch._add_batch_dim, predispatch._remove_batch_dim)
}  # fmt: skip
_FUNCTION_NAMES = {f: name for name, f in _FUNCTIONS.items()}
_RESTORED = "graph restored from "  # how a restored graph's report note begins


class GraphStoreError(ValueError):
    """A graph that cannot be stored, or a stored graph that cannot be read back."""


@dataclasses.dataclass
class GraphEntry:
    """One graph of an OptimizedModule: captured (or restored) and rewritten, with what selects it."""

    captured: Captured
    dtypes: dict[str, torch.dtype]  # tensor graph inputs and the dtype they were captured with
    signature: tuple  # input structure and non-tensor values, which export bakes into the graph
    report: Report
    records: list[PassRecord]


# --------------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------------


def dump(graph: GraphEntry, module: nn.Module, for_cache: bool, live: bool) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON entry of ``graph`` and the tensors it needs besides ``module``'s.

    ``module`` is the module that was exported (the adapter's ``export_module``): its tensors, and
    the packings they carry, are referred to by name. ``for_cache`` refuses a packing of a
    transformed weight (see the module doc). ``live``: the graph is restored onto this module or
    one built alike in code (the graph cache, an isolated capture's parent), so a plain tensor
    attribute (``self.table = torch.randn(n)``, neither parameter nor buffer) is referred to by
    name too, read where the graph is restored: another model's value, or this one's as it is
    changed in place. Otherwise (an artifact, whose model is built anew) its value is stored.

    Raises:
        GraphStoreError: a node, value or guard outside what a stored graph can express.
    """
    gm = graph.captured.gm
    if graph.captured.guard_code is None:
        raise GraphStoreError("export's input guards could not be read")
    for code in graph.captured.guard_code:
        _parse_guard(code)
    names, packings = _tensor_names(module, attributes=live)
    attrs: dict[str, dict] = {}
    tensors: dict[str, torch.Tensor] = {}
    nodes = []
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            t = fetch(gm, node.target)
            if not isinstance(t, torch.Tensor):  # a subgraph (flex attention's score_mod, a cond's branch)
                raise GraphStoreError(f"node {node.name}: reads {type(t).__name__} {node.target}, not a tensor")
            entry = {"shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
            if id(t) in names:
                entry["source"] = names[id(t)]
            elif id(t) in packings:
                entry["packs"], entry["provider"] = packings[id(t)]
            elif for_cache and node.target.startswith(PACKED_PREFIX + "."):
                raise GraphStoreError(f"{node.target} packs a transformed weight: it would go stale with other weights")
            else:
                entry["stored"] = node.target
                tensors[node.target] = t.detach().contiguous()
                if DERIVED_FROM in node.meta:  # where it is restored, those weights are watched for writes
                    entry["derived_from"] = node.meta[DERIVED_FROM]
            attrs[node.target] = entry
        elif node.op not in ("placeholder", "call_function", "output"):
            raise GraphStoreError(f"node {node.name}: {node.op} nodes are not stored")
        target = _target_name(node) if node.op == "call_function" else node.target
        nodes.append([node.op, node.name, target, _encode(node.args, node), _encode(node.kwargs, node)])
    codegen = gm.graph._codegen
    if not isinstance(codegen, _PyTreeCodeGen):
        raise GraphStoreError(f"the graph's calling convention ({type(codegen).__name__}) is not stored")
    info = codegen.pytree_info
    spec, constants = graph.signature
    try:
        entry = {
            "format": FORMAT,
            "orig_args": list(info.orig_args),
            "in_spec": pytree.treespec_dumps(info.in_spec),
            "out_spec": pytree.treespec_dumps(info.out_spec),
            "nodes": nodes,
            "attrs": attrs,
            "guards": list(graph.captured.guard_code),
            "dynamic": graph.captured.dynamic,
            "note": graph.captured.note,
            "dtypes": {k: _dtype_name(v) for k, v in graph.dtypes.items()},
            "signature": [pytree.treespec_dumps(spec), list(constants)],
            "report": dataclasses.asdict(graph.report),
            "passes": [[r.name, r.modified] for r in graph.records],
        }
        json.dumps(entry)
    except (TypeError, ValueError, NotImplementedError) as e:
        raise GraphStoreError(f"a value of the graph is not storable: {e}") from None
    return entry, tensors


def _tensor_names(module: nn.Module, attributes: bool) -> tuple[dict[int, str], dict[int, tuple[str, str]]]:
    """``module``'s tensors by identity (with ``attributes``: its plain tensor attributes too), and
    the packings they carry: ``id -> (name, provider)``."""
    names: dict[int, str] = {}
    packings: dict[int, tuple[str, str]] = {}
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    if attributes:
        named += [
            (f"{path}.{k}" if path else k, v)
            for path, sub in module.named_modules(remove_duplicate=False)
            for k, v in vars(sub).items()
            if isinstance(v, torch.Tensor)
        ]
    for name, t in named:
        names.setdefault(id(t), name)
        for provider, p in packed.packings(t).items():
            packings.setdefault(id(p), (name, provider))
    return names, packings


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t._schema.name}.{t._overloadname or 'default'}"
    if t in _FUNCTION_NAMES:
        return _FUNCTION_NAMES[t]
    raise GraphStoreError(f"node {node.name}: target {t!r} is outside the stored vocabulary")


def _encode(value: Any, node: fx.Node) -> Any:
    if isinstance(value, fx.Node):
        return {"node": value.name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, (list, tuple)):
        items = [_encode(v, node) for v in value]
        return items if isinstance(value, list) else {"tuple": items}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise GraphStoreError(f"node {node.name}: a dict argument with non-string keys")
        return {"dict": {k: _encode(v, node) for k, v in value.items()}}
    if isinstance(value, torch.dtype):
        return {"dtype": _dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, (torch.layout, torch.memory_format)):
        return {type(value).__name__: str(value).removeprefix("torch.")}
    if isinstance(value, slice):
        return {"slice": [_encode(v, node) for v in (value.start, value.stop, value.step)]}
    raise GraphStoreError(f"node {node.name}: argument {value!r} ({type(value).__name__}) is not storable")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------


def check(entry: dict) -> None:
    """The cheap part of :func:`restore`: the format, and every target and guard in the vocabulary.

    Raises:
        GraphStoreError: what :func:`restore` would refuse for the same reason.
    """
    if entry.get("format") != FORMAT:
        raise GraphStoreError(f"stored graph format {entry.get('format')} (this amxopt reads {FORMAT})")
    ops = [node[0] for node in entry["nodes"]]
    if ops.count("output") != 1 or ops[-1] != "output":
        raise GraphStoreError(f"stored graph has {ops.count('output')} output node(s), not one at its end")
    for op, _, target, _, _ in entry["nodes"]:
        if op == "call_function":
            _resolve(target)
    for code in entry["guards"]:
        _parse_guard(code)


def restore(
    entry: dict,
    module: nn.Module,
    provider: str,
    tensors: Mapping[str, torch.Tensor],
    origin: str,
    timed_now: bool = False,
) -> GraphEntry:
    """Rebuild a graph written by :func:`dump` on ``module`` (the module that was exported).

    ``origin`` (where the entry came from) becomes a note of the report. Its kernel choices are
    labelled ``[cached]`` (timed by the process that stored the graph), unless ``timed_now`` (an
    isolated capture's child rewrote it for this very optimize).

    A packed buffer comes from the packing the source weight carries for its provider (loaded from
    an artifact, or made by another graph), else it is packed now and remembered on the source.

    Raises:
        GraphStoreError: the entry does not fit ``module`` (a missing tensor, another shape) or
            names a target outside the vocabulary.
    """
    check(entry)
    root = nn.Module()
    for target, spec in entry["attrs"].items():
        _set_attr(root, target, _restore_attr(target, spec, module, tensors))
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    for op, name, target, args, kwargs in entry["nodes"]:
        args, kwargs = _decode(args, env), _decode(kwargs, env)
        if op == "call_function":
            node = graph.call_function(_resolve(target), tuple(args), kwargs)
        elif op == "placeholder":
            node = graph.placeholder(target)
        elif op == "get_attr":
            node = graph.get_attr(target)
        else:
            node = graph.output(args[0])
        node.name = name
        env[name] = node
    graph._codegen = _PyTreeCodeGen(
        _PyTreeInfo(
            entry["orig_args"], pytree.treespec_loads(entry["in_spec"]), pytree.treespec_loads(entry["out_spec"])
        )
    )
    graph.lint()
    gm = fx.GraphModule(root, graph)
    report = entry["report"]
    report["replaced"] = [Entry(**e) for e in report["replaced"]]
    report["left"] = [Entry(**e) for e in report["left"]]
    report["passes"] = [tuple(p) for p in report["passes"]]
    report["choices"] = [
        (w, t if timed_now or t.endswith(" [cached]") else f"{t} [cached]") for w, t in report["choices"]
    ]
    # One origin: a graph stored after it was itself restored (from the capture child, then the cache, then an
    # artifact) carries the earlier origin's note, which this one replaces.
    earlier = [n for n in report["notes"] if not n.startswith(_RESTORED)]
    report["notes"] = [*earlier, f"{_RESTORED}{origin}: not captured or rewritten in this process"]
    spec, constants = entry["signature"]
    captured = Captured(gm, entry["dynamic"], GuardCheck(entry["guards"]), entry["note"], list(entry["guards"]))
    return GraphEntry(
        captured=captured,
        dtypes={k: getattr(torch, v) for k, v in entry["dtypes"].items()},
        signature=(pytree.treespec_loads(spec), tuple(constants)),
        report=Report(**report),
        records=[PassRecord(n, m, "", "") for n, m in entry["passes"]],
    )


def _restore_attr(target: str, spec: dict, module: nn.Module, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    if "stored" in spec:
        if spec["stored"] not in tensors:
            raise GraphStoreError(f"tensor {spec['stored']} of the stored graph is missing")
        t = tensors[spec["stored"]]
        for name in spec.get("derived_from", ()):
            with contextlib.suppress(AttributeError):  # (an artifact of a model that no longer has it)
                packed.mark_derived(_get_tensor(module, name))
    else:
        name = spec.get("source", spec.get("packs"))
        try:
            source = _get_tensor(module, name)
        except AttributeError:
            raise GraphStoreError(f"{type(module).__name__} has no tensor {name} (read by {target})") from None
        if "source" in spec:
            if packed.is_released(source) or source.device.type == "meta":
                # released since (a model built by from_pretrained packs as it reads): no unpacked copy
                raise GraphStoreError(f"{name} was released (only its packing is kept), and {target} reads it unpacked")
            t = source
        else:
            t = packed.packed_for(source, spec["provider"])
            if t is None:
                if packed.is_released(source):
                    raise GraphStoreError(f"{name} was released without a packing for {spec['provider']!r}")
                if source.device.type == "meta":
                    raise GraphStoreError(f"{name} is on the meta device: no values to pack for {target}")
                t = weights.pack(source, spec["provider"])
                packed.remember(source, spec["provider"], t)
    if list(t.shape) != spec["shape"] or _dtype_name(t.dtype) != spec["dtype"]:
        raise GraphStoreError(
            f"{target}: the stored graph reads {spec['dtype']}{spec['shape']}, found {_dtype_name(t.dtype)}{list(t.shape)}"
        )
    return t


def _get_tensor(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    t = getattr(module.get_submodule(owner) if owner else module, attr)
    if not isinstance(t, torch.Tensor):
        raise AttributeError(name)
    return t


def _set_attr(root: nn.Module, target: str, t: torch.Tensor) -> None:
    *path, attr = target.split(".")
    for part in path:
        if not hasattr(root, part):
            root.add_module(part, nn.Module())
        root = getattr(root, part)
    if isinstance(t, nn.Parameter):
        root.register_parameter(attr, t)
    else:
        root.register_buffer(attr, t)


def _resolve(name: str) -> Any:
    if name in _FUNCTIONS:
        return _FUNCTIONS[name]
    qualified, _, overload = name.rpartition(".")
    namespace, _, op = qualified.partition("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError):
        raise GraphStoreError(f"the stored graph calls {name}, which this torch/amxopt does not have") from None


def _decode(value: Any, env: dict[str, fx.Node]) -> Any:
    if isinstance(value, list):
        return [_decode(v, env) for v in value]
    if not isinstance(value, dict):
        return value
    ((kind, v),) = value.items()
    if kind == "node":
        return env[v]
    if kind == "tuple":
        return tuple(_decode(x, env) for x in v)
    if kind == "dict":
        return {k: _decode(x, env) for k, x in v.items()}
    if kind == "float":
        return float(v)
    if kind == "dtype":
        return _torch_value(v, torch.dtype)
    if kind in ("layout", "memory_format"):
        return _torch_value(v, torch.layout if kind == "layout" else torch.memory_format)
    if kind == "device":
        return torch.device(v)
    if kind == "slice":
        return slice(*(_decode(x, env) for x in v))
    raise GraphStoreError(f"unknown value kind {kind!r} in a stored graph")


def _torch_value(name: str, kind: type) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise GraphStoreError(f"{name!r} is not a torch {kind.__name__}")
    return value


# --------------------------------------------------------------------------------------------------
# Guards: export's checks, evaluated without code
# --------------------------------------------------------------------------------------------------

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.FloorDiv: operator.floordiv,
           ast.Mod: operator.mod, ast.Pow: operator.pow, ast.Div: operator.truediv}  # fmt: skip
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}  # fmt: skip
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Not: operator.not_}
_CALLS = {"max": max, "min": min, "abs": abs}
_METHODS = ("size", "stride", "storage_offset", "dim")


@functools.lru_cache(maxsize=4096)
def _parse_guard(code: str) -> ast.Expression:
    try:
        tree = ast.parse(code, mode="eval")
    except (SyntaxError, ValueError) as e:  # (ValueError: a null byte)
        raise GraphStoreError(f"guard {code!r} is not an expression ({e.msg if isinstance(e, SyntaxError) else e})")
    # a tensor's method is called, with no arguments (args[0].size(), not args[0].size(0) or args[0].dim)
    calls = (n for n in ast.walk(tree) if isinstance(n, ast.Call))
    methods = {id(n.func) for n in calls if isinstance(n.func, ast.Attribute) and not (n.args or n.keywords)}
    for node in ast.walk(tree):
        ok = isinstance(node, (ast.Expression, ast.Constant, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Compare,
                               ast.Subscript, ast.Call, ast.Attribute, ast.Name, ast.Load, ast.And, ast.Or,
                               *_BINARY, *_COMPARE, *_UNARY))  # fmt: skip
        ok = ok and not (isinstance(node, ast.Name) and node.id not in ("args", *_CALLS))
        ok = ok and not (isinstance(node, ast.Attribute) and (node.attr not in _METHODS or id(node) not in methods))
        ok = ok and not (isinstance(node, ast.Call) and not isinstance(node.func, (ast.Name, ast.Attribute)))
        ok = ok and not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.keywords)
        ok = ok and not (isinstance(node, ast.Constant) and not isinstance(node.value, (int, float)))
        if not ok:
            raise GraphStoreError(f"guard {code!r}: {ast.unparse(node)} is outside what amxopt evaluates")
    return tree


def _evaluate(node: ast.AST, args: tuple) -> Any:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body, args)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return args
    if isinstance(node, ast.BinOp):
        return _BINARY[type(node.op)](_evaluate(node.left, args), _evaluate(node.right, args))
    if isinstance(node, ast.UnaryOp):
        return _UNARY[type(node.op)](_evaluate(node.operand, args))
    if isinstance(node, ast.BoolOp):
        values = (_evaluate(v, args) for v in node.values)
        return all(values) if isinstance(node.op, ast.And) else any(values)
    if isinstance(node, ast.Compare):
        left = _evaluate(node.left, args)
        for op, right_node in zip(node.ops, node.comparators):
            right = _evaluate(right_node, args)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, ast.Subscript):
        return _evaluate(node.value, args)[_evaluate(node.slice, args)]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return _CALLS[node.func.id](*(_evaluate(a, args) for a in node.args))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and not node.args:
        tensor = _evaluate(node.func.value, args)
        if not isinstance(tensor, torch.Tensor):
            raise AssertionError(f"Guard failed: {ast.unparse(node.func.value)} is not a tensor")
        return getattr(tensor, node.func.attr)()
    raise GraphStoreError(f"cannot evaluate {ast.unparse(node)}")


class GuardCheck:
    """Export's input guards of a stored graph: raises ``AssertionError`` (as export's do) when one fails."""

    def __init__(self, code: list[str]) -> None:
        self.code = [(c, _parse_guard(c)) for c in code]

    def __call__(self, *args: Any) -> None:
        for text, tree in self.code:
            try:
                ok = _evaluate(tree, args)
            except (IndexError, TypeError, ArithmeticError) as e:  # (a damaged entry's // 0)
                raise AssertionError(f"Guard failed: {text} ({e})") from None
            if not ok:
                raise AssertionError(f"Guard failed: {text}")


# --------------------------------------------------------------------------------------------------
# The on-disk graph cache
# --------------------------------------------------------------------------------------------------


def cache_key(module: nn.Module, adapter_name: str, graph_inputs: dict, config: AmxConfig) -> str | None:
    """What a cached graph depends on: amxopt's own code, the library versions, the CPU and tier,
    the exported module's structure, code, settings and tensor shapes, the call's structure, and
    the options. Weight values are not in it: a cached graph reads the weights it is restored on.

    ``None`` (do not cache) for a module with forward hooks: what a hook computes cannot be told
    from its name.
    """
    hooks = hooked(module)
    if hooks:
        logger.info("amxopt: graph cache not used: forward hooks on %s", ", ".join(p or "the model" for p in hooks))
        return None
    try:
        with _memo_scope():
            described, code, attention = _settings(module), _model_code(module), _attention_functions(module)
            configs = _model_config(module)
    except Exception as e:  # noqa: BLE001 - an attribute that cannot be read: no key, no cache
        logger.info("amxopt: graph cache not used: %s's settings cannot be described (%s)", type(module).__name__, e)
        return None
    leaves, spec = pytree.tree_flatten(graph_inputs)
    on_native = library.resolve_provider(config.provider) == "native"  # ("auto" runs the native kernels)
    parts = {
        "format": FORMAT,
        "code": code_hash(),
        "versions": _versions(),
        "cpu": native.cpu_model(),
        "tier": native.active_tier() if on_native else config.provider,
        # autotune picks each linear's AMX schedule unless the process pins one for all
        "amx_schedule": native.amx_schedule_pinned() and native.amx_schedule() if on_native else None,
        # autotune's decisions hold where they were timed: thread count, ISA settings (as its own cache's)
        "timed": _autotune.context() if _autotune.enabled(config) else None,
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "default_dtype": str(torch.get_default_dtype()),  # of the tensors a forward makes (torch.tensor([...]))
        "adapter": adapter_name,
        "structure": repr(module),
        "config": configs,
        "attention_functions": attention,
        # what repr and the config do not show: a constant in a forward, an attention processor,
        # which submodules are in training mode; and the code of classes outside the libraries
        "settings": described,
        "model_code": code,
        "tensors": [_shape_of(n, t) for n, t in _tensors(module)],
        "tied": _tied(module),  # the graph reads a tied weight by one of its names
        "inputs": [
            str(spec),
            [[str(x.dtype), x.dim()] if isinstance(x, torch.Tensor) else repr(x) for x in leaves],
        ],
        "options": {k: v for k, v in dataclasses.asdict(config).items() if k not in ("autotune_cache", "graph_cache")},
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:32]


def _tensors(module: nn.Module) -> list[tuple[str, Any]]:
    """The state dict's entries, and the buffers it leaves out (``persistent=False``: a forward may
    read a shape of one)."""
    state = module.state_dict(keep_vars=True)
    return [*state.items(), *((n, b) for n, b in module.named_buffers(remove_duplicate=False) if n not in state)]


def _shape_of(name: str, t: Any) -> tuple:
    # (a state dict may hold other values: torch.ao's quantized Linear stores its dtype)
    if not isinstance(t, torch.Tensor):
        return (name, repr(t))
    # Released (amxopt.from_pretrained packs every weight as it reads it): a graph optimize() stored
    # may read unpacked a weight autotune left to ATen, which a loaded model no longer has.
    return (name, list(t.shape), str(t.dtype), *(["released"] if packed.is_released(t) else []))


def _tied(module: nn.Module) -> list[list[str]]:
    """The names of each parameter or buffer that ``module`` holds under more than one."""
    groups: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        groups.setdefault(id(t), []).append(name)
    return sorted(names for names in groups.values() if len(names) > 1)


# Where a model or config came from, or what it has logged, not what it computes: a model loaded
# from a directory restores the graph of the same model built in code.
_PROVENANCE = frozenset(
    (
        "_name_or_path",
        "_commit_hash",
        "_diffusers_version",
        "transformers_version",
        "name_or_path",
        "warnings_issued",
        "_use_default_values",
        "_class_name",
        "architectures",  # filled in by save_pretrained (on the saved model's own config too)
        # set by transformers' loader on every module, absent on a model built in code
        "_is_hf_initialized",
        "_use_kernels",
        "_kernels_mode",  # (transformers >= 5.25 with the kernels package: the mode it loaded in)
        "_weight_conversions",
        "zoo_name",  # amxopt.models' label of a model it built
    )
)


class _Undescribable(Exception):
    """A value whose effect on the graph the key cannot tell (the message says where): no key, no cache."""


_SUBMODULES = threading.local()  # ids of the modules the key describes each under its own path


def _settings(module: nn.Module) -> dict:
    """Each submodule's Python attributes and training flag, described alike in every process."""
    seen: dict[int, str] = {}
    _SUBMODULES.ids = {id(m) for m in module.modules()}
    try:
        return {
            path: [
                sub.training,
                {k: _described(v, f"{path}.{k}", seen) for k, v in sorted(vars(sub).items()) if _setting(k)},
            ]
            for path, sub in module.named_modules()
        }
    finally:
        _SUBMODULES.ids = None


def _setting(name: str) -> bool:
    return name not in MODULE_INTERNALS and name not in _PROVENANCE and not name.startswith("_amxopt")


def _described(v: Any, where: str, seen: dict[int, str], depth: int = 0) -> Any:
    """``v`` as JSON-able data that is equal across processes when ``v`` computes the same."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (torch.dtype, torch.device, bytes, types.UnionType, types.GenericAlias)) or _typing(v):
        return repr(v)  # (an annotation: `str | None`, typing.Optional[str])
    if isinstance(v, torch.Tensor):
        readable = v.device.type != "meta" and v.layout == torch.strided
        if depth == 0 or not readable:
            # an attribute of a module: the graph reads it from the model (a small one is a setting)
            small = readable and v.numel() <= 64
            return ["tensor", list(v.shape), str(v.dtype), v.tolist() if small and depth == 0 else None]
        # in a container or a closure: export makes it a constant of the graph
        return ["tensor", list(v.shape), str(v.dtype), hashlib.sha256(_tensor_bytes(v)).hexdigest()]
    if _numpy(v):  # a numpy number or array
        if getattr(v, "size", 1) <= 64:
            return ["numpy", str(v.dtype), v.tolist()]
        return ["numpy", str(v.dtype), list(v.shape), hashlib.sha256(v.tobytes()).hexdigest()]
    if isinstance(v, (tuple, list)):  # a tuple read back from JSON is a list
        return ["sequence", [_described(x, f"{where}[{i}]", seen, depth + 1) for i, x in enumerate(v)]]
    if isinstance(v, (set, frozenset)):  # in the order of the descriptions: not repr's (an address)
        items = [_described(x, f"{where}{{}}", seen, depth + 1) for x in v]
        return ["sequence", sorted(items, key=lambda d: json.dumps(d, sort_keys=True, default=str))]
    if isinstance(v, (dict, types.MappingProxyType)):
        items = [(k, x) for k, x in v.items() if not (isinstance(k, str) and k in _PROVENANCE)]
        return [
            "dict",
            [
                [_described(k, where, {}, depth + 1), _described(x, f"{where}[{i}]", seen, depth + 1)]
                for i, (k, x) in enumerate(items)
            ],
        ]
    if isinstance(v, functools.partial):
        return ["partial", _described((v.func, v.args, v.keywords), where, seen, depth + 1)]
    if isinstance(v, (types.FunctionType, types.MethodType)):
        fn = getattr(v, "__func__", v)
        cells = [c.cell_contents for c in fn.__closure__ or () if _full(c) and c.cell_contents is not fn]
        reads = _globals_read([f for f in _code_layers(fn) if _library_file(f) is None])
        described = ["function", _function_identity(fn), _described(cells, where, seen, depth + 1), reads]
        if isinstance(v, types.MethodType):  # and the object it is bound to (a LeakyReLU's slope)
            described.append(_described(v.__self__, f"{where}.__self__", seen, depth + 1))
        return described
    if isinstance(v, (type, types.BuiltinFunctionType, types.ModuleType)):
        return _qualified(v)
    if isinstance(v, nn.Module):
        if id(v) not in (getattr(_SUBMODULES, "ids", None) or ()):  # in a tuple, a global: its weights too
            raise _Undescribable(f"{where} is a {type(v).__name__} that is not a submodule of the model")
        return ["module", _qualified(type(v))]  # described under its own path
    if id(v) in seen:
        return ["same as", seen[id(v)]]
    seen[id(v)] = where
    if hasattr(v, "to_dict") and hasattr(v, "_attn_implementation"):  # a transformers config
        values = _described(v.to_dict(), where, seen, depth + 1)
        return [_qualified(type(v)), values, v._attn_implementation]
    if depth >= _DEPTH:
        raise _Undescribable(f"{where} nests objects more than {_DEPTH} deep")
    slots = [n for c in type(v).__mro__ for n in _slot_names(c) if n not in ("__dict__", "__weakref__")]
    if hasattr(v, "__dict__") or slots:  # an attention processor, a config, a dataclass
        state = {n: getattr(v, n) for n in slots if hasattr(v, n)} | (vars(v) if hasattr(v, "__dict__") else {})
        return [_qualified(type(v)), _described(state, where, seen, depth + 1)]
    try:  # an object of C code (operator.itemgetter): what pickle would rebuild it from
        reduced = v.__reduce_ex__(4)
    except Exception:  # noqa: BLE001 - any type refuses in its own way
        reduced = None
    if not (isinstance(reduced, tuple) and len(reduced) >= 2):
        raise _Undescribable(f"{where} is a {_qualified(type(v))}, whose settings cannot be read")
    return [_qualified(type(v)), _described(list(reduced[1:3]), where, seen, depth + 1)]


_DEPTH = 8  # objects within objects: past it a key is not made (a config nested this deep is unheard of)


def _typing(v: Any) -> bool:
    return type(v).__module__ == "typing"


def _slot_names(cls: type) -> tuple[str, ...]:
    names = vars(cls).get("__slots__", ())
    return (names,) if isinstance(names, str) else tuple(names)


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', '?'))}"


# Code covered by the library versions in the key (amxopt's own: by code_hash).
_LIBRARIES = ("torch", "transformers", "diffusers", "amxopt")


def _model_code(module: nn.Module) -> dict[str, Any]:
    """A digest of the source of each class in ``module`` that is not a library's (a user's model
    edited between runs), and of each user class it inherits from: its file, or its compiled methods
    where there is no file, the user code it may call (see ``_package_files``), the globals its
    methods read and its class attributes (``Net.scale = 3`` at run time); and of library code
    patched in this process (see ``_patches``)."""
    digests: dict[str, Any] = {}
    memo: dict[type, list] = {}
    users: dict[type, str] = {}
    packages: dict[str, Any] = {}  # top-level module -> digest of its user files
    library_code: set[types.FunctionType] = set()  # the library functions the classes' methods run
    # the modules' classes, and those of the callable objects they hold (a diffusers attention processor)
    held = {type(v) for m in module.modules() for v in vars(m).values() if _callable_instance(v)}
    for cls in sorted({type(m) for m in module.modules()} | held, key=_qualified):
        bases = cls.__mro__[:-1]  # not object
        own = [b for b in bases if not _library_class(b)]
        for base in own:
            if base not in users:
                users[base] = _class_digest(base, packages)
        library = next((b for b in bases if _library_class(b)), None)
        patched = _patches(library, memo, library_code) if library is not None else []
        if own:
            digests[_qualified(cls)] = [[_qualified(b), users[b]] for b in own] + patched
        elif patched:
            digests[_qualified(cls)] = patched
    reads = _patched_reads(library_code)
    if reads:
        digests["library functions replaced"] = reads
    return digests


def _library_class(cls: type) -> bool:
    return cls.__module__.split(".")[0] in _LIBRARIES


def _class_digest(cls: type, packages: dict[str, Any]) -> str:
    digest = hashlib.sha256()
    methods = [(name, f) for name, f in sorted(vars(cls).items()) if isinstance(f, types.FunctionType)]
    try:
        file = inspect.getsourcefile(cls)
        if methods and all(os.path.abspath(f.__code__.co_filename) != os.path.abspath(file) for _, f in methods):
            raise OSError("defined by exec")  # getsourcefile names the module's file, not the exec'd text
        digest.update(pathlib.Path(file).read_bytes())
    except (TypeError, OSError):  # defined in a notebook or by exec
        for name, f in methods:  # not co_filename: a notebook's names its process
            digest.update(name.encode() + json.dumps(_code_data(f.__code__)).encode())
    top = cls.__module__.split(".")[0]
    if top not in packages:
        packages[top] = _files_digest(top)
    digest.update(packages[top].encode())
    closures = [v for _, v in sorted(vars(cls).items()) if isinstance(v, types.FunctionType) and v.__closure__]
    # a value set on the class at run time (in no file's bytes); not a method, property or other descriptor
    described = _described([closures, _class_data(cls)], "class", {})
    digest.update(json.dumps(described, default=str).encode())
    digest.update(json.dumps(_globals_read([f for _, f in methods]), default=str).encode())
    return digest.hexdigest()


_READING = threading.local()  # the functions whose globals a _globals_read on this thread is reading


def _globals_read(functions: list[types.FunctionType]) -> list:
    """The module globals that ``functions`` read, and the user functions they call read: a plain
    value or a container of them (``SCALE = float(sys.argv[1])``, in no file's bytes) by value, a
    tensor by its data (export stores it in the graph), anything else by its type (a logger's state
    is not what it computes). What a function reads from a module counts too: from a user's module
    any value (``settings.SCALE``, ``helpers.act``), from a library's a function put there in this
    process (``torch.nn.functional.gelu = mine``, or ``= torch.nn.functional.mish``)."""
    active: set = _READING.__dict__.setdefault("functions", set())
    found: dict[tuple[str, str], Any] = {}
    todo = [f for f in functions if f not in active]
    mine = set(todo)  # reading: a function reached again (f calls g calls f) is not read twice
    active.update(mine)
    try:
        while todo and len(mine) < 256:
            f = todo.pop()
            for name, attributes in _global_loads(f.__code__):
                if name not in f.__globals__:
                    continue
                value, path = f.__globals__[name], name
                if (str(f.__module__), path) not in found:
                    found[(str(f.__module__), path)] = _global_value(value)
                user = True
                for attribute in attributes:  # through modules: `helpers.act`, `torch.nn.functional.gelu`
                    if not isinstance(value, types.ModuleType):
                        break
                    holder, user = value, _user_module(value)
                    value, path = getattr(value, attribute, _MISSING), f"{path}.{attribute}"
                    if value is _MISSING or (str(f.__module__), path) in found:
                        break
                    if user:
                        found[(str(f.__module__), path)] = _global_value(value)
                    elif _code_layers(value) and not _library_code(value):
                        found[(str(f.__module__), path)] = ["patched", _function_identity(value)]
                    elif _renamed(value, path, holder, f):
                        found[(str(f.__module__), path)] = ["renamed", _named(value)]
                # a user function's own reads, once (not again inside each description of it)
                for layer in _code_layers(value) if isinstance(value, types.FunctionType) else ():
                    if _library_file(layer) is None and layer not in active:
                        todo.append(layer)
                        mine.add(layer)
                        active.add(layer)
    finally:
        active.difference_update(mine)
    return [[*key, found[key]] for key in sorted(found)]


_MISSING = object()


def _user_module(module: types.ModuleType) -> bool:
    """A module of user code (not the stdlib, an installed package or the libraries)."""
    file = getattr(module, "__file__", None)
    return _real_file(file) and not _installed(file)


def _global_value(v: Any) -> Any:
    """A global as the key holds it; a user function by its identity (``_globals_read`` reads what
    it reads)."""
    if isinstance(v, torch.Tensor):
        if v.device.type == "meta" or v.layout != torch.strided:
            return ["tensor", list(v.shape), str(v.dtype)]
        return ["tensor", list(v.shape), str(v.dtype), hashlib.sha256(_tensor_bytes(v)).hexdigest()]
    if _plain(v) or isinstance(v, (list, dict, set, frozenset)) or _numpy(v):
        return _described(v, "global", {}, depth=1)  # (depth 1: a tensor in it by its data)
    if isinstance(v, types.FunctionType):
        return ["function", _function_identity(v)]
    if isinstance(v, type) and not _library_class(v) and not _installed_code(v):
        # a user's class read in a forward (`Cfg.SCALE`): its data attributes, set at run time too
        return [_qualified(v), [_described(_class_data(c), "class", {}, depth=1) for c in _user_bases(v)]]
    if isinstance(v, (type, types.ModuleType, types.BuiltinFunctionType)):
        return _described(v, "global", {})
    if not _installed_code(type(v)) and not _library_class(type(v)):  # a user's object: an options instance
        return _described(v, "global", {}, depth=1)
    return _qualified(type(v))


def _installed_code(cls: type) -> bool:
    """A class of the stdlib, a C extension or an installed package (a logger, a lock): its state
    is not a setting. A notebook's classes (a main module without a file) are user code."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if file is None:
        return module is None or cls.__module__ in sys.builtin_module_names
    return not _real_file(file) or _installed(file)


def _user_bases(cls: type) -> list[type]:
    return [c for c in cls.__mro__[:-1] if not _library_class(c) and not _installed_code(c)]


def _class_data(cls: type) -> dict[str, Any]:
    """A class's own values that are not methods, properties or other descriptors (``scale = 1.0``)."""
    return {k: v for k, v in sorted(vars(cls).items()) if not k.startswith("__") and not hasattr(type(v), "__get__")}


def _plain(v: Any, depth: int = 0) -> bool:
    """A number, string, dtype or a short tuple of them: a setting read as it is."""
    if v is None or isinstance(v, (bool, int, float, str, torch.dtype)):
        return True
    return isinstance(v, tuple) and depth < 2 and len(v) <= 64 and all(_plain(x, depth + 1) for x in v)


def _numpy(v: Any) -> bool:
    return type(v).__module__ == "numpy" and hasattr(v, "tolist")


@functools.lru_cache(maxsize=16384)
def _global_loads(code: types.CodeType) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each global name ``code`` and the functions defined in it load, with the attributes read
    from it in a row (``torch.nn.functional.gelu``: ``("torch", ("nn", "functional", "gelu"))``)."""
    loads: list[tuple[str, list[str]]] = []
    chain: list[str] | None = None
    for i in dis.get_instructions(code):
        if i.opname == "LOAD_GLOBAL":
            chain = []
            loads.append((i.argval, chain))
        elif i.opname in ("LOAD_ATTR", "LOAD_METHOD") and chain is not None:
            chain.append(i.argval)
        else:
            chain = None
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return (*[(name, tuple(chain)) for name, chain in loads], *[load for c in nested for load in _global_loads(c)])


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _patches(cls: type, memo: dict[type, list], library_code: set[types.FunctionType]) -> list:
    """What replaced a library class's code in this process: each method of it (or of its library
    bases) whose code is not the library's. A decorated function counts by every function it wraps
    (``torch.no_grad()(mine)`` is not torch's), and a library function put in another's place
    (``MLP.forward = nn.Identity.forward``) by its name. The library functions the methods run are
    added to ``library_code``, for ``_patched_reads``."""
    found = []
    for base in cls.__mro__[:-1]:  # not object
        if base not in memo:
            memo[base] = []
            for name, f in sorted(vars(base).items()):
                layers = _code_layers(f)
                own = any(layer.__code__.co_qualname == f"{base.__qualname__}.{name}" for layer in layers)
                if layers and not (own and _library_code(f)):
                    memo[base].append([name, _function_identity(f)])
                library_code.update(layer for layer in layers if _library_file(layer) is not None)
        found += memo[base]
    return found


# The libraries whose functions _patched_reads follows into the functions they call (torch's own
# are not followed: what a model runs of them, it reaches through these or by a name they read).
_FOLLOWED = (f"transformers{os.sep}", f"diffusers{os.sep}")
_MAX_FOLLOWED = 8192


def _patched_reads(functions: set[types.FunctionType]) -> list:
    """Each function from outside the libraries put in a library module's place in this process and
    read by library ``functions`` as a module global, directly or through modules
    (``torch.nn.functional.scaled_dot_product_attention = sageattn`` read as
    ``F.scaled_dot_product_attention``, ``modeling_qwen3_vl.rotate_half = mine``), or by the
    transformers and diffusers functions they read, and those read in turn: by the reader's name and
    the path it reads, and the replacement's identity (see ``_function_identity``). A library's
    function, builtin or op read under another's name counts too (see ``_renamed``)."""
    found: dict[str, Any] = {}
    todo = sorted(functions, key=lambda f: (f.__module__ or "", f.__code__.co_qualname))
    seen = set(todo)
    while todo and len(seen) < _MAX_FOLLOWED:
        f = todo.pop()
        for name, attributes in _global_loads(f.__code__):
            value, path, holder = f.__globals__.get(name, _MISSING), name, None
            for attribute in attributes:  # through modules: `F.scaled_dot_product_attention`
                if not isinstance(value, types.ModuleType):
                    break
                holder, value, path = value, getattr(value, attribute, _MISSING), f"{path}.{attribute}"
            layers = _code_layers(value) if value is not _MISSING else []
            if layers and not _library_code(value):
                # a user's function, or another package's in a library module's place (a kernel
                # package's; not one the library's file imports: `safetensors.torch.load_file`)
                if _user_code(layers) or (  # (a user's function needs no file read)
                    name not in _imported_names(f.__code__.co_filename)
                    if holder is None
                    else _library_path(str(getattr(holder, "__file__", ""))) is not None
                ):
                    found[f"{f.__module__}.{f.__code__.co_qualname}: {path}"] = _function_identity(value)
                continue
            if _renamed(value, path, holder, f):  # a library's function in another's place: `F.gelu = F.mish`
                found[f"{f.__module__}.{f.__code__.co_qualname}: {path}"] = _named(value)
            for layer in layers:
                if layer not in seen and (_library_file(layer) or "").startswith(_FOLLOWED):
                    seen.add(layer)
                    todo.append(layer)
    return [[reader, found[reader]] for reader in sorted(found)]


def _renamed(value: Any, path: str, holder: Any, reader: types.FunctionType) -> bool:
    """Whether a function read as ``path`` is named otherwise, and not by the reader's own import
    (``from safetensors.torch import save_file as safe_save_file``): a library's function, a builtin
    or an op put in another's place (``F.gelu = F.mish``), which the library's version cannot tell."""
    name = getattr(value, "__name__", None)
    if not isinstance(name, str) or isinstance(value, (type, types.ModuleType)) or name == path.rsplit(".", 1)[-1]:
        return False
    return holder is not None or path not in _imported_names(reader.__code__.co_filename)


def _named(fn: Any) -> str:
    """A library function, builtin or op by its kind, module and name (alike in every process)."""
    return f"{type(fn).__name__} {getattr(fn, '__module__', None)}.{fn.__name__}"


_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+[\w.]+[ \t]+import[ \t]+(\([^)]*\)|[^\n]*)|import[ \t]+([^\n]*))", re.M)


@functools.lru_cache(maxsize=1024)
def _imported_names(filename: str) -> frozenset[str]:
    """The names a module's file binds by an import statement (read as text: parsing a large
    modeling file costs tens of ms; an import inside a function or a docstring counts too)."""
    try:
        text = pathlib.Path(filename).read_text(errors="replace")
    except OSError:
        return frozenset()
    names = set()
    for match in _IMPORT.finditer(text):
        listed = re.sub(r"#[^\n]*", "", match.group(1) or match.group(2)).strip("()")
        for item in listed.replace("\\", " ").split(","):
            words = item.split()
            if words:  # `a`, `a as b`, `a.b` (binds a)
                names.add(words[-1] if len(words) == 3 and words[1] == "as" else words[0].split(".")[0])
    return frozenset(names)


def _user_code(layers: list[types.FunctionType]) -> bool:
    """Whether a function of ``layers`` is a user's (not the stdlib's, an installed package's or a library's)."""
    return any(not _installed(layer.__code__.co_filename) for layer in layers)


def _code_layers(fn: Any) -> list[types.FunctionType]:
    """The Python functions a callable runs: itself and what it wraps, by ``__wrapped__``
    (``functools.wraps``, ``lru_cache``) or in its closure (a decorator's inner function)."""
    layers: list[types.FunctionType] = []
    todo = [fn]
    for _ in range(64):  # bounded: an object may answer any attribute with another
        if not todo:
            break
        f = todo.pop()
        f = getattr(f, "__func__", f)  # a bound method
        if any(f is seen for seen in layers):
            continue
        if isinstance(f, (functools.partial, functools.partialmethod)):
            todo.append(f.func)
        if isinstance(f, types.FunctionType):
            layers.append(f)
            todo += [cell.cell_contents for cell in reversed(f.__closure__ or ()) if _full(cell)]
        elif _callable_instance(f):
            todo.append(type(f).__call__)
        wrapped = getattr(f, "__wrapped__", None) if callable(f) else None
        if wrapped is not None:
            todo.append(wrapped)
    return layers


def _callable_instance(obj: Any) -> bool:
    """An object called through its class's Python ``__call__`` (not a function, class or builtin)."""
    return not isinstance(obj, type) and isinstance(getattr(type(obj), "__call__", None), types.FunctionType)


def _library_code(fn: Any) -> bool:
    """Whether every function ``fn`` runs (see ``_code_layers``) is a library's or the stdlib's (a
    partial's arguments are not code: it never is; an object's state is, where its class is a
    library's)."""
    if isinstance(fn, (functools.partial, functools.partialmethod)):
        return False
    if _stateful(fn):
        top = type(_owner(fn)).__module__.split(".")[0]
        if top not in _LIBRARIES and top not in sys.stdlib_module_names:
            return False
    return all(_library_file(layer) is not None for layer in _code_layers(fn))


def _library_file(fn: types.FunctionType) -> str | None:
    """``fn``'s file relative to the library (or stdlib) holding it; None outside them."""
    return _library_path(fn.__code__.co_filename)


@functools.lru_cache(maxsize=4096)
def _library_path(filename: str) -> str | None:
    if filename.startswith("<frozen "):  # the stdlib's frozen modules (os, posixpath, genericpath)
        return filename
    for root in _library_roots():
        if filename.startswith(root):
            where = os.path.relpath(filename, os.path.dirname(root.rstrip(os.sep)))
            if not _in_site_packages(where):
                return where  # (a library's own files, or the stdlib's without its installed packages)
    return None


@functools.cache
def _library_roots() -> tuple[str, ...]:
    """amxopt, torch, transformers and diffusers (their versions are in the key) and the stdlib
    (Python's version is)."""
    roots = []
    for name in _LIBRARIES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin:
            roots.append(str(pathlib.Path(spec.origin).parent) + os.sep)
    return (*roots, sysconfig.get_paths()["stdlib"] + os.sep)


def _function_identity(fn: Any) -> Any:
    """Each function ``fn`` runs (see ``_code_layers``): a library function by its file and name
    (the library's version is in the key), any other by its name and compiled code (edited between
    runs), not its file name (a notebook's names its process). Names come from the code, not from
    ``functools.wraps`` (which gives a wrapper the name of what it wraps)."""
    if isinstance(fn, (functools.partial, functools.partialmethod)):
        return ["partial", _function_identity(fn.func), _described([fn.args, fn.keywords], "partial", {})]
    if _stateful(fn):  # a callable object, or a method bound to one: its state too
        owner = _owner(fn)
        code = fn.__func__ if isinstance(fn, types.MethodType) else type(owner).__call__
        return ["object", _qualified(type(owner)), _function_identity(code), _described(vars(owner), "object", {})]
    identity = []
    for layer in _code_layers(fn):
        name, where = layer.__code__.co_qualname, _library_file(layer)
        if where is not None:
            identity.append(f"{where}:{name}")
        else:  # its code, and the values it reads besides its arguments: defaults, closure
            cells = [c.cell_contents for c in layer.__closure__ or () if _full(c)]
            values = [layer.__defaults__, layer.__kwdefaults__, [c for c in cells if not _code_layers(c)]]
            # and the user code beside it: a helper it calls, a constant of its module
            data = [_code_data(layer.__code__), _described(values, name, {}), _files_digest(layer.__module__)]
            digest = hashlib.sha256(json.dumps(data, default=str).encode()).hexdigest()[:16]
            identity.append([f"{layer.__module__}.{name}", digest])
    return identity


def _stateful(fn: Any) -> bool:
    """A callable object of a user's class, or a method bound to an object with state (not a module,
    whose own settings the key covers)."""
    owner = _owner(fn)
    return (
        owner is not None and hasattr(owner, "__dict__") and not isinstance(owner, (nn.Module, type, types.ModuleType))
    )


def _owner(fn: Any) -> Any:
    if isinstance(fn, types.MethodType):
        return fn.__self__
    return fn if _callable_instance(fn) else None


def _full(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:  # a closure variable not yet assigned
        return False
    return True


def _code_data(code: types.CodeType) -> list:
    def const(c: Any) -> Any:
        if isinstance(c, types.CodeType):
            return _code_data(c)
        if isinstance(c, frozenset):  # `x in {"a", "b"}`: in hash order, which varies with PYTHONHASHSEED
            return sorted(map(repr, c))
        return repr(c)

    return [code.co_code.hex(), [const(c) for c in code.co_consts], list(code.co_names)]


def _package_files(top: str) -> list[str]:
    """The source files of the code a class of the top-level module ``top`` may call: the loaded
    modules of its package (installed or not, a namespace package too), and for a plain module (a
    script's model, ``__main__`` itself) the loaded user modules beside it (a helper module; a
    notebook's: in the working directory), but not the script that runs it, the stdlib, installed
    packages or the libraries (their versions are in the key)."""
    loaded = {name: m for name, m in list(sys.modules.items()) if name == top or name.startswith(top + ".")}
    files = {f for m in loaded.values() if _real_file(f := getattr(m, "__file__", None))}
    module = sys.modules.get(top)
    if module is not None and not hasattr(module, "__path__"):  # a plain module, not a package
        file = getattr(module, "__file__", None)
        root = os.path.join(os.path.dirname(os.path.abspath(file)) if file else os.getcwd(), "")
        main = getattr(sys.modules.get("__main__"), "__file__", None) if top != "__main__" else None
        main = os.path.abspath(main) if _real_file(main) else None
        for m in list(sys.modules.values()):
            f = getattr(m, "__file__", None)
            if (
                _real_file(f)
                and os.path.abspath(f).startswith(root)
                and not _installed(f)
                and os.path.abspath(f) != main
            ):
                files.add(f)
    return sorted(files)


_MEMO = threading.local()  # within one cache_key: what was worked out already


@contextlib.contextmanager
def _memo_scope() -> Iterator[None]:
    outer = getattr(_MEMO, "values", None)
    if outer is None:
        _MEMO.values = {}
    try:
        yield
    finally:
        if outer is None:
            _MEMO.values = None


def _files_digest(module_name: str | None) -> str:
    """What the code of ``module_name``'s top-level module is: an installed distribution by its
    name and version, anything else by a digest of ``_package_files`` (once per key: it walks every
    loaded module)."""
    top = str(module_name).split(".")[0]
    memo = getattr(_MEMO, "values", None)
    if memo is None:
        return _top_digest(top)
    if ("files", top) not in memo:
        memo[("files", top)] = _top_digest(top)
    return memo[("files", top)]


def _top_digest(top: str) -> str:
    file = getattr(sys.modules.get(top), "__file__", None)
    if _real_file(file) and _installed(file) and _distributions(top):
        return _distributions(top)
    digest = hashlib.sha256()
    for path in _package_files(top):
        digest.update(path.encode() + _file_digest(path))
    return digest.hexdigest()


@functools.cache
def _distributions(top: str) -> str:
    names = importlib.metadata.packages_distributions().get(top, [])
    return ", ".join(f"{name}=={importlib.metadata.version(name)}" for name in sorted(set(names)))


def _file_digest(path: str) -> bytes:
    try:
        stat = os.stat(path)
    except OSError:  # deleted since it was imported
        return b"missing"
    return _read_digest(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8192)
def _read_digest(path: str, mtime_ns: int, size: int) -> bytes:
    """A file's digest, read again only when its modification time or size changed."""
    try:
        return hashlib.sha256(pathlib.Path(path).read_bytes()).digest()
    except OSError:
        return b"missing"


def _real_file(f: Any) -> bool:
    return isinstance(f, str) and f.endswith(".py") and os.path.isabs(f)


def _installed(f: str) -> bool:
    """A file of the stdlib, an installed package or the libraries."""
    return _library_path(f) is not None or _in_site_packages(f)


def _in_site_packages(path: str) -> bool:
    return bool({"site-packages", "dist-packages"} & set(pathlib.Path(path).parts))


def _attention_functions(module: nn.Module) -> dict[str, Any]:
    """The functions transformers' registries hold under the attention implementations the model's
    configs name (a user may register their own, or replace ``sdpa``'s), and those diffusers' holds
    under the backends its attention processors dispatch to; with what replaced library functions
    they read (see ``_patched_reads``)."""
    found = {}
    for kind, name, fn in _registered_attention(module):
        found[f"{kind}:{name}"] = [
            _function_identity(fn),
            _patched_reads({f for f in _code_layers(fn) if _library_file(f)}),
        ]
    return found


def _registered_attention(module: nn.Module) -> Iterator[tuple[str, str, Any]]:
    names = {getattr(m.config, "_attn_implementation", None) for m in module.modules() if hasattr(m, "config")}
    names = sorted(n for n in names if isinstance(n, str))
    if names and "transformers" in sys.modules:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        for kind, registry in (("attention", ALL_ATTENTION_FUNCTIONS), ("mask", ALL_MASK_ATTENTION_FUNCTIONS)):
            yield from ((kind, name, registry[name]) for name in names if name in registry)
    processors = [m.processor for m in module.modules() if hasattr(getattr(m, "processor", None), "__call__")]
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    if processors and dispatch is not None:
        registry = dispatch._AttentionBackendRegistry
        # a processor's own backend (set_attention_backend), else the process's active one
        backends = {getattr(p, "_attention_backend", None) or registry._active_backend for p in processors}
        for backend in sorted({str(getattr(b, "value", b)) for b in backends}):
            fn = registry._backends.get(dispatch.AttentionBackendName(backend))
            if fn is not None:
                yield "diffusers backend", backend, fn


def _model_config(module: nn.Module) -> Any:
    configs = {}
    for name, m in module.named_modules():
        config = getattr(m, "config", None)
        if config is None:
            continue
        if hasattr(config, "to_dict") or isinstance(config, Mapping):  # transformers', diffusers' (a dict)
            values = config.to_dict() if hasattr(config, "to_dict") else dict(config)
            configs[name] = {k: v for k, v in values.items() if k not in _PROVENANCE}
        else:  # a user's: a dataclass, a SimpleNamespace
            configs[name] = _described(config, f"{name}.config", {}, depth=1)
    return configs


@functools.cache
def code_hash() -> str:
    """A digest of amxopt's own sources (Python and C++): what graphs were rewritten by."""
    package = pathlib.Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(package.rglob("*")):
        if path.suffix in (".py", ".cpp", ".h"):
            digest.update(path.relative_to(package).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.cache
def _versions() -> dict[str, str]:
    versions = {"python": sys.version.split()[0], "torch": torch.__version__}
    for dist in ("transformers", "diffusers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = "-"
    return versions


def read_cache(key: str, module: nn.Module, config: AmxConfig) -> Iterator[GraphEntry]:
    """The cached graphs under ``key``, each restored on ``module`` as it is asked for; an unusable
    one is logged and skipped. A key holds several: one model and call structure may need a graph
    per input region (a batch-1 example's graph fixes the batch at 1, the next takes the others)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    for path in sorted((config.cache_dir() / "graphs").glob(f"{key}.*.json")):
        try:
            entry = json.loads(path.read_text())
            tensors = load_file(str(path.with_suffix(".safetensors"))) if entry.get("has_tensors") else {}
            graph = restore(entry, module, config.provider, tensors, f"the graph cache ({path})")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, GraphStoreError, SafetensorError) as e:
            # TypeError, AttributeError: valid JSON of another shape (a damaged or foreign file)
            logger.warning("amxopt: cached graph %s is unusable (%s); capturing again", path, e)
            continue
        with contextlib.suppress(OSError):  # its time of last use, which pruning goes by
            os.utime(path)
        yield graph


def write_cache(key: str, graph: GraphEntry, module: nn.Module, config: AmxConfig) -> None:
    """Store ``graph`` under ``key``; a graph that cannot be stored, or a read-only cache, only logs."""
    try:
        entry, tensors = dump(graph, module, for_cache=True, live=True)
    except GraphStoreError as e:
        logger.info("amxopt: the graph of %s is not cached: %s", type(module).__name__, e)
        return
    entry["has_tensors"] = bool(tensors)
    # One file per input region under the key: named by the graph's guards and input dtypes, so
    # that the same graph captured again replaces its file and another one is kept beside it.
    region = json.dumps([entry["guards"], entry["dtypes"], entry["dynamic"]], sort_keys=True)
    stem = f"{key}.{hashlib.sha256(region.encode()).hexdigest()[:12]}"
    directory = config.cache_dir() / "graphs"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        # Another process may be reading (or have memory-mapped) the entry this one replaces, or be
        # writing the same key.
        if tensors:
            with replacing(directory / f"{stem}.safetensors") as staged:
                save_tensors(tensors, staged)
        with replacing(directory / f"{stem}.json") as staged:
            staged.write_text(json.dumps(entry))
        _prune(directory, stem, CACHE_LIMIT_BYTES)
    except OSError as e:
        logger.warning("amxopt: could not write the graph cache in %s: %s", directory, os_error(e))


CACHE_LIMIT_BYTES = 1 << 30  # of the graph cache's directory; the least recently used entries go first


def _prune(directory: pathlib.Path, keep: str, limit: int) -> None:
    """Delete the least recently used entries (by their JSON's time of last use) until the
    directory holds at most ``limit`` bytes; never ``keep``, the entry just written."""
    entries: dict[str, list[pathlib.Path]] = {}
    for path in directory.iterdir():
        parts = path.name.split(".")
        if len(parts) == 3 and parts[0]:  # {key}.{region}.json / .safetensors; not a file being written
            entries.setdefault(f"{parts[0]}.{parts[1]}", []).append(path)
    sizes, used = {}, {}
    for stem, paths in entries.items():
        try:
            sizes[stem] = sum(p.stat().st_size for p in paths)
            used[stem] = max(p.stat().st_mtime for p in paths)
        except OSError:  # deleted meanwhile
            continue
    total = sum(sizes.values())
    for stem in sorted(used, key=used.get):
        if total <= limit:
            break
        if stem == keep:
            continue
        for path in entries[stem]:
            with contextlib.suppress(OSError):
                path.unlink()
        total -= sizes[stem]
        logger.info("amxopt: graph cache over %d MB: dropped %s, the least recently used", limit >> 20, stem)
