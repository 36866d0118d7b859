"""shard_tensor_parallel: turn the rewritten graph into one rank's shard (``AmxConfig.tp`` > 1).

Why: a Xeon's sockets / NUMA nodes each run one rank on their own cores and memory (what SGLang
does for these encoders); each rank computes 1/tp of every block's attention heads and MLP width.

What it shards, per unit inside a repeated block (an item of a ModuleList: ``blocks.3``, ``layers.0``):
- attention: the Linear(s) producing q, k and v are column-parallel: rank r keeps heads
  ``[r*h, (r+1)*h)`` of the heads padded to a multiple of tp (``h = padded / tp``); GQA kv heads
  are split alongside when both counts divide tp, else each rank keeps the kv head of each of its
  q heads. The Linear after the attention is row-parallel, followed by an all-reduce;
- MLP: the Linear(s) before the activation column-parallel (width padded to a multiple of tp), the
  one after row-parallel + all-reduce.
Padded heads and columns get zero weights and bias, and the row-parallel weight's columns for them
are zero: they contribute exactly zero. The row-parallel bias is added on rank 0 only; a residual
fused into that Linear is added again after the all-reduce (added on rank 0, it would be rounded
at its own scale once per rank in a bf16 all-reduce: 2.2x eager's error at tp 3 in a test). Everything
outside the units (norms, patch embedding, positions, mergers, the timestep MLPs) is replicated.

Between column and row Linear the pass follows where the head index lives in each tensor (its dim,
the elements per head, and any outer factor such as the 3 of a fused qkv) and rewrites what bakes
the global count in: view/reshape sizes and ``amxopt.linear``'s ``out_features``. An RMSNorm across
all heads (Wan's q/k norm) becomes a local sum of squares, an all-reduce and the global divisor.
A unit with an op whose effect on the head dim the pass does not know is left replicated, with the
reason in the report. The collectives are torch.distributed functional collectives, so the graph
stays one fx graph that the dumps show.

    before:  qkv = amxopt.linear(x, pack(W_qkv), b_qkv, "none", 3*H*D);  q, k, v = unbind(view(qkv, [T, 3, H, D]) ...)
             y = amxopt.linear(view(amxopt.varlen_attention(q, k, v, ...), [T, H*D]), pack(W_o), b_o, "none", C)
    after:   qkv = amxopt.linear(x, pack(W_qkv[rank rows]), b_qkv[rank rows], "none", 3*h*D);  view(qkv, [T, 3, h, D]) ...
             y = wait_tensor(all_reduce(amxopt.linear(view(o, [T, h*D]), pack(W_o[:, rank cols]), b_o | None, "none", C), "sum"))
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import re

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.ops import packed
from amxopt.passes._graph import (
    LEFT,
    LEFT_KIND,
    SHARDED,
    add_constant,
    arg,
    cleanup,
    drop_dead_code,
    drop_unread,
    evaluate_constant,
    fetch,
    first_attr,
    is_constant,
    leave,
    op_name,
    source_attr,
    val,
    written_alias,
)

logger = logging.getLogger(__name__)

aten = torch.ops.aten
_LINEAR = torch.ops.amxopt.linear.default
_PACK = torch.ops.amxopt.pack_linear_weight.default
_VARLEN = torch.ops.amxopt.varlen_attention.default
_SDPA = aten.scaled_dot_product_attention.default  # kept as ATen where autotune measured it faster
_ATTENTION = (_VARLEN, _SDPA)  # q, k, v first, heads at dim 1 ([T, H, D] and [B, H, S, D])
_RMS = torch.ops.amxopt.rms_norm.default
_LAYER_NORM = torch.ops.amxopt.layer_norm.default
_ROTARY = torch.ops.amxopt.rotary_embedding.default  # per head: rotates pairs within the last dim
_ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_SHARD_PREFIX = "_tp"
_MAX_UNIT_NODES = 400  # a closure larger than a block's attention or MLP is not one unit
_BLOCK = re.compile(r"(?:^|[._\['])(?:blocks|layers|layer|h|block|resblocks)(?:\.|\[)\d+")

# Ops that keep every dim where it is (elementwise, casts, copies); replicated operands broadcast.
_POINTWISE = {
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor, aten.neg.default, aten.add.Scalar,
    aten.mul.Scalar, aten.sub.Scalar, aten.div.Scalar, aten.to.dtype, aten._to_copy.default, aten.clone.default,
    aten.contiguous.default, aten.gelu.default, aten.silu.default, aten.alias.default, aten.detach.default,
    aten.type_as.default, aten.pow.Tensor_Scalar, aten.rsqrt.default, aten.tanh.default, aten.sigmoid.default,
    aten.relu.default, aten.to.dtype_layout, aten.dropout.default, aten.empty_like.default, aten.copy_.default,
}  # fmt: skip
_VIEWS = {aten.view.default, aten.reshape.default, aten._unsafe_view.default}
_RESHAPING = _VIEWS | {
    aten.permute.default, aten.transpose.int, aten.unsqueeze.default, aten.squeeze.dim, aten.unbind.int,
    aten.select.int, aten.slice.Tensor, aten.cat.default, aten.flatten.using_ints, aten.unflatten.int,
    aten.slice_scatter.default,
}  # fmt: skip


_BETWEEN = _POINTWISE | _RESHAPING | {*_ATTENTION, _RMS, _LAYER_NORM, _ROTARY, operator.getitem}

# --------------------------------------------------------------------------------------------------
# Head arithmetic (pure: the hypothesis properties test it directly)
# --------------------------------------------------------------------------------------------------


def padded(count: int, tp: int) -> int:
    """``count`` rounded up to a multiple of ``tp``."""
    return -(-count // tp) * tp


def owned_heads(heads: int, tp: int, rank: int) -> list[int | None]:
    """The global heads rank ``rank`` computes; ``None`` marks a padding head (zero weights)."""
    local = padded(heads, tp) // tp
    return [h if h < heads else None for h in range(rank * local, (rank + 1) * local)]


def owned_kv_heads(q_heads: int, kv_heads: int, tp: int, rank: int) -> list[int | None]:
    """The kv heads rank ``rank`` keeps, in the order its q heads use them.

    Split alongside the q heads when both counts divide ``tp`` (local GQA groups stay whole);
    otherwise one kv head per local q head (the kv head that q head reads; padding heads read
    head 0, which their zero row-parallel columns discard).
    """
    if kv_heads == q_heads:
        return owned_heads(q_heads, tp, rank)
    if q_heads % tp == 0 and kv_heads % tp == 0:
        return owned_heads(kv_heads, tp, rank)
    group = q_heads // kv_heads
    return [h // group if h is not None else 0 for h in owned_heads(q_heads, tp, rank)]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the sharded index lives in a tensor: dim ``dim`` is ``outer x count x unit`` (row-major);
    the index over ``count`` (heads, or MLP columns) is what ranks split. ``owned`` lists the
    global indices this rank keeps (``None``: padding)."""

    dim: int
    count: int
    unit: int
    outer: int
    owned: tuple[int | None, ...]

    @property
    def local_size(self) -> int:
        return self.outer * len(self.owned) * self.unit

    def index(self) -> list[int | None]:
        """The global positions along ``dim`` this rank keeps, in order (``None``: a zero of padding)."""
        out: list[int | None] = []
        for o in range(self.outer):
            for h in self.owned:
                base = (o * self.count + h) * self.unit if h is not None else None
                out += [base + u if base is not None else None for u in range(self.unit)]
        return out


