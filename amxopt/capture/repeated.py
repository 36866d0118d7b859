"""Repeated-block capture: trace the first block of a stack of identical blocks, stamp the rest.

torch.export's non-strict trace with dynamic shapes costs several milliseconds per aten op, and a
24-block vision tower spends nearly all of its capture in blocks that trace to the same graph. So,
while exporting, the first block called of each *stack* (an ``nn.ModuleList`` of two or more
modules of one class with the same parameter names, shapes and dtypes) is traced as usual between
marker ops, and each later call of a block of that stack becomes one opaque node whose outputs
carry the first block's (symbolic) output metadata. After export, :func:`stamp` replaces each opaque
node with a copy of the first block's nodes that reads the called block's own weights, and drops
the markers: the graph is the one a full trace gives, node for node.

It is sound because the copies share the first block's ShapeEnv: a later call is stamped only when
its tensor inputs have the same dtypes and the same symbolic sizes and strides as the first call's,
its non-tensor arguments are equal plain values, and its settings (the Python attributes and
classes of its submodules) are the first block's as it is called. Export's guards for the first
block then hold for every block. A stack that does not fit (a block that mutates its inputs, reads
a tensor from outside its arguments, returns a non-tensor, is called with other shapes or with an
object whose state it may read, or has its attributes set apart before its call) raises
:class:`NotRepeated`, and the caller exports the whole model as it is instead.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
import functools
import operator
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

_MIN_BLOCKS = 2


class NotRepeated(RuntimeError):
    """A stack's blocks cannot be stamped from the first one (the reason is the message)."""


@torch.library.custom_op("amxopt_capture::block_input", mutates_args=())
def block_input(x: torch.Tensor, stack: str, pos: int) -> torch.Tensor:
    """Marks tensor input ``pos`` of a stack's traced block (removed by :func:`stamp`)."""
    raise RuntimeError("amxopt_capture.block_input only exists while amxopt traces a model")


@block_input.register_fake
def _(x, stack, pos):
    return torch.empty_like(x)


@torch.library.custom_op("amxopt_capture::block_output", mutates_args=())
def block_output(x: torch.Tensor, stack: str, pos: int) -> torch.Tensor:
    """Marks output ``pos`` of a stack's traced block (removed by :func:`stamp`)."""
    raise RuntimeError("amxopt_capture.block_output only exists while amxopt traces a model")


@block_output.register_fake
def _(x, stack, pos):
    return torch.empty_like(x)


@torch.library.custom_op("amxopt_capture::block_call", mutates_args=())
def block_call(inputs: list[torch.Tensor], stack: str, index: int) -> list[torch.Tensor]:
    """A later call of block ``index`` of a stack: replaced by a copy of the traced block."""
    raise RuntimeError("amxopt_capture.block_call only exists while amxopt traces a model")


@block_call.register_fake
def _(inputs, stack, index):
    return [torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device=m.device) for m in _TRACING[stack].outputs]


@dataclasses.dataclass(frozen=True)
class _Meta:
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: torch.Tensor) -> _Meta:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    def key(self) -> tuple:
        # Symbolic sizes compare by expression: no guard is added by comparing them.
        return tuple(map(str, self.shape)), tuple(map(str, self.stride)), self.dtype, self.device


@dataclasses.dataclass
class Stack:
    """One stack of identical blocks: its path in the exported module and what the first call saw."""

    path: str
    size: int
    state: frozenset[str]  # names of each block's parameters and buffers
    template: int | None = None  # index of the block that was traced
    in_spec: Any = None
    constants: list | None = None
    inputs: list[_Meta] | None = None
    settings: tuple | None = None  # the template's _settings as it was called
    out_spec: Any = None
    outputs: list[_Meta] | None = None

    def block_path(self, index: int) -> str:
        return f"{self.path}.{index}" if self.path else str(index)


_TRACING: dict[str, Stack] = {}


def find_stacks(module: nn.Module) -> list[Stack]:
    """The outermost ``ModuleList``s of ``module`` whose blocks share class and parameter layout."""
    stacks: list[Stack] = []
    seen: set[int] = set()
    for path, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < _MIN_BLOCKS:
            continue
        if any(path.startswith(s.path + ".") for s in stacks) or any(id(b) in seen for b in child):
            continue  # inside a stack, or sharing a block with one
        if len({id(b) for b in child}) != len(child):
            continue  # one block listed twice
        if any(hooked(b) for b in child):
            continue  # a copy of the first block would run its hooks, not the block's own
        first = child[0]
        layout, settings = _layout(first), _settings(first)
        if layout and all(type(b) is type(first) and _layout(b) == layout and _settings(b) == settings for b in child):
            stacks.append(Stack(path, len(child), frozenset(name for name, _, _ in layout)))
            seen.update(id(b) for b in child)
    return stacks


