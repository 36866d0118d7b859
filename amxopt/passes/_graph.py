"""Graph mechanics shared by the passes: inserting traced replacements, notes, clean-up.

Layouts: export records ``aten.view`` where the eager tensor it saw could be viewed (a user's
``.view()``, and ``reshape`` inside a replacement ``insert_traced`` traced on fake values). A
replacement may lay its output out otherwise than the op it replaces (``amxopt.patch_embed`` and
``amxopt.conv2d`` write channels-last, ``amxopt.rotary_embedding`` and the glue ops contiguous where
eager kept a transposed input's order, the SDPA replacement ``[B, S, H, D]`` where eager returned
contiguous ``[B, H, S, D]``), and a view downstream may then not apply. ``relayout`` marks such a
replacement (``LAYOUT``) and every pass's ``cleanup`` turns the views after it into reshapes: a view
wherever the new layout allows one (no cost), else a copy. A view sharing memory with a tensor
written in place would lose that sharing as a copy; ``relayout`` refuses the rewrite then.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from amxopt.ops import packed
from amxopt.patterns import AMX_KINDS

# node.meta keys written by the passes and read by the report.
REPLACED = "amxopt_replaced"  # on a new amxopt node: the aten op it replaced
LEFT = "amxopt_left"  # on an aten node a pass chose to keep: why
LEFT_KIND = "amxopt_left_kind"  # on a kept glue chain's root (an add, an empty_like): the report's kind
# on another kind's node (a modulate's layer_norm, or what replaced it):
# [(glue kind, why a rule left it, the autotune Timing if that was why, else None)]
GLUE_LEFT = "amxopt_glue_left"
TIMED = "amxopt_timing"  # on a new amxopt node or a kept aten node: the autotune Timing that decided it
SHARDED = "amxopt_sharded"  # on a row-parallel Linear: which tp shard the graph computes
LAYOUT = "amxopt_layout"  # on a new node: laid out otherwise than export saw the node it replaced
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
        if isinstance(f, torch.Tensor):
            metas.append((f.dtype, f.device, tuple(map(str, f.shape)), tuple(map(str, f.stride()))))
        elif isinstance(f, (bool, int, float, torch.SymBool, torch.SymInt, torch.SymFloat)):
            # A number the graph computes (a varlen attention's max_seqlen): the trace reads it as its
            # value, or as its symbolic expression where it has one (Wan's 30 rotary attentions each
            # took a trace of 0.1 s).
            metas.append((type(f), str(f)))
        else:
            return None
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


def erase_inserted(after: fx.Node, before: fx.Node) -> None:
    """Erase the nodes between ``after`` and ``before`` (a replacement inserted there, not yet used)."""
    while before.prev is not after:
        before.graph.erase_node(before.prev)


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether every view that applies to ``a`` applies to ``b`` (same strides wherever a dim may be
    longer than one); False when that cannot be shown."""
    if a.dim() != b.dim():
        return False
    return all(
        statically_known_true(n == 1) or statically_known_true(s == t)
        for n, s, t in zip(a.shape, a.stride(), b.stride())
    )


def relayout(old: fx.Node, new: fx.Node) -> str | None:
    """Before ``new`` replaces ``old``: mark it ``LAYOUT`` if it is laid out otherwise than export saw
    ``old`` (or ``old`` was so marked), so that ``cleanup`` turns the views after it into reshapes.

    Returns why ``new`` cannot replace ``old``, or None: a view after ``old`` that would become a
    reshape shares memory with a tensor written in place (``y = f(x); z = y.view(-1); z.add_(1)``
    writes ``y`` too; a reshape that copies would not). The caller then leaves ``old`` as it is.
    """
    was, now = val(old), val(new)
    if not old.meta.get(LAYOUT):
        if not isinstance(was, torch.Tensor) or not isinstance(now, torch.Tensor) or same_layout(was, now):
            return None
    otherwise = f"its replacement is laid out otherwise (strides {_strides(now)}, not {_strides(was)})"
    after = _after([old])
    if raw := next((n for n in after if n.target in _BY_STRIDES), None):
        return f"{otherwise}, and {raw.name} after it reads its memory by strides ({op_name(raw.target)})"
    for view in (n for n in after if n.target is _aten.view.default):
        written = written_alias(view)
        if written is not None:
            return (
                f"{otherwise}, and a view after it ({view.name}) shares memory with a tensor {written.name} "
                "writes in place"
            )
    new.meta[LAYOUT] = True
    return None


def _strides(t: Any) -> tuple:
    return tuple(t.stride()) if isinstance(t, torch.Tensor) else ()


def reshape_stale_views(gm: fx.GraphModule) -> None:
    """Turn the views after every ``LAYOUT`` node into reshapes: a view where the layout allows one,
    else a copy. Run by ``cleanup``, so the views a later pass traces after such a node on its recorded
    (eager) layout are caught too. A view sharing memory with a tensor written in place stays a view:
    ``relayout`` refused every rewrite that had one after it, and replacements write nothing in place,
    so none is found here; if one were, it fails loudly where a copy would silently lose the write."""
    seeds = [n for n in gm.graph.nodes if n.meta.get(LAYOUT)]
    for view in _after(seeds):
        if view.target is _aten.view.default and written_alias(view) is None:
            view.target = _aten.reshape.default


def _after(starts: list[fx.Node]) -> list[fx.Node]:
    """The nodes whose input's layout may follow one of ``starts``': everything downstream, through
    any op but those whose output layout is their own whatever their inputs' (a GEMM, amxopt's ops
    but conv2d, whose reference follows its input's)."""
    todo, seen, after = list(starts), set(starts), []
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            after.append(user)
            if user.target not in _FIXED_LAYOUT and not (user.target in AMX_KINDS and user.target not in _FOLLOWS):
                todo.append(user)
    return after