def gather(t: torch.Tensor, dim: int, index: list[int | None]) -> torch.Tensor:
    """``t``'s slices along ``dim`` at ``index``, zeros where it is ``None`` (a copy)."""
    picks = torch.tensor([i if i is not None else 0 for i in index], dtype=torch.long)
    out = t.index_select(dim, picks)
    pad = [j for j, i in enumerate(index) if i is None]
    if pad:
        out.index_fill_(dim, torch.tensor(pad, dtype=torch.long), 0)
    return out.contiguous()


class _Refuse(Exception):
    """This unit cannot be sharded; the message says why (it is left replicated)."""


# --------------------------------------------------------------------------------------------------
# Finding units: column Linears, the nodes between, one row Linear
# --------------------------------------------------------------------------------------------------


def _is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (_LINEAR, aten.linear.default)


def _weight_consumer(linear: fx.Node) -> fx.Node:
    """The node that reads the weight: ``amxopt.linear``'s pack node, or ``aten.linear`` itself."""
    w = linear.args[1]
    return w if linear.target == _LINEAR and isinstance(w, fx.Node) and w.target == _PACK else linear


def _weight(linear: fx.Node) -> fx.Node:
    consumer = _weight_consumer(linear)
    return consumer.args[0] if consumer is not linear else linear.args[1]


def _bias(node: fx.Node) -> fx.Node | None:
    return arg(node, 2, "bias")


@dataclasses.dataclass
class _Unit:
    columns: list[fx.Node]
    nodes: list[fx.Node]  # between columns and row, in graph order
    row: fx.Node


def _closure(start: fx.Node) -> tuple[set[fx.Node], set[fx.Node]] | str:
    """Nodes reachable from ``start`` through non-Linear ops, and the Linears that end it; or why
    not, when the flow leaves through something other than a Linear's input (an output, an op the
    pass does not know, a residual path that runs on)."""
    inside, ends, todo = set(), set(), [start]
    while todo:
        node = todo.pop()
        for user in node.users:
            if _is_linear(user) and user.args[0] is node:
                ends.add(user)
            elif user.target is aten.sym_size.int:
                continue  # a size read: checked against the sharded dim by _plan
            elif user.op == "call_function" and user.target in _BETWEEN:
                if user not in inside:
                    inside.add(user)
                    if len(inside) > _MAX_UNIT_NODES:
                        return f"its output flows through more than {_MAX_UNIT_NODES} nodes"
                    todo.append(user)
            else:
                return f"{user.name} ({op_name(user.target)}) is not an op the pass can follow"
    return inside, ends


