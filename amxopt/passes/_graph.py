"""Graph mechanics shared by the passes: inserting traced replacements, notes, clean-up."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from amxopt.ops import packed
from amxopt.patterns import AMX_KINDS

# node.meta keys written by the passes and read by the report.
REPLACED = "amxopt_replaced"  # on a new amxopt node: the aten op it replaced
LEFT = "amxopt_left"  # on an aten node a pass chose to keep: why
LEFT_KIND = "amxopt_left_kind"  # on a kept glue chain's root (an add, an empty_like): the report's kind
TIMED = "amxopt_timing"  # on a new amxopt node or a kept aten node: the autotune Timing that decided it
SHARDED = "amxopt_sharded"  # on a row-parallel Linear: which tp shard the graph computes
_KEEP_META = ("nn_module_stack", "stack_trace", "source_fn_stack", "from_node")


def val(node: Any) -> Any:
    """The fake value export recorded for ``node`` (or ``node`` itself if it is not a Node)."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument of a call_function node, with the schema default."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def insert_traced(node: fx.Node, fn: Callable, args: list[Any], replaced: str, timing: Any = None) -> fx.Node:
    """Trace ``fn(*args)`` on the fake values of its Node args and inline it before ``node``.

    Non-Node ``args`` are bound as constants. The new nodes get fake values (symbolic where the
    capture was dynamic) and ``node``'s source metadata. Returns the node holding the result.

    A trace is reused for every later call on the same graph with the same function, constants and
    input metadata (dtype, symbolic sizes and strides): the 24 blocks of an encoder trace each of
    their replacements once.
    """
    graph = node.graph
    node_pos = [i for i, a in enumerate(args) if isinstance(a, fx.Node)]
    inputs = [args[i] for i in node_pos]
    fakes = _distinct_fakes(inputs)
    key = _trace_key(fn, args, inputs, fakes)
    traces = _TRACES.setdefault(graph, {})
    sub = traces.get(key) if key is not None else None
    if sub is None:

        def bound(*tensors):
            full = list(args)
            for i, t in zip(node_pos, tensors):
                full[i] = t
            return fn(*full)

        with detect_fake_mode(fakes):
            sub = make_fx(bound, tracing_mode="real")(*fakes).graph
        if key is not None:
            traces[key] = sub
    env: dict[fx.Node, Any] = {}
    placeholders = iter(inputs)
    result = None
    created = []
    with graph.inserting_before(node):
        for n in sub.nodes:
            if n.op == "placeholder":
                env[n] = next(placeholders)
            elif n.op == "output":
                result = env[n.args[0]]
            else:
                new = graph.node_copy(n, lambda x: env[x])
                new.meta.update({k: node.meta[k] for k in _KEEP_META if k in node.meta})
                env[n] = new
                created.append(new)
    # Only the nodes made here: an input may itself be an amxopt node, labelled by its own rewrite.
    for n in created:
        if n.op == "call_function" and n.target in AMX_KINDS:
            n.meta[REPLACED] = replaced
            if timing is not None:
                n.meta[TIMED] = timing
    return result


# Per graph: traced replacement subgraphs, by _trace_key.
_TRACES: weakref.WeakKeyDictionary[fx.Graph, dict] = weakref.WeakKeyDictionary()


def _distinct_fakes(inputs: list[fx.Node]) -> list[Any]:
    """The fake values to trace ``inputs`` on: one object per distinct node.

    make_fx reads a tensor passed twice through one placeholder, so two nodes must not share a fake
    (block stamping gives every copy of a node its template's): the second gets a fresh one alike.
    """
    fakes, owner = [], {}
    for a in inputs:
        f = val(a)
        if isinstance(f, torch.Tensor) and owner.setdefault(id(f), a) is not a:
            with detect_fake_mode([f]):
                f = torch.empty_strided(f.shape, f.stride(), dtype=f.dtype, device=f.device)
        fakes.append(f)
    return fakes


class _Input:
    """Where a traced replacement takes a graph value, in its key (unlike a literal ``None``)."""

    def __repr__(self) -> str:
        return "<input>"


_INPUT = _Input()


def _trace_key(fn: Callable, args: list[Any], inputs: list[fx.Node], fakes: list[Any]) -> tuple | None:
    """What a traced replacement depends on; ``None`` when something in it has no stable value."""
    if isinstance(fn, functools.partial):
        fn_key = (fn.func, fn.args, tuple(sorted(fn.keywords.items())))
    else:
        fn_key = (fn,)
    metas = []
    for f in fakes:
        if not isinstance(f, torch.Tensor):
            return None
        metas.append((f.dtype, f.device, tuple(map(str, f.shape)), tuple(map(str, f.stride()))))
    consts = tuple(_INPUT if isinstance(a, fx.Node) else a for a in args)
    if any(isinstance(a, torch.Tensor) for a in consts):
        return None  # compared by identity, not value
    # Which inputs are one node: traced with the same value twice (``h + fc(h)``: x and the
    # residual), the trace reads its last placeholder for both, so it cannot stand for two tensors.
    aliases = tuple(inputs.index(a) for a in inputs)
    key = (fn_key, consts, tuple(metas), aliases)
    try:
        hash(key)
    except TypeError:  # a list argument (conv strides): its repr is its value
        key = (fn_key[0], repr(fn_key[1:]), repr(consts), tuple(metas), aliases)
    return key