def _layout(block: nn.Module) -> tuple:
    state = list(block.named_parameters()) + list(block.named_buffers())
    return tuple((name, tuple(t.shape), t.dtype) for name, t in state)


MODULE_INTERNALS = frozenset(vars(nn.Module()))  # what every module has (training among them)


def hooked(module: nn.Module, recorders: bool = True) -> list[str]:
    """Where forward hooks would run inside ``module``: the paths of its submodules that have one
    (``"*"`` for a global hook), except amxopt's own; see :func:`user_hooks` for ``recorders``."""
    from torch.nn.modules import module as m

    def users(*dicts) -> bool:
        return any(user_hooks(d, recorders) for d in dicts)

    found = ["*"] if users(m._global_forward_hooks, m._global_forward_pre_hooks) else []
    return found + [path for path, sub in module.named_modules() if users(sub._forward_hooks, sub._forward_pre_hooks)]


def member_dicts(module: nn.Module) -> Iterator[tuple[str, dict]]:
    """The parameter, buffer and submodule dicts of ``module``'s modules, each with its module's path."""
    for path, m in module.named_modules():
        for d in (m._parameters, m._buffers, m._modules):
            yield path, d


def user_hooks(hooks: dict, recorders: bool = True) -> list[int]:
    """The ids of the hooks in ``hooks`` (a module's hook dict) that are not amxopt's own (marked
    ``amxopt_own``); without ``recorders``, not transformers' output-recording hooks either
    (installed the first time an eager call asks for hidden states, idle otherwise)."""
    return [
        k
        for k, hook in hooks.items()
        if not getattr(hook, "amxopt_own", False)
        and (recorders or getattr(hook, "__module__", "") != _OUTPUT_RECORDING)
    ]


_OUTPUT_RECORDING = "transformers.utils.output_capturing"  # where transformers defines its recording hooks


def _settings(block: nn.Module, tracing: bool = False) -> tuple:
    """The class and Python attributes of ``block``'s submodules (``layer_idx``, a sliding window,
    an attention processor and its settings), and which are in training mode: blocks that differ in
    one may trace differently (``nn.SiLU`` and ``nn.ReLU`` have the same attributes). While
    :func:`tracing`, the block's own forward is its call wrapper, one per block: not a setting."""
    own = {id(sub): ("own module", path) for path, sub in block.named_modules()}
    return tuple(
        (
            path,
            type(sub),
            tuple(
                (name, _value(v, own, 0))
                for name, v in sorted(vars(sub).items())
                if _setting(name) and not (tracing and sub is block and name == "forward")
            ),
        )
        for path, sub in block.named_modules()
    )


def _setting(name: str) -> bool:
    return name == "training" or name not in MODULE_INTERNALS


# Non-tensor arguments a copy of the traced block can take as they were: equal means the same value.
# Another object (a context a parent passes to every block) compares by identity, and each block
# may read, or change, its state: such a stack is traced block by block.
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.memory_format,
          torch.layout, torch.SymInt, torch.SymFloat, torch.SymBool, enum.Enum, types.FunctionType,
          types.BuiltinFunctionType, type)  # fmt: skip


def _constant(v: Any) -> tuple:
    """``v`` as compared with another block's: ``1 == 1.0 == True``, but a block may compute
    otherwise with each (an int64 tensor times 1.0 is a float32 tensor); a NaN equals a NaN."""
    return type(v), repr(v) if isinstance(v, float) else v


# How deep an attribute's objects are compared: a per-layer value the parent writes two objects below a
# block's attribute (block.ctx.state.layer) was missed at 2, and every copy computed with block 0's.
_DEPTH = 8


def _value(v: Any, seen: dict[int, tuple], depth: int) -> Any:
    """``v`` as compared with the same attribute of another block. ``seen`` names the objects that
    compare by where they are, not by their state: the block's own modules by their paths (their
    settings are compared apart), and the objects this attribute is found inside by their depth (a
    helper that keeps a method bound to itself compares alike in every block)."""
    if v is None or isinstance(v, (bool, int, float, str, bytes, torch.dtype, torch.device)):
        return _constant(v)
    if depth >= _DEPTH:  # (a dict that holds itself too)
        return type(v), id(v)  # the same object, or not the same setting
    if isinstance(v, (tuple, list)):
        return type(v), tuple(_value(x, seen, depth + 1) for x in v)
    if isinstance(v, dict):
        return dict, tuple((repr(k), _value(x, seen, depth + 1)) for k, x in v.items())
    if isinstance(v, (set, frozenset)):  # (a module's names of non-persistent buffers); equal members counted
        return type(v), frozenset(collections.Counter(_value(x, seen, depth + 1) for x in v).items())
    if isinstance(v, functools.partial):
        return functools.partial, *(_value(x, seen, depth + 1) for x in (v.func, v.args, v.keywords))
    if isinstance(v, types.MethodType):  # bound to another object (``Scaler(k).apply``): its state too
        return types.MethodType, v.__func__, _value(v.__self__, seen, depth + 1)
    if isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        return v
    if id(v) in seen:
        return seen[id(v)]
    if hasattr(v, "__dict__") and not isinstance(v, torch.Tensor):
        inside = {**seen, id(v): ("object at depth", depth)}
        return type(v), _value(vars(v), inside, depth + 1)  # an attention processor, a config
    return type(v), id(v)  # a tensor attribute: the same object, or not the same setting