def _producer(node: fx.Node) -> fx.Node | None:
    """The nearest Linear upstream of ``node`` (breadth-first), if any."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop(0)
        if _is_linear(n):
            return n
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return None


def _in_block(node: fx.Node) -> bool:
    stack = node.meta.get("nn_module_stack") or {}
    return any(_BLOCK.search(path) for path, _ in stack.values())


def _units(gm: fx.GraphModule) -> tuple[list[_Unit], list[tuple[fx.Node, str]], dict[fx.Node, str]]:
    """The units, Linears left with a reason, and why each other block Linear starts no unit."""
    closures, why_not = {}, {}
    for node in gm.graph.nodes:
        if _is_linear(node) and is_constant(_weight(node)) and _in_block(node):
            found = _closure(node)
            if isinstance(found, str):
                why_not[node] = found
            elif len(found[1]) != 1:
                why_not[node] = f"its output reaches {len(found[1])} Linears"
            else:
                closures[node] = found
    # Column Linears ending at the same row Linear (q, k and v; gate and up) are one unit.
    groups: dict[fx.Node, tuple[list[fx.Node], set[fx.Node]]] = {}
    for col, (inside, ends) in closures.items():
        (row,) = ends
        cols, nodes = groups.setdefault(row, ([], set()))
        cols.append(col)
        nodes.update(inside)
    units, left = [], []
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for row, (cols, inside) in groups.items():
        has_attention = any(n.target in _ATTENTION for n in inside)
        if not _in_block(row):
            continue
        if not (has_attention or all(n.target in _POINTWISE for n in inside)):  # not an MLP either
            others = sorted({op_name(n.target) for n in inside if n.target not in _POINTWISE})
            left.append((row, f"the ops between its Linears are not all elementwise ({', '.join(others)})"))
            continue
        if row.target == _LINEAR and row.args[3] != "none":
            left.append((row, f"row-parallel Linear has a fused {row.args[3]} (it must follow the all-reduce)"))
            continue
        if not is_constant(_weight(row)):
            continue
        computed = [
            n.name for n in (*sorted(cols, key=order.get), row) if _bias(n) is not None and not is_constant(_bias(n))
        ]
        if computed:  # (a shard slices its bias, or adds it once: a constant's, at load time)
            left.append((row, f"the bias of {', '.join(computed)} is computed in the graph, not a constant"))
            continue
        units.append(_Unit(sorted(cols, key=order.get), sorted(inside, key=order.get), row))
    # A Linear that ends one unit and starts another (a LoRA adapter's B on q: A -> B is an MLP of
    # rank r, and B's output joins q's heads) is a column of the second: the first stays replicated.
    columns = {col for unit in units for col in unit.columns}
    return [unit for unit in units if unit.row not in columns], left, why_not


def _unfuse_column_residuals(gm: fx.GraphModule, units: list[_Unit]) -> bool:
    """Un-fuse the residual of each column Linear (q + a LoRA adapter's output, fused by
    ``fuse_residual``): the add after it is sharded with its output, where the kwarg would add a
    whole-width tensor to a rank's heads. Returns whether any was un-fused (the units change)."""
    changed = False
    for col in (col for unit in units for col in unit.columns):
        residual = col.kwargs.get("residual") if col.target == _LINEAR else None
        if residual is None:
            continue
        col.kwargs = {k: v for k, v in col.kwargs.items() if k != "residual"}
        with gm.graph.inserting_after(col):
            added = gm.graph.call_function(aten.add.Tensor, (col, residual))
        added.meta["val"] = val(col)
        _copy_source(col, added)
        col.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
        changed = True
    return changed


# --------------------------------------------------------------------------------------------------
# Layout propagation
# --------------------------------------------------------------------------------------------------


def _shape(node: fx.Node) -> list:
    v = val(node)
    if isinstance(v, (list, tuple)) and node.target is aten.unbind.int:
        v = v[0]
    if not isinstance(v, torch.Tensor):
        raise _Refuse(f"{node.name} is not a tensor")
    return list(v.shape)


def _static(x) -> int:
    if isinstance(x, int):
        return x
    raise _Refuse("the head dims are symbolic")


def _flat_digit(shape: list, layout: Layout) -> tuple[int, int]:
    """(elements below one index step, count) of the sharded index in row-major flat order."""
    below = layout.unit * math.prod(_static(s) for s in shape[layout.dim + 1 :])
    return below, layout.count


