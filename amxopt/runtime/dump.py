"""``amxopt dump``: the graph before and after every pass, as text, pictures and diffs, for any model.

A target is a zoo name or ``package.module:factory``, where ``factory()`` returns ``(model, inputs)``.
For each pass the dump holds the graph's text before and after, an SVG of one layer after it (the
first block of the model's first stack of blocks, or the whole graph when it is small), and what the
pass changed; ``index.html`` links them with the rewrite report. networkx holds each graph (node
kinds, the layer's subgraph, the diff, the layout by topological generation); the SVG is written
here, so no Graphviz binary is needed.
"""

from __future__ import annotations

import difflib
import html
import importlib
import os
import pathlib
import re
import sys
from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch
import torch.utils._pytree as pytree
from torch import nn

# Node kinds, in the legend's order: fill colour and meaning.
KIND_STYLE = {
    "replaced": ("#7fd18b", "amxopt op"),
    "left": ("#f6b26b", "left as ATen, with a reason"),
    "aten": ("#e6e6e6", "ATen op"),
    "input": ("#a4c2f4", "input or weight"),
    "output": ("#b4a7d6", "output"),
}
_WHOLE_GRAPH_LIMIT = 400  # nodes: above it, only one layer is drawn
_BLOCK = re.compile(r"^(.+)\.0$")


def load_target(spec: str, dtype: torch.dtype, size: Any = None) -> tuple[nn.Module, Any]:
    """``(model, inputs)`` for a zoo name or a ``package.module:factory`` spec: a factory's model
    and floating inputs are cast to ``dtype``; its inputs are its own (``size`` is refused). The
    factory's module is found from the working directory too, as ``python -c`` would."""
    if ":" not in spec:
        from amxopt import models

        return models.build_model(spec, dtype), models.example_inputs(spec, dtype, size=size)
    if size is not None:
        raise ValueError(f"amxopt: --size applies to zoo models; {spec}() builds its own inputs")
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:  # a console script's path starts at its bin/
        sys.path.append(os.getcwd())
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"amxopt: cannot load {spec!r} ({type(e).__name__}: {e})") from None
    result = factory()
    if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module)):
        raise ValueError(f"amxopt: {spec}() must return (model, inputs), got {type(result).__name__}")
    model, inputs = result
    from amxopt.runtime.components import has_towers

    if has_towers(model):
        raise ValueError(
            f"amxopt: {spec}() returned {type(model).__name__}, a whole model that optimize() takes part by part "
            "at its first calls; the CLI captures one model with the inputs given: return a tower (an encoder, "
            "a transformer) and its inputs"
        )
    return model.to(dtype), cast_inputs(inputs, dtype)


def cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    """``inputs`` (a tuple, a dict, a processor's ``BatchFeature``) with floating tensors cast to ``dtype``."""

    def cast(x):
        return x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() else x

    if isinstance(inputs, Mapping) and not isinstance(inputs, dict):  # a BatchFeature: one leaf to pytree
        inputs = dict(inputs)
    return pytree.tree_map(cast, inputs)


def layer(g: nx.DiGraph) -> tuple[nx.DiGraph, str]:
    """The subgraph drawn for ``g``: the whole graph when small, else the first block of the first
    stack (``blocks.0``, ``layers.0``) with the nodes feeding it; and its title."""
    if g.number_of_nodes() <= _WHOLE_GRAPH_LIMIT:
        return g, "whole graph"
    paths = {p for _, mods in g.nodes(data="modules") for p in mods}
    block = next(
        (p for _, mods in g.nodes(data="modules") for p in mods if _BLOCK.match(p) and p[:-1] + "1" in paths), None
    )
    if block is None:
        first = list(nx.topological_sort(g))[:_WHOLE_GRAPH_LIMIT]
        return g.subgraph(first).copy(), f"first {_WHOLE_GRAPH_LIMIT} nodes"
    inside = {n for n, mods in g.nodes(data="modules") if block in mods}
    feeding = {p for n in inside for p in g.predecessors(n)} - inside
    sub = g.subgraph(inside | feeding).copy()
    for n in feeding:  # drawn as inputs of the layer, whatever they are in the whole graph
        sub.nodes[n]["kind"] = "input"
    return sub, block


def diff(before: nx.DiGraph, after: nx.DiGraph) -> tuple[list[str], list[str], list[str]]:
    """Nodes the pass removed, added and changed in place (a view made a reshape), by name, with
    their labels."""
    removed = [f"{n} ({before.nodes[n]['label']})" for n in before if n not in after]
    added = [f"{n} ({after.nodes[n]['label']})" for n in after if n not in before]
    changed = [
        f"{n} ({before.nodes[n]['label']} -> {after.nodes[n]['label']})"
        for n in after
        if n in before and before.nodes[n]["label"] != after.nodes[n]["label"]
    ]
    return removed, added, changed


