"""The rewrite engine: applies a list of :class:`amxopt.patterns.Rule` to a graph.

Each rule's pattern function is traced once (``torch.fx.symbolic_trace``, cached) and matched with
torch.fx's ``SubgraphMatcher``: it compares ops and literals, binds wildcards to nodes or literals,
normalizes arguments against the op schema (so ``layer_norm(x, s, w, b, eps)`` matches a call that
also passes ``cudnn_enable``), and only returns self-contained matches (an inner node such as the
Linear under a fused gelu has no user outside the match). Inductor's pattern matcher would do the
same, but importing it costs ~115 MB of RSS and seconds at load time, against nothing for the fx one.

Rules apply in list order, so a longer pattern (Linear + gelu) listed first wins over a shorter
one (Linear) on the same nodes. For each match the rule ``applies`` to: the guard's refusal is
noted on the root node (the report lists it), autotune may keep ATen (noted likewise), else the
replacement is traced in place of the match's output and the matched nodes are erased. A match
with an in-place write between its first node (or the first of its ``extent``) and its output is
skipped (the replacement would read the written tensor), so a shorter rule may still take its root.
A replacement whose op refuses the match's values (an ``AmxOpError`` while tracing it: a case the
guard did not foresee) leaves the match as it was, with the op's message; so does one whose output
has other sizes (in the example) or another dtype than the match's (a guard's mistake, which would
otherwise be a wrong result). A replacement laid out otherwise
than the match's output is marked for ``cleanup`` to make the views after it reshapes, or refused
where one of those views shares memory with a tensor written in place (``_graph.relayout``). A root that
was refused or kept is settled: no later rule of the list rewrites it (a Linear + silu kept as
ATen for speed is not then rewritten without its silu).
"""

from __future__ import annotations

import functools

import torch
from torch import fx
from torch.fx.passes.utils.matcher_utils import SubgraphMatcher

from amxopt.config import AmxConfig
from amxopt.ops import AmxOpError
from amxopt.passes import _autotune
from amxopt.passes._graph import (
    GLUE_LEFT,
    LEFT_KIND,
    erase_inserted,
    hint,
    insert_traced,
    leave,
    relayout,
    replace_node,
    val,
    written_inside,
)
from amxopt.patterns import AMX_KINDS, KIND_TARGETS, Match, Rule


@functools.cache
def _pattern(fn) -> tuple[fx.Graph, tuple[str, ...]]:
    graph = fx.symbolic_trace(fn).graph
    return graph, tuple(n.target for n in graph.find_nodes(op="placeholder"))


def apply_rules(gm: fx.GraphModule, rules: list[Rule], config: AmxConfig) -> int:
    """Rewrite every match of ``rules`` in ``gm`` (in place); returns how many were replaced."""
    replaced = 0
    renamed: dict[fx.Node, fx.Node] = {}  # a replaced match's output -> its replacement
    settled: set[fx.Node] = set()  # roots refused or kept as ATen
    for rule in rules:
        if rule.when is not None and not getattr(config, rule.when):
            continue
        graph, names = _pattern(rule.pattern)
        for found in SubgraphMatcher(graph).match(gm.graph):
            inner = [gn for pn, gn in found.nodes_map.items() if pn.op == "call_function"]
            if any(n._erased for n in inner):
                continue  # rewritten by an earlier match
            out = found.returning_nodes[0]
            roots = rule.root or KIND_TARGETS[rule.kind]
            root = next(n for n in inner if n.target in roots or AMX_KINDS.get(n.target) == rule.kind)
            if root in settled:
                continue
            # A wildcard may have bound the output of a match this rule already replaced.
            values = dict(zip(names, (_current(v, renamed) for v in found.placeholder_nodes)))
            values.update((name, values[same_as]) for name, same_as in rule.aliases)
            match = Match(values, root, out)
            if not rule.applies(match, config):
                continue
            written = written_inside([*inner, *rule.extent(match)], out)
            if written is not None:  # a shorter rule may still fit (a Linear before the write)
                _leave(root, rule, f"{written.name} writes a tensor in place inside its {rule.name} match")
                continue
            reason = rule.guard(match)
            if reason:
                _leave(root, rule, reason)
                settled.add(root)
                continue
            fn = functools.partial(rule.replacement, **rule.options(match, config))
            timing = rule.timing(match, fn, config) if rule.timing and _autotune.enabled(config) else None
            if kept_for_speed(root, rule, timing):
                settled.add(root)
                continue
            if timing is not None and timing.options:  # what autotune chose for the kernel (an AMX schedule)
                fn = functools.partial(fn, **timing.options)
            anchor = out.prev
            try:
                new = insert_traced(out, fn, [match[name] for name in rule.inputs], rule.name, timing)
            except AmxOpError as e:  # the op's own checks refuse what the guard let through
                _leave(root, rule, f"the replacement refuses it: {e}")
                settled.add(root)
                continue
            reason = _unlike(out, new) or relayout(out, new)
            if reason:
                erase_inserted(anchor, out)
                _leave(root, rule, reason)
                settled.add(root)
                continue
            # Why glue rules left nodes of this match (a modulate refused on its layer_norm, which
            # this rule replaces): kept on the replacement, for the report.
            notes = [note for n in inner for note in n.meta.get(GLUE_LEFT, ()) if note[0] != rule.kind]
            replace_node(out, new, *reversed([n for n in _in_order(inner) if n is not out]))
            if notes:
                new.meta[GLUE_LEFT] = notes
            renamed[out] = new
            replaced += 1
    return replaced


def _unlike(out: fx.Node, new: fx.Node) -> str | None:
    """Why ``new`` cannot stand for ``out``: its output differs in dtype or in the example's sizes (a
    rule that took a match it should not have), which would be a wrong result; None if alike."""
    was, now = val(out), val(new)
    if not isinstance(was, torch.Tensor) or not isinstance(now, torch.Tensor):
        return None
    if was.dtype != now.dtype or list(map(hint, was.shape)) != list(map(hint, now.shape)):
        return (
            f"its replacement computes {now.dtype} {tuple(now.shape)}, not the match's {was.dtype} {tuple(was.shape)}"
        )
    return None


def kept_for_speed(root: fx.Node, rule: Rule, timing) -> bool:
    """Leave ``root`` as ATen (and say why) when autotune found ATen faster; True if it did."""
    if timing is None or timing.amxopt_wins:
        return False
    _leave(root, rule, f"ATen is faster here: {timing}", timing)
    return True


_OWNED = {t for targets in KIND_TARGETS.values() for t in targets} | set(AMX_KINDS)


def _leave(root: fx.Node, rule: Rule, reason: str, timing=None) -> None:
    """Note on ``root`` why ``rule`` left it. A glue chain's root is an add or an empty_like, whose
    note names the kind it was left as; or another kind's op (a modulate's layer_norm), which that
    kind's pass may still replace or leave with its own note: the glue's is kept apart."""
    if KIND_TARGETS[rule.kind]:
        leave(root, reason, timing)
    elif root.target in _OWNED:
        notes = root.meta.setdefault(GLUE_LEFT, [])
        if all(note[:2] != (rule.kind, reason) for note in notes):  # (the pass run again)
            notes.append((rule.kind, reason, timing))
    else:
        leave(root, reason, timing)
        root.meta[LEFT_KIND] = rule.kind


def _current(value, renamed: dict[fx.Node, fx.Node]):
    while isinstance(value, fx.Node) and value in renamed:
        value = renamed[value]
    return value


def _in_order(nodes: list[fx.Node]) -> list[fx.Node]:
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(nodes, key=order.__getitem__)