def _remap(src: list, dst: list, layout: Layout) -> Layout:
    """The layout in ``dst`` (same elements as ``src``, another shape) of ``layout`` in ``src``."""
    below, count = _flat_digit(src, layout)
    stride = 1
    for j in range(len(dst) - 1, -1, -1):
        size = _static(dst[j])
        if stride <= below and below * count <= stride * size:
            if below % stride or (stride * size) % (below * count):
                break
            unit = below // stride
            outer = size // (unit * count)
            if layout.outer > 1 and outer * count * unit != size:
                break
            return Layout(j, count, unit, outer, layout.owned)
        stride *= size
    raise _Refuse(f"a reshape {src} -> {dst} splits the sharded index")


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _forward(node: fx.Node, layouts: dict[fx.Node, Layout]) -> Layout | None:
    """The layout of ``node``'s output from its inputs' (``None``: the output is not sharded)."""
    t = node.target
    if t is operator.getitem:  # an item of unbind's outputs: unbind's layout is its items'
        return layouts.get(node.args[0])
    if t is aten.cat.default:
        ins = [(0, a) for a in node.args[0] if isinstance(a, fx.Node) and a in layouts]
    elif t is aten.type_as.default:  # the second tensor gives only its dtype
        return layouts.get(node.args[0])
    else:
        ins = [(i, a) for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a in layouts]
    if not ins:
        return None
    if t in _POINTWISE:
        rank = len(_shape(node))
        outs = {dataclasses.replace(layouts[a], dim=layouts[a].dim + rank - len(_shape(a))) for _, a in ins}
        if len(outs) != 1:
            raise _Refuse(f"{node.name} combines differently sharded tensors {sorted(map(str, outs))}")
        (out,) = outs
        for a in node.args:
            if isinstance(a, fx.Node) and a not in layouts and isinstance(val(a), torch.Tensor):
                shape = _shape(a)
                d = out.dim - (rank - len(shape))
                if d >= 0 and shape[d] != 1:
                    raise _Refuse(f"{node.name}: replicated operand {a.name} {shape} spans the sharded dim")
        return out
    src = ins[0][1]
    lay, in_shape = layouts[src], _shape(src)
    if t in _VIEWS or t in (aten.flatten.using_ints, aten.unflatten.int):
        return _remap(in_shape, _shape(node), lay)
    if t is aten.permute.default:
        perm = [_norm_dim(p, len(in_shape)) for p in node.args[1]]
        return dataclasses.replace(lay, dim=perm.index(lay.dim))
    if t is aten.transpose.int:
        a, b = (_norm_dim(d, len(in_shape)) for d in node.args[1:3])
        return dataclasses.replace(lay, dim={a: b, b: a}.get(lay.dim, lay.dim))
    if t is aten.unsqueeze.default:
        d = _norm_dim(node.args[1], len(in_shape) + 1)
        return dataclasses.replace(lay, dim=lay.dim + (d <= lay.dim))
    if t in (aten.squeeze.dim, aten.unbind.int, aten.select.int):
        d = _norm_dim(arg(node, 1, "dim", 0), len(in_shape))
        if d == lay.dim:
            raise _Refuse(f"{node.name} removes the sharded dim")
        return dataclasses.replace(lay, dim=lay.dim - (d < lay.dim))
    if t in (aten.slice.Tensor, aten.cat.default):
        d = _norm_dim(arg(node, 1, "dim", 0), len(in_shape))
        if d == lay.dim:
            raise _Refuse(f"{node.name} slices or concatenates along the sharded dim")
        if t is aten.cat.default and any(not (isinstance(a, fx.Node) and layouts.get(a) == lay) for a in node.args[0]):
            raise _Refuse(f"{node.name} concatenates sharded and replicated tensors")
        return lay
    if t in (_RMS, _LAYER_NORM, _ROTARY):
        if lay.dim == len(in_shape) - 1:
            raise _Refuse(f"{node.name} works across the sharded dim")  # norms: handled by _shard_norm first
        return lay
    if t in _ATTENTION:
        if t is _SDPA and arg(node, 3, "attn_mask") is not None:
            raise _Refuse(f"{node.name} has an attention mask")
        return layouts[node.args[0]]
    raise _Refuse(f"{node.name} ({t}) is not known to keep the sharded dim in place")


def _backward(node: fx.Node, user: fx.Node, out: Layout) -> Layout:
    """The layout of ``node`` (an input of ``user``) that gives ``user`` the output layout ``out``."""
    t = user.target
    if t is operator.getitem:
        return out
    shape = _shape(node) if t is not aten.unbind.int else list(val(node).shape)
    if t in _POINTWISE:
        return dataclasses.replace(out, dim=out.dim - (len(_shape(user)) - len(shape)))
    if t in _VIEWS or t in (aten.flatten.using_ints, aten.unflatten.int):
        return _remap(_shape(user), shape, out)
    if t is aten.permute.default:
        perm = [_norm_dim(p, len(shape)) for p in user.args[1]]
        return dataclasses.replace(out, dim=perm[out.dim])
    if t is aten.transpose.int:
        a, b = (_norm_dim(d, len(shape)) for d in user.args[1:3])
        return dataclasses.replace(out, dim={a: b, b: a}.get(out.dim, out.dim))
    if t is aten.unsqueeze.default:
        d = _norm_dim(user.args[1], len(shape) + 1)
        if d == out.dim:
            raise _Refuse(f"{user.name} inserts the sharded dim")
        return dataclasses.replace(out, dim=out.dim - (d < out.dim))
    if t in (aten.squeeze.dim, aten.unbind.int, aten.select.int):
        d = _norm_dim(arg(user, 1, "dim", 0), len(shape))
        return dataclasses.replace(out, dim=out.dim + (d <= out.dim))
    if t in (aten.slice.Tensor, aten.cat.default, _RMS, _LAYER_NORM, _ROTARY, *_ATTENTION):
        return out
    raise _Refuse(f"{user.name} ({t}) is not known to keep the sharded dim in place")


