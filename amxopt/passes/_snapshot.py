"""A pass's view of the graph as networkx, for ``amxopt dump``: node kinds, labels, module paths."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import fx

from amxopt.passes._graph import LEFT, op_name
from amxopt.patterns import AMX_KINDS

if TYPE_CHECKING:
    import networkx as nx


def snapshot(gm: fx.GraphModule) -> nx.DiGraph:
    """The graph as networkx: one node per fx node (kind, label, detail, module path), edges by use."""
    import networkx as nx  # only dumps need it: not imported with amxopt

    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(node.name, kind=_kind(node), label=_label(node), detail=_detail(node), modules=_modules(node))
        for a in node.all_input_nodes:
            g.add_edge(a.name, node.name)
    return g


def _kind(node: fx.Node) -> str:
    if node.op in ("placeholder", "get_attr"):
        return "input"
    if node.op == "output":
        return "output"
    if node.target in AMX_KINDS:
        return "replaced"
    return "left" if LEFT in node.meta else "aten"


def _label(node: fx.Node) -> str:
    if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload):
        return op_name(node.target).removeprefix("aten.").removesuffix(".default")
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))  # operator.getitem, math.floor
    return node.target if node.op == "get_attr" else node.name


def _detail(node: fx.Node) -> str:
    v = node.meta.get("val")
    shape = f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" if isinstance(v, torch.Tensor) else ""
    text = f"{node.name}: {op_name(node.target) if node.op == 'call_function' else node.op} {shape}".strip()
    return f"{text}\nleft: {node.meta[LEFT]}" if LEFT in node.meta else text


def _modules(node: fx.Node) -> tuple[str, ...]:
    return tuple(path for path, _ in node.meta.get("nn_module_stack", {}).values())