@contextlib.contextmanager
def tracing(module: nn.Module, stacks: list[Stack]):
    """While exporting ``module``: the first call of each stack's blocks is traced between markers,
    later calls become ``block_call`` nodes."""
    patched = []  # (block, the forward set on the instance before, if any: a diffusers or accelerate hook's)
    try:
        for stack in stacks:
            _TRACING[stack.path] = stack
            for index, block in enumerate(module.get_submodule(stack.path)):
                patched.append((block, block.__dict__.get("forward")))
                block.forward = _call(stack, index, block, block.forward)
        yield
    finally:
        for block, before in patched:
            if before is None:
                del block.forward
            else:
                block.forward = before
        for stack in stacks:
            _TRACING.pop(stack.path, None)


def _call(stack: Stack, index: int, block: nn.Module, forward):
    def call(*args, **kwargs):
        flat, in_spec = pytree.tree_flatten((args, kwargs))
        tensors = [x for x in flat if isinstance(x, torch.Tensor)]
        constants = [None if isinstance(x, torch.Tensor) else x for x in flat]
        metas = [_Meta.of(t) for t in tensors]
        other = next((x for x in constants if not isinstance(x, _PLAIN)), None)
        if other is not None:
            raise NotRepeated(
                f"{stack.block_path(index)} is called with a {type(other).__name__}, whose state each block may "
                "read or change"
            )
        if stack.template is None:
            stack.settings = _settings(block, tracing=True)
            return _trace_first(stack, index, forward, flat, in_spec, constants, metas)
        where = f"{stack.block_path(index)} (traced: {stack.block_path(stack.template)})"
        if in_spec != stack.in_spec or list(map(_constant, constants)) != list(map(_constant, stack.constants)):
            raise NotRepeated(f"{where} is called with other non-tensor arguments")
        if _settings(block, tracing=True) != stack.settings:
            raise NotRepeated(f"{where} has other settings when it is called (an attribute set before its call)")
        if [m.key() for m in metas] != [m.key() for m in stack.inputs]:
            raise NotRepeated(f"{where} is called with inputs of other shapes or dtypes")
        outs = block_call(tensors, stack.path, index)
        return pytree.tree_unflatten(outs, stack.out_spec)

    return call


def _trace_first(stack: Stack, index: int, forward, flat, in_spec, constants, metas):
    where = stack.block_path(index)
    marked, pos = [], 0
    for x in flat:
        if isinstance(x, torch.Tensor):
            x = block_input(x, stack.path, pos)
            pos += 1
        marked.append(x)
    versions = [x._version for x in marked if isinstance(x, torch.Tensor)]
    args, kwargs = pytree.tree_unflatten(marked, in_spec)
    out = forward(*args, **kwargs)
    if versions != [x._version for x in marked if isinstance(x, torch.Tensor)]:
        raise NotRepeated(f"{where} modifies one of its inputs in place")
    leaves, out_spec = pytree.tree_flatten(out)
    if not leaves or not all(isinstance(x, torch.Tensor) for x in leaves):
        raise NotRepeated(f"{where} returns something other than tensors")
    stack.template, stack.in_spec, stack.constants, stack.inputs = index, in_spec, constants, metas
    stack.out_spec, stack.outputs = out_spec, [_Meta.of(t) for t in leaves]
    marked_out = [block_output(t, stack.path, i) for i, t in enumerate(leaves)]
    return pytree.tree_unflatten(marked_out, out_spec)