def _column_layouts(
    unit: _Unit, tp: int, rank: int
) -> tuple[dict[fx.Node, Layout], list[tuple[fx.Node, Layout]], int | None]:
    """Each column Linear's output layout, from the attention's heads or the MLP width; the layouts
    the attention's q, k and v must arrive in (none for an MLP); and the kv head count where ranks
    keep kv heads per q head (so some kv heads on several ranks, or twice on one), else None."""
    attention = [n for n in unit.nodes if n.target in _ATTENTION]
    if not attention:
        widths = {_static(_shape(c)[-1]) for c in unit.columns}
        if len(widths) != 1:
            raise _Refuse(f"column Linears of different widths {sorted(widths)}")
        (n,) = widths
        rank_of = {c: len(_shape(c)) - 1 for c in unit.columns}
        return {c: Layout(rank_of[c], n, 1, 1, tuple(owned_heads(n, tp, rank))) for c in unit.columns}, [], None
    if len(attention) != 1:
        raise _Refuse(f"{len(attention)} attentions between one set of Linears")
    (att,) = attention
    q_heads, kv_heads = _static(_shape(att.args[0])[1]), _static(_shape(att.args[1])[1])
    if _static(_shape(att.args[2])[1]) != kv_heads or q_heads % kv_heads:
        raise _Refuse(f"{att.name}: q/k/v head counts {q_heads}/{kv_heads} are not a GQA layout")
    found: dict[fx.Node, Layout] = {}
    starts = [
        (att.args[0], Layout(1, q_heads, 1, 1, tuple(owned_heads(q_heads, tp, rank)))),
        *[(a, Layout(1, kv_heads, 1, 1, tuple(owned_kv_heads(q_heads, kv_heads, tp, rank)))) for a in att.args[1:3]],
    ]
    members = set(unit.nodes)
    for start, layout in starts:
        _walk_back(start, layout, members, set(unit.columns), found)
    missing = [c.name for c in unit.columns if c not in found]
    if missing:
        raise _Refuse(f"Linears {missing} do not reach the attention's q/k/v")
    per_q_head = kv_heads != q_heads and not (q_heads % tp == 0 and kv_heads % tp == 0)  # owned_kv_heads
    return found, starts, kv_heads if per_q_head else None


def _walk_back(node: fx.Node, layout: Layout, members: set, columns: set, found: dict) -> None:
    if node in columns:
        if found.setdefault(node, layout) != layout:
            raise _Refuse(f"{node.name} feeds q/k/v with different head layouts (GQA in one fused Linear)")
        return
    if node not in members:
        raise _Refuse(f"the attention input {node.name} does not come from a block Linear")
    inputs = [node.args[0]] if node.target is aten.type_as.default else node.all_input_nodes  # type_as: dtype only
    sources = [a for a in inputs if a in members or a in columns]
    if node.target is aten.cat.default or node.target in _POINTWISE:
        pass
    elif len(sources) != 1:
        raise _Refuse(f"{node.name} has several sharded inputs")
    for src in sources:
        _walk_back(src, _backward(src, node, layout), members, columns, found)


# --------------------------------------------------------------------------------------------------
# Rewriting one unit
# --------------------------------------------------------------------------------------------------