def svg(g: nx.DiGraph, title: str) -> str:
    """A layered drawing of ``g``: rows by topological generation, nodes coloured by kind, each
    node's detail (op, dtype and shape, why it was left) as its tooltip."""
    row_h, box_h, gap, char_w = 56, 26, 14, 7
    rows = _rows(g)
    pos, width = {}, 0
    for r, names in enumerate(rows):
        x = gap
        for n in names:
            w = max(40, char_w * len(g.nodes[n]["label"][:40]) + 12)
            pos[n] = (x, 50 + r * row_h, w)
            x += w + gap
        width = max(width, x)
    height = 60 + len(rows) * row_h + 30 * len(KIND_STYLE)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width + 220}" height="{height}" font-family="monospace" '
        f'font-size="11">',
        f'<text x="{gap}" y="24" font-size="14">{html.escape(title)}</text>',
    ]
    for a, b in g.edges:
        xa, ya, wa = pos[a]
        xb, yb, wb = pos[b]
        out.append(
            f'<line x1="{xa + wa / 2:.0f}" y1="{ya + box_h}" x2="{xb + wb / 2:.0f}" y2="{yb}" stroke="#888" '
            'stroke-width="1"/>'
        )
    for n, (x, y, w) in pos.items():
        data = g.nodes[n]
        fill = KIND_STYLE[data["kind"]][0]
        out.append(
            f'<g class="{data["kind"]}"><title>{html.escape(data["detail"])}</title>'
            f'<rect x="{x}" y="{y}" width="{w}" height="{box_h}" rx="4" fill="{fill}" stroke="#444"/>'
            f'<text x="{x + 6}" y="{y + 17}">{html.escape(data["label"][:40])}</text></g>'
        )
    for i, (kind, (fill, meaning)) in enumerate(KIND_STYLE.items()):
        y = 60 + len(rows) * row_h + 30 * i
        out.append(f'<rect x="{gap}" y="{y}" width="20" height="16" fill="{fill}" stroke="#444"/>')
        out.append(f'<text x="{gap + 28}" y="{y + 12}">{kind}: {html.escape(meaning)}</text>')
    out.append("</svg>")
    return "\n".join(out)


def _rows(g: nx.DiGraph) -> list[list[str]]:
    """Ops by topological generation; each input (a weight, a placeholder) one row above its first
    consumer rather than all of them in the first row."""
    ops = g.subgraph(n for n, kind in g.nodes(data="kind") if kind != "input")
    row = {n: r for r, gen in enumerate(nx.topological_generations(ops)) for n in gen}
    order = list(nx.topological_sort(g))
    for n in reversed(order):  # an input that feeds another input goes above that one
        if g.nodes[n].get("kind") == "input":
            row[n] = min((row[s] for s in g.successors(n)), default=1) - 1
    top = min(row.values(), default=0)
    row = {n: r - top for n, r in row.items()}
    rows: list[list[str]] = [[] for _ in range(max(row.values(), default=-1) + 1)]
    for n in order:
        rows[row[n]].append(n)
    return rows


def write(graph: Any, out: pathlib.Path, target: str) -> list[pathlib.Path]:
    """Write the dump of ``graph`` (a GraphEntry built with ``keep_text``) into ``out``; returns the files."""
    out.mkdir(parents=True, exist_ok=True)
    files, rows = [], []
    for i, rec in enumerate(graph.records, 1):
        stem = f"{i:02d}_{rec.name}"
        (out / f"{stem}.before.txt").write_text(rec.before)
        (out / f"{stem}.after.txt").write_text(rec.after)
        before, after = rec.graphs
        sub, where = layer(after)
        (out / f"{stem}.svg").write_text(svg(sub, f"{target} after {rec.name}: {where}"))
        removed, added, changed = diff(before, after)
        text_diff = difflib.unified_diff(
            rec.before.splitlines(), rec.after.splitlines(), "before", "after", lineterm="", n=1
        )
        (out / f"{stem}.diff.txt").write_text(
            f"removed {len(removed)} nodes:\n"
            + "".join(f"  - {r}\n" for r in removed)
            + f"added {len(added)} nodes:\n"
            + "".join(f"  + {a}\n" for a in added)
            + f"changed {len(changed)} nodes:\n"
            + "".join(f"  ~ {c}\n" for c in changed)
            + "\n".join(text_diff)
            + "\n"
        )
        files += [out / f"{stem}.{s}" for s in ("before.txt", "after.txt", "svg", "diff.txt")]
        rows.append((rec.name, stem, rec.modified, len(removed), len(added), len(changed)))
    if graph.records:
        sub, where = layer(graph.records[0].graphs[0])
        (out / "00_captured.svg").write_text(svg(sub, f"{target} as captured: {where}"))
        files.append(out / "00_captured.svg")
    (out / "report.txt").write_text(str(graph.report) + "\n")
    (out / "index.html").write_text(_index(target, rows, graph.report))
    return files + [out / "report.txt", out / "index.html"]


def _index(target: str, rows: list[tuple], report: Any) -> str:
    esc = html.escape
    table = "\n".join(
        f"<tr><td>{i}</td><td>{esc(name)}</td><td>{'yes' if modified else 'no'}</td>"
        f"<td>-{removed} +{added} ~{changed}</td>"
        f'<td><a href="{stem}.svg">picture</a> · <a href="{stem}.diff.txt">diff</a> · '
        f'<a href="{stem}.before.txt">before</a> · <a href="{stem}.after.txt">after</a></td></tr>'
        for i, (name, stem, modified, removed, added, changed) in enumerate(rows, 1)
    )
    legend = " ".join(
        f'<span style="background:{fill};padding:2px 6px">{esc(kind)}: {esc(meaning)}</span>'
        for kind, (fill, meaning) in KIND_STYLE.items()
    )
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>amxopt dump: {esc(target)}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:4px 10px;text-align:left}}
pre{{background:#f6f6f6;padding:1em}}</style></head>
<body><h1>amxopt dump: {esc(target)}</h1>
<p><a href="00_captured.svg">the graph as captured</a> · <a href="report.txt">report</a></p>
<p>{legend}</p>
<table><tr><th>#</th><th>pass</th><th>changed</th><th>nodes</th><th>files</th></tr>
{table}
</table>
<h2>Report</h2><pre>{esc(str(report))}</pre>
</body></html>
"""