def _aliases_input(node: fx.Node) -> bool:
    """``node``'s output shares memory with its first argument (a view, an in-place op, an item of a split)."""
    if node.op != "call_function" or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is operator.getitem:
        return _aliases_input(node.args[0])
    op = node.target
    return isinstance(op, torch._ops.OpOverload) and any(r.alias_info is not None for r in op._schema.returns)


def _writes(node: fx.Node, tensor: fx.Node) -> bool:
    """``node`` writes ``tensor`` in place (an argument its schema marks as written)."""
    op = node.target
    if node.op != "call_function" or not isinstance(op, torch._ops.OpOverload) or not op._schema.is_mutable:
        return False
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
            if value is tensor or (isinstance(value, (list, tuple)) and any(v is tensor for v in value)):
                return True
    return False


def written_alias(node: fx.Node) -> fx.Node | None:
    """An op writing in place a tensor that shares memory with ``node``: its base (up through views)
    or any view of that base (down through views and in-place ops)."""
    base = node
    while _aliases_input(base):
        base = base.args[0]
    todo, seen = [base], {base}
    while todo:
        n = todo.pop()
        for user in n.users:
            if _writes(user, n):
                return user
            if user not in seen and _aliases_input(user) and user.args[0] is n:
                seen.add(user)
                todo.append(user)
    return None


def leave(node: fx.Node, reason: str, timing: Any = None) -> None:
    node.meta[LEFT] = reason
    if timing is not None:
        node.meta[TIMED] = timing


def is_constant(node: Any) -> bool:
    """A tensor fixed at load time: a parameter/buffer, possibly reshaped or cast, that the graph
    writes nowhere in place (``self.w.view(-1).mul_(0.5)`` before ``F.linear(x, self.w)``)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "get_attr":
        return written_alias(node) is None
    return (
        node.op == "call_function"
        and node.target in _CONST_OPS
        and all(is_constant(a) for a in node.all_input_nodes)
        and bool(node.all_input_nodes)
    )


def not_constant(node: Any, what: str) -> str | None:
    """Why ``node`` (an op's ``what``) is no tensor fixed at load time, for a report; None if it is one."""
    if is_constant(node):
        return None
    if isinstance(node, fx.Node) and node.op == "placeholder":
        return f"{what} is an input of the call, not a constant"
    written = next((w for a in attrs_behind(node) if (w := written_alias(a)) is not None), None)
    if written is not None:
        return f"{what} is written in place in the graph ({written.name}), not a constant"
    return f"{what} is computed in the graph, not a constant"


def attrs_behind(node: fx.Node) -> list[fx.Node]:
    """The get_attr nodes a constant is computed from."""
    seen, todo, found = set(), [node], []
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "get_attr":
            found.append(n)
        todo += n.all_input_nodes
    return found


_aten = torch.ops.aten
_CONST_OPS = {
    _aten.view.default,
    _aten.reshape.default,
    _aten.to.dtype,
    _aten._to_copy.default,
    _aten.t.default,
    _aten.contiguous.default,
    _aten.unsqueeze.default,  # (a Conv2d patch embedding's weight, as the Conv3d one's)
    _aten.squeeze.dim,
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


# Ops whose output is laid out alike whatever their inputs' layouts (a GEMM's fresh output; the amxopt
# ops, whose fakes fix it, contiguous or channels-last by shape): a layout change stops there.
_FIXED_LAYOUT = {_aten.linear.default, _aten.mm.default, _aten.addmm.default, _aten.bmm.default}
# Ops that read memory by the strides they are given (a hand-written unfold), not by the tensor's own.
_BY_STRIDES = {_aten.as_strided.default, _aten.as_strided_.default, _aten.as_strided_copy.default}
_FOLLOWS = {torch.ops.amxopt.conv2d.default}  # but conv2d's reference, F.conv2d, follows its input's


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


# Calls kept for what they do to torch's own state although no node reads their result: export
# brackets a vmap (flex attention's block mask is one) with its level counter, and without them the
# vmap's batch dims are left unpaired and the graph fails at every call.
_STATEFUL_MODULES = frozenset({"torch._functorch.predispatch"})


def _impure(node: fx.Node) -> bool:
    return node.is_impure() or (
        node.op == "call_function" and getattr(node.target, "__module__", None) in _STATEFUL_MODULES
    )


def drop_dead_code(gm: fx.GraphModule) -> None:
    """``eliminate_dead_code``, keeping the calls made for their effect on torch's state."""
    gm.graph.eliminate_dead_code(is_impure_node=_impure)


def cleanup(gm: fx.GraphModule) -> None:
    """Shared end of every pass: drop dead nodes, check the graph, regenerate code (unless the pass
    runs inside run_passes, which regenerates it once after the last pass)."""
    drop_dead_code(gm)
    reshape_stale_views(gm)
    gm.graph.lint()
    if not getattr(gm, DEFER_RECOMPILE, False):
        gm.recompile()


def hint(size: Any) -> Any:
    """A size's value in the example: a dynamic size's hint (None for an unbacked one), else the size."""
    return size.node.hint if isinstance(size, torch.SymInt) else size


def dtype_of(node: Any) -> torch.dtype | None:
    v = val(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


@functools.cache
def op_name(target: Any) -> str:
    return str(target).replace("torch.ops.", "") if not isinstance(target, str) else target