def _plan(unit: _Unit, tp: int, rank: int) -> tuple[dict[fx.Node, Layout], list[fx.Node]]:
    """Every sharded value's layout, and the norms across heads; raises _Refuse before any change."""
    layouts, starts, repeated_kv = _column_layouts(unit, tp, rank)
    for col in unit.columns:  # the weight's rows are what _shard gathers
        if layouts[col].dim != len(_shape(col)) - 1:
            raise _Refuse(f"{col.name}: its heads are not along its output features")
    norms = []
    for node in unit.nodes:
        src = node.args[0] if node.args else None
        lay = layouts.get(src) if isinstance(src, fx.Node) else None
        if node.target in (_RMS, _LAYER_NORM) and lay is not None and lay.dim == len(_shape(src)) - 1:
            if node.target is _LAYER_NORM:
                raise _Refuse(f"{node.name}: a LayerNorm across heads")
            if lay.count == repeated_kv:  # its all-reduced sum of squares would count some heads again
                raise _Refuse(f"{node.name}: an RMSNorm across kv heads that ranks keep per q head (repeated)")
            norms.append(node)
            layouts[node] = lay
            continue
        out = _forward(node, layouts)
        if out is not None:
            layouts[node] = out
        slot = _size_slot(node, out)
        if slot is not None:
            size = slot[0][slot[1]]
            if not (isinstance(size, int) and (size == -1 or size == _shape(node)[out.dim])):
                raise _Refuse(f"{node.name}: the sharded size is computed ({size})")
        for user in node.users:
            if (
                user.target is aten.sym_size.int
                and out is not None
                and _norm_dim(user.args[1], len(_shape(node))) == out.dim
            ):
                raise _Refuse(f"{user.name} reads the sharded size of {node.name}")
    for col in unit.columns:
        for user in col.users:
            if user.target is aten.sym_size.int and _norm_dim(user.args[1], len(_shape(col))) == layouts[col].dim:
                raise _Refuse(f"{user.name} reads the sharded size of {col.name}")
    # Propagated forward, the heads must reach the attention where walking back from it put them: a
    # reshape of one kv head ([T, D] -> [T, 1, D]) fits either the size-1 dim or the last one.
    for node, start in starts:
        if layouts.get(node) != start:
            raise _Refuse(f"{node.name}: its heads do not reach the attention along its heads dim")
    x = unit.row.args[0]
    lay = layouts.get(x)
    if lay is None or lay.dim != len(_shape(x)) - 1:
        raise _Refuse(f"the input of {unit.row.name} is not sharded along its features")
    residual = unit.row.kwargs.get("residual")
    if residual in layouts or residual in unit.columns:  # added after the all-reduce, it must be whole
        raise _Refuse(f"{unit.row.name} adds a sharded residual ({residual.name})")
    # Padding heads / columns hold zeros, which the row Linear's zero columns cancel only while they
    # stay finite: a division by, rsqrt or negative power of a padded value gives inf or NaN there,
    # and the all-reduce spreads it to every output (tanh(u) / u at a width of 5 and tp 2).
    count = starts[0][1].count if starts else layouts[unit.columns[0]].count  # q heads, or MLP width
    if padded(count, tp) != count:
        blowing = [n.name for n in unit.nodes if _not_finite_at_zero(n, layouts)]
        if blowing:
            raise _Refuse(
                f"{count} {'heads' if starts else 'columns'} are padded to {padded(count, tp)} at tp {tp}, and "
                f"{', '.join(blowing)} would turn the padding's zeros into inf or NaN"
            )
    return layouts, norms


def _not_finite_at_zero(node: fx.Node, layouts: dict[fx.Node, Layout]) -> bool:
    """Whether ``node`` can map a sharded value's zero to inf or NaN (0 / 0, rsqrt(0), 0 ** -1)."""
    if node.target is aten.div.Tensor:
        return node.args[1] in layouts
    if node.target is aten.rsqrt.default:
        return node.args[0] in layouts
    if node.target is aten.pow.Tensor_Scalar:
        exponent = node.args[1]
        return node.args[0] in layouts and not (isinstance(exponent, (int, float)) and exponent >= 0)
    if node.target in _NORMS and node.args[0] in layouts:
        # A per-head norm without eps: the padding head's variance is 0. (One across the heads dim
        # all-reduces its moments over the whole row, which the padding's zeros leave finite.)
        names = [a.name for a in node.target._schema.arguments]
        at = names.index("eps")
        eps = node.kwargs.get("eps", node.args[at] if at < len(node.args) else None)
        normalized = len(node.args[1]) if node.target in _ATEN_NORMS else 1  # the trailing dims it normalizes
        return eps == 0 and layouts[node.args[0]].dim < len(_shape(node.args[0])) - normalized
    return False


_ATEN_NORMS = (aten.layer_norm.default, aten.rms_norm.default)
_NORMS = (
    *_ATEN_NORMS,
    torch.ops.amxopt.layer_norm.default,
    torch.ops.amxopt.rms_norm.default,
    torch.ops.amxopt.norm_modulate.default,
)


def _size_slot(node: fx.Node, out: Layout | None) -> tuple[list, int] | None:
    """The size argument that bakes in the sharded dim's global size: (sizes, index), or None."""
    if out is None:
        return None
    if node.target in _VIEWS:
        return list(node.args[1]), out.dim
    if node.target is aten.unflatten.int:
        first = _norm_dim(node.args[1], len(_shape(node.args[0])))
        if first <= out.dim < first + len(node.args[2]):
            return list(node.args[2]), out.dim - first
    return None


def _const(gm: fx.GraphModule, node: fx.Node, memo: dict, sliced: set) -> torch.Tensor:
    src = source_attr(node) or first_attr(node)
    if src is not None and packed.is_released(fetch(gm, src.target)):
        raise RuntimeError(
            f"amxopt: {src.target} was released after an earlier capture, and tensor parallelism must shard it "
            "again for this graph (a call no earlier graph takes: an input in another dtype, or a shape outside "
            "their guards): optimize with AmxConfig(keep_source=True), or call in the dtype and shapes captured"
        )
    if src is not None:
        packed.mark_sharded(fetch(gm, src.target))
        sliced.add(src.target)
    return evaluate_constant(node, gm, memo)