def stamp(gm: fx.GraphModule, stacks: list[Stack]) -> int:
    """Replace every ``block_call`` node of ``gm`` by a copy of its stack's traced block (the
    caller regenerates ``gm``'s code).

    Returns the number of blocks stamped. Raises :class:`NotRepeated` when the traced block reads a
    tensor other than its arguments and its own weights (a copy could not tell whose it reads).
    """
    graph = gm.graph
    stamped = 0
    for stack in stacks:
        if stack.template is None:
            continue
        region, inputs, outputs = _region(graph, stack)
        params = _own_weights(gm, region, stack)
        attrs = {n.target: n for n in graph.find_nodes(op="get_attr")}
        for node in list(graph.nodes):
            if node.op == "call_function" and node.target is torch.ops.amxopt_capture.block_call.default:
                if node.args[1] == stack.path:
                    _copy_block(gm, node, stack, region, inputs, outputs, params, attrs)
                    stamped += 1
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in (
            torch.ops.amxopt_capture.block_input.default,
            torch.ops.amxopt_capture.block_output.default,
        ):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
    graph.lint()
    return stamped


def _region(graph: fx.Graph, stack: Stack) -> tuple[list[fx.Node], dict[fx.Node, int], dict[int, fx.Node]]:
    """The traced block's nodes (in order), its input markers -> position, position -> output value."""
    nodes = list(graph.nodes)

    def marker(node, op):
        return node.op == "call_function" and node.target is op and node.args[1] == stack.path

    ins = [i for i, n in enumerate(nodes) if marker(n, torch.ops.amxopt_capture.block_input.default)]
    outs = [i for i, n in enumerate(nodes) if marker(n, torch.ops.amxopt_capture.block_output.default)]
    if not ins or not outs:
        raise NotRepeated(f"the traced block of {stack.path} left no markers in the graph")
    region = [n for n in nodes[ins[0] : outs[-1] + 1] if n.op == "call_function"]
    inputs = {nodes[i]: nodes[i].args[2] for i in ins}
    outputs = {nodes[i].args[2]: nodes[i].args[0] for i in outs}
    return region, inputs, outputs


def _own_weights(gm: fx.GraphModule, region: list[fx.Node], stack: Stack) -> dict[fx.Node, str]:
    """get_attr nodes the traced block reads -> attribute path inside the block; anything else
    tensor-valued that it reads from outside must be one of its marked inputs."""
    inside = set(region)
    prefix = stack.block_path(stack.template) + "."
    params: dict[fx.Node, str] = {}
    for node in region:
        if node.target is torch.ops.amxopt_capture.block_input.default:
            continue
        for a in node.all_input_nodes:
            if a in inside:
                continue
            if a.op == "get_attr" and a.target.startswith(prefix) and a.target[len(prefix) :] in stack.state:
                params[a] = a.target[len(prefix) :]
            elif isinstance(a.meta.get("val"), torch.Tensor) or a.op == "get_attr":
                raise NotRepeated(
                    f"{stack.block_path(stack.template)} reads {a.name} ({a.target}), which is neither one of its "
                    "arguments nor its own weight"
                )
    return params


def _copy_block(gm, call: fx.Node, stack: Stack, region, inputs, outputs, params, attrs) -> None:
    graph = gm.graph
    path = stack.block_path(call.args[2])
    env: dict[fx.Node, Any] = {}
    for marker, pos in inputs.items():
        env[marker] = call.args[0][pos]
    with graph.inserting_before(call):
        for node, name in params.items():
            target = f"{path}.{name}"
            if target not in attrs:
                if not _has_attr(gm, target):
                    raise NotRepeated(f"{target} is not in the exported graph module")
                attrs[target] = graph.get_attr(target)
                attrs[target].meta = dict(node.meta)
            env[node] = attrs[target]
        for node in region:
            if node in inputs or node.target is torch.ops.amxopt_capture.block_output.default:
                continue
            new = graph.node_copy(node, lambda a: env.get(a, a))
            new.meta = dict(node.meta)
            if "nn_module_stack" in node.meta:
                new.meta["nn_module_stack"] = _moved(node.meta["nn_module_stack"], stack, path)
            env[node] = new
    for user in list(call.users):
        if user.op != "call_function" or user.target is not operator.getitem:
            raise NotRepeated(f"{path}'s outputs are used as a list ({user.name})")
        user.replace_all_uses_with(env.get(outputs[user.args[1]], outputs[user.args[1]]))
        graph.erase_node(user)
    graph.erase_node(call)


def _has_attr(gm: fx.GraphModule, target: str) -> bool:
    try:
        functools.reduce(getattr, target.split("."), gm)
    except AttributeError:
        return False
    return True


def _moved(stack_meta: dict, stack: Stack, path: str) -> dict:
    old = stack.block_path(stack.template)
    moved = {}
    for key, (fqn, kind) in stack_meta.items():
        if fqn == old or fqn.startswith(old + "."):
            new_fqn = path + fqn[len(old) :]
            key = key[: len(key) - len(fqn)] + new_fqn if key.endswith(fqn) else key
            fqn = new_fqn
        moved[key] = (fqn, kind)
    return moved