def written_inside(nodes: list[fx.Node], last: fx.Node) -> fx.Node | None:
    """An op outside ``nodes`` writing a tensor in place between the first of them and ``last``.

    Export keeps in-place ops (``mul_``, ``copy_``); a replacement computed at ``last`` would read
    the inputs after the write, where the matched ops read them before it. (A match's own writes,
    such as diffusers' rotary filling ``empty_like`` by slices, are what it replaces.)
    """
    todo, n = set(nodes) - {last}, last.prev
    while todo and n.op != "root":
        if n in todo:
            todo.discard(n)
        elif n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable:
            return n
        n = n.prev
    return None


def replace_node(old: fx.Node, new: fx.Node, *extra_dead: fx.Node) -> None:
    """Point every user of ``old`` at ``new`` and erase ``old`` (then ``extra_dead``, if unused)."""
    old.replace_all_uses_with(new)
    old.graph.erase_node(old)
    for n in extra_dead:
        if not n.users:
            n.graph.erase_node(n)


def leave(node: fx.Node, reason: str, timing: Any = None) -> None:
    node.meta[LEFT] = reason
    if timing is not None:
        node.meta[TIMED] = timing


def kept_for_speed(node: fx.Node, timing: Any) -> bool:
    """Leave ``node`` as ATen (and say why) when autotune found ATen faster; True if it did."""
    if timing is None or timing.amxopt_wins:
        return False
    leave(node, f"ATen is faster here: {timing}", timing)
    return True


def is_constant(node: Any) -> bool:
    """A tensor fixed at load time: a parameter/buffer, possibly reshaped or cast."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        return True
    return (
        node.op == "call_function"
        and node.target in _CONST_OPS
        and all(is_constant(a) for a in node.all_input_nodes)
        and bool(node.all_input_nodes)
    )


_aten = torch.ops.aten
_CONST_OPS = {
    _aten.view.default,
    _aten.reshape.default,
    _aten.to.dtype,
    _aten._to_copy.default,
    _aten.t.default,
    _aten.contiguous.default,
}


_VIEW_OPS = {
    _aten.view.default,
    _aten.reshape.default,
    _aten._unsafe_view.default,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
    _aten.flatten.using_ints,
    _aten.alias.default,
    _aten.detach.default,
}


def source_attr(node: fx.Node) -> fx.Node | None:
    """The ``get_attr`` a constant comes from, through shape-only ops; ``None`` if it is computed."""
    while node.op != "get_attr":
        if node.op != "call_function" or node.target not in _VIEW_OPS or len(node.all_input_nodes) != 1:
            return None
        node = node.all_input_nodes[0]
    return node


def evaluate_constant(node: fx.Node, gm: fx.GraphModule, memo: dict) -> torch.Tensor:
    """Run the constant subgraph ending at ``node`` (get_attr plus reshapes/casts) eagerly."""
    if node not in memo:
        if node.op == "get_attr":
            memo[node] = fetch(gm, node.target)
        else:
            args = fx.node.map_arg(node.args, lambda n: evaluate_constant(n, gm, memo))
            kwargs = fx.node.map_arg(node.kwargs, lambda n: evaluate_constant(n, gm, memo))
            memo[node] = node.target(*args, **kwargs)
    return memo[node]


def first_attr(node: fx.Node) -> fx.Node | None:
    """The first get_attr behind a constant, following first inputs through casts too (names derived buffers)."""
    while node.op != "get_attr":
        if not node.all_input_nodes:
            return None
        node = node.all_input_nodes[0]
    return node


def add_constant(gm: fx.GraphModule, holder: str, name: str, tensor: torch.Tensor, before: fx.Node) -> fx.Node:
    """Register ``tensor`` as buffer ``holder.name`` of ``gm`` (a fresh name) and insert its get_attr before ``before``."""
    if not hasattr(gm, holder):
        gm.add_module(holder, torch.nn.Module())
    module = gm.get_submodule(holder)
    name = name.replace(".", "_")
    while hasattr(module, name):
        name += "_"
    module.register_buffer(name, tensor)
    with gm.graph.inserting_before(before):
        return gm.graph.get_attr(f"{holder}.{name}")


def drop_unread(gm: fx.GraphModule, targets: set[str], kept: str) -> None:
    """Delete the attributes ``targets`` of ``gm`` (weights a pass replaced by packed or sliced copies)
    that no node reads any more; one still read stays, noted ``kept: also used by ...``."""
    readers = {n.target: n for n in gm.graph.nodes if n.op == "get_attr"}
    for target in sorted(targets):
        if target in readers:
            users = ", ".join(u.name for u in readers[target].users)
            leave(readers[target], f"{kept}: also used by {users}")
        else:
            owner, _, name = target.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, name)


def fetch(gm: fx.GraphModule, target: str) -> torch.Tensor:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)


def released_source(node: fx.Node) -> bool:
    """Whether the weight ``node`` reads was packed and its unpacked source released: then only the
    amxopt op can run it (autotune must not keep ATen, which would read the placeholder)."""
    src = source_attr(node) if isinstance(node, fx.Node) else None
    return src is not None and packed.is_released(fetch(src.graph.owning_module, src.target))


# Set on a GraphModule while run_passes runs the pass list: its code is generated once, at the end.
DEFER_RECOMPILE = "_amxopt_defer_recompile"


def cleanup(gm: fx.GraphModule) -> None:
    """Shared end of every pass: drop dead nodes, check the graph, regenerate code (unless the pass
    runs inside run_passes, which regenerates it once after the last pass)."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    if not getattr(gm, DEFER_RECOMPILE, False):
        gm.recompile()


def dtype_of(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


@functools.cache
def op_name(target: Any) -> str:
    return str(target).replace("torch.ops.", "") if not isinstance(target, str) else target