def _put(gm: fx.GraphModule, consumer: fx.Node, old: fx.Node, tensor: torch.Tensor, name: str) -> None:
    """Make ``consumer`` read ``tensor`` (a new buffer) where it read ``old``."""
    new = add_constant(gm, _SHARD_PREFIX, name, tensor, consumer)
    fake = detect_fake_mode([val(n) for n in gm.graph.nodes if isinstance(val(n), torch.Tensor)][:1])
    new.meta["val"] = fake.from_tensor(tensor) if fake is not None else tensor
    consumer.replace_input_with(old, new)


def _shard_linear(gm: fx.GraphModule, linear: fx.Node, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    w_node, b_node = _weight(linear), _bias(linear)
    _put(gm, _weight_consumer(linear), w_node, weight, f"{linear.name}_weight")
    if b_node is not None and bias is not None:
        _put(gm, linear, b_node, bias, f"{linear.name}_bias")
    elif b_node is not None:
        linear.args = (*linear.args[:2], None, *linear.args[3:]) if len(linear.args) > 2 else linear.args
        linear.kwargs = {k: v for k, v in linear.kwargs.items() if k != "bias"}
    if linear.target == _LINEAR:
        linear.args = (*linear.args[:4], weight.shape[0], *linear.args[5:])


def _copy_source(old: fx.Node, new: fx.Node) -> None:
    """Give ``new`` the module path and stack trace of the node it stands for (read by report and dumps)."""
    new.meta.update({k: old.meta[k] for k in ("nn_module_stack", "stack_trace") if k in old.meta})


def _all_reduce_after(gm: fx.GraphModule, node: fx.Node, group: str) -> fx.Node:
    with gm.graph.inserting_after(node):
        reduced = gm.graph.call_function(_ALL_REDUCE, (node, "sum", group))
    with gm.graph.inserting_after(reduced):
        done = gm.graph.call_function(_WAIT, (reduced,))
    for n in (reduced, done):
        n.meta["val"] = val(node)
        _copy_source(node, n)
    node.replace_all_uses_with(done, delete_user_cb=lambda user: user is not reduced)
    return done


def _shard_norm(gm: fx.GraphModule, norm: fx.Node, lay: Layout, group: str, memo: dict, sliced: set) -> None:
    """RMSNorm over all heads of a sharded tensor: local sum of squares, all-reduced, over the global width."""
    x, weight, eps = norm.args[0], norm.args[1], norm.args[2]
    width = lay.outer * lay.count * lay.unit
    g = gm.graph
    with g.inserting_before(norm):
        xf = g.call_function(aten._to_copy.default, (x,), {"dtype": torch.float32})
        sq = g.call_function(aten.sum.dim_IntList, (g.call_function(aten.mul.Tensor, (xf, xf)), [-1], True))
    total = _all_reduce_after(gm, sq, group)
    with g.inserting_before(norm):
        mean = g.call_function(aten.div.Tensor, (total, float(width)))
        y = g.call_function(
            aten.mul.Tensor, (xf, g.call_function(aten.rsqrt.default, (g.call_function(aten.add.Tensor, (mean, eps)),)))
        )
        if weight is not None:
            w = _const(gm, weight, memo, sliced)
            w_local = gather(w, 0, lay.index())
            wf = g.call_function(aten._to_copy.default, (weight,), {"dtype": torch.float32})
            y = g.call_function(aten.mul.Tensor, (y, wf))
        out = g.call_function(aten._to_copy.default, (y,), {"dtype": val(x).dtype})
    if weight is not None:
        _put(gm, wf, weight, w_local, f"{norm.name}_weight")
    for n in (xf, sq, mean, y, out):
        _copy_source(norm, n)
    # the report's: an RMSNorm left as ATen ops (amxopt.rms_norm cannot sum across ranks)
    out.meta[LEFT_KIND] = "rms_norm"
    out.meta[LEFT] = "across the heads tp shards: a local sum of squares, all-reduced, in ATen ops"
    norm.replace_all_uses_with(out)
    g.erase_node(norm)


def _shard(gm: fx.GraphModule, unit: _Unit, layouts: dict, norms: list, rank: int, group: str) -> set[str]:
    """Rewrite one unit in place; returns the targets of the weights it sliced."""
    memo: dict = {}
    sliced: set[str] = set()
    for col in unit.columns:
        index = layouts[col].index()
        b = _bias(col)
        bias = gather(_const(gm, b, memo, sliced), 0, index) if b is not None else None
        _shard_linear(gm, col, gather(_const(gm, _weight(col), memo, sliced), 0, index), bias)
    for node in unit.nodes:
        slot = _size_slot(node, layouts.get(node))
        if slot is not None and slot[0][slot[1]] != -1:
            sizes, i = list(slot[0]), slot[1]
            sizes[i] = layouts[node].local_size
            at = 1 if node.target in _VIEWS else 2
            node.args = (*node.args[:at], sizes, *node.args[at + 1 :])
    for norm in norms:
        _shard_norm(gm, norm, layouts[norm], group, memo, sliced)
    row, index = unit.row, layouts[unit.row.args[0]].index()
    b = _bias(row)
    bias = _const(gm, b, memo, sliced) if b is not None and rank == 0 else None
    _shard_linear(gm, row, gather(_const(gm, _weight(row), memo, sliced), 1, index), bias)
    residual = row.kwargs.get("residual")
    row.kwargs = {k: v for k, v in row.kwargs.items() if k != "residual"}
    done = _all_reduce_after(gm, row, group)
    if residual is not None:
        with gm.graph.inserting_after(done):
            added = gm.graph.call_function(aten.add.Tensor, (done, residual))
        added.meta["val"] = val(done)
        _copy_source(row, added)
        done.replace_all_uses_with(added, delete_user_cb=lambda user: user is not added)
    return sliced


def shard_tensor_parallel(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    if not isinstance(config.tp, int) or config.tp == 1:
        return PassResult(gm, False)
    if config.tp_group is None:
        raise RuntimeError("amxopt: shard_tensor_parallel runs inside a tp rank (amxopt/runtime/tp.py sets tp_group)")
    tp, rank, group = config.tp, config.tp_rank, config.tp_group
    if not 0 <= rank < tp:
        raise ValueError(f"amxopt: shard_tensor_parallel: tp_rank {rank} is not a rank of tp {tp} (0..{tp - 1})")
    for node in gm.graph.nodes:
        write = written_alias(node) if node.op == "get_attr" else None
        if write is not None:  # in the memory every rank shares with the caller's model
            raise ValueError(
                f"amxopt: tp {tp} cannot run a model that writes its own tensor {node.target} in forward "
                f"({write.name}: {op_name(write.target)}): each rank would write it, in the memory the ranks "
                "share with the model; optimize it with tp=1"
            )
    units, left, why_not = _units(gm)
    if _unfuse_column_residuals(gm, units):
        units, left, why_not = _units(gm)
    for node, reason in left:
        leave(node, f"replicated across tp ranks: {reason}")
    n_sharded, covered, sliced = 0, set(), set()
    for unit in units:
        try:
            layouts, norms = _plan(unit, tp, rank)
        except _Refuse as e:
            attention = [n for n in unit.nodes if n.target in _ATTENTION]
            feeds = {_producer(a) for n in attention for a in n.args[:3]}
            causes = [f"{f.name}: {why_not[f]}" for f in feeds if f in why_not]
            leave(unit.row, f"replicated across tp ranks: {'; '.join([str(e), *causes])}")
            covered.update(unit.nodes)
            continue
        covered.update(unit.nodes)
        with torch.no_grad():  # the shards are constants: no autograd history (deepcopy refuses tensors with one)
            sliced |= _shard(gm, unit, layouts, norms, rank, group)
        unit.row.meta[SHARDED] = f"tp {tp}, rank {rank}"
        n_sharded += 1
    for node in gm.graph.nodes:  # a block's attention in no unit: say why
        if node.op == "call_function" and node.target in _ATTENTION and _in_block(node) and node not in covered:
            source = _producer(node.args[0])
            reason = why_not.get(source, "its q/k/v Linears and output Linear do not form one unit")
            note = f"replicated across tp ranks: {source.name if source else 'q'}: {reason}"
            leave(node, f"{node.meta[LEFT]}; {note}" if LEFT in node.meta else note)
    if not units and not left and not why_not:  # say so: both ranks would compute the whole model unasked
        first = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is _LINEAR), None)
        if first is not None:
            leave(
                first,
                "tp found no unit to shard: no Linear sits in a repeated block (an item of a ModuleList "
                "named blocks, layers, layer, h, block or resblocks); every rank computes the whole model",
            )
    if n_sharded:
        drop_dead_code(gm)
        if config.release_weights:
            drop_unread(gm, sliced, "full copy kept")
        cleanup(gm)
        _refresh_shapes(gm)
    return PassResult(gm, n_sharded > 0)


def _refresh_shapes(gm: fx.GraphModule) -> None:
    """Every node's ``meta["val"]`` as this rank computes it: the sharded Linears, views and weights
    kept the whole model's shapes, which the dumps and later passes read."""
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    fake = detect_fake_mode([v for v in inputs if isinstance(v, torch.Tensor)])
    if fake is None:
        return
    allowed, fake.allow_non_fake_inputs = fake.allow_non_fake_inputs, True  # (constants are real tensors)
    try:
        FakeTensorProp(gm, fake).propagate_dont_convert_inputs(*inputs)
    except Exception as e:  # noqa: BLE001 - shapes for reading only: the shard itself stands
        logger.warning(
            "amxopt: tp: the sharded graph's shapes were not refreshed (dumps show the whole model's): %s", e
        )
    finally:
        fake.allow_non_fake_inputs = allowed
