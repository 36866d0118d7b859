"""The rewrite report: what amxopt replaced in a graph, what it left alone and why.

Derived from the final graph (the passes leave notes in ``node.meta``), so it can never disagree
with what actually runs.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
from torch import fx

from amxopt.passes._graph import GLUE_LEFT, LEFT, LEFT_KIND, REPLACED, SHARDED, TIMED, op_name
from amxopt.patterns import AMX_KINDS, KIND_TARGETS

aten = torch.ops.aten
KINDS = tuple(KIND_TARGETS)
_TARGET_KIND = {t: kind for kind, targets in KIND_TARGETS.items() for t in targets}
# Compute-heavy ATen ops outside amxopt's op set: listed so the report shows what still runs as ATen.
_OTHER_COMPUTE = (
    aten.conv1d.default,
    aten.convolution.default,
    aten.matmul.default,
    aten.mm.default,
    aten.bmm.default,
    aten.addmm.default,
)

# Ops of a replaceable kind that no amxopt op takes: left, with the reason, rather than not counted.
_NO_OP_YET = {
    torch.ops.higher_order.flex_attention: (
        "attention",
        "flex attention (a score_mod or block mask function) has no amxopt op; the SDPA backend is replaced "
        "(diffusers: set_attention_backend('native'); transformers: attn_implementation='sdpa')",
    ),
}


@dataclasses.dataclass(frozen=True)
class Entry:
    kind: str  # one of KINDS
    node: str  # node name in the final graph
    source: str  # the op it was (replaced) or is (left)
    detail: str  # amxopt op and provider, or the reason it was left alone


@dataclasses.dataclass
class Report:
    """What ``amxopt.optimize`` did to one model.

    ``str(report)`` is a readable table; ``counts()`` the replaced nodes by kind; ``left`` every
    node of a replaceable kind that was kept, with the reason.
    """

    model: str
    adapter: str
    provider: str
    dynamic: bool
    passes: list[tuple[str, bool]]
    replaced: list[Entry]
    left: list[Entry]
    other_ops: dict[str, int]
    notes: list[str]
    choices: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (winner, timing) per op shape

    @classmethod
    def from_graph(
        cls,
        gm: fx.GraphModule,
        *,
        model: str,
        adapter: str,
        provider: str,
        dynamic: bool,
        passes: list[tuple[str, bool]],
        notes: list[str],
    ) -> Report:
        replaced, left, notes = [], [], list(notes)
        other: collections.Counter = collections.Counter()
        sharded: collections.Counter = collections.Counter()
        choices: dict = {}  # op -> (winner, Timing)
        for node in gm.graph.nodes:
            glue = node.meta.get(GLUE_LEFT, ())
            timed = [(node.target in AMX_KINDS, node.meta[TIMED])] if TIMED in node.meta else []
            # a modulate autotune kept on ATen: its layer_norm carries that timing beside its own
            for won, timing in [(False, note[2]) for note in glue if note[2] is not None] + timed:
                # The node of a shape that was timed: the others read the decision it cached, and
                # would label a timing made in this very optimize() "[cached]". (Passes time in their
                # own order, not the graph's.)
                known = choices.get(timing.op)
                if known is None or (known[1].cached and not timing.cached):
                    choices[timing.op] = ("amxopt" if won else "ATen", timing)
            if node.op == "get_attr" and LEFT in node.meta:
                notes.append(f"{node.target}: {node.meta[LEFT]}")
            if node.op != "call_function":
                continue
            if SHARDED in node.meta:
                sharded[node.meta[SHARDED]] += 1
            left += [Entry(kind, node.name, op_name(node.target), why) for kind, why, _ in glue]
            if LEFT_KIND in node.meta and LEFT in node.meta and node.target not in AMX_KINDS:
                # a glue chain's root (an add, an empty_like) left as ATen: a chain of that kind left
                left.append(Entry(node.meta[LEFT_KIND], node.name, op_name(node.target), node.meta[LEFT]))
            elif LEFT in node.meta and (node.target in AMX_KINDS or node.target not in _TARGET_KIND):
                notes.append(f"{node.name}: {node.meta[LEFT]}")  # an amxopt node with a note
            if node.target in AMX_KINDS:
                detail = f"{op_name(node.target).removesuffix('.default')} [{node.args[-1]}]"
                replaced.append(Entry(AMX_KINDS[node.target], node.name, node.meta.get(REPLACED, "?"), detail))
                if node.kwargs.get("rotary_cos") is not None:  # fuse_rotary: q's and k's, applied inside
                    inside = f"inside {op_name(node.target).removesuffix('.default')} [{node.args[-1]}]"
                    replaced += [Entry("rotary", node.name, "rotary embedding of " + t, inside) for t in ("q", "k")]
            elif node.target in _TARGET_KIND:
                reason = node.meta.get(LEFT, "no pass matched it")
                left.append(Entry(_TARGET_KIND[node.target], node.name, op_name(node.target), reason))
            elif node.target in _NO_OP_YET:
                kind, reason = _NO_OP_YET[node.target]
                left.append(Entry(kind, node.name, op_name(node.target), node.meta.get(LEFT, reason)))
            elif node.target in _OTHER_COMPUTE:
                other[op_name(node.target)] += 1
        # one all-reduce per unit, and one per norm across the heads a unit shards (Wan's q/k norm)
        reduces = sum(1 for n in gm.graph.nodes if n.target is torch.ops._c10d_functional.all_reduce.default)
        notes += [
            f"tensor parallel ({shard}): {n} attention/MLP units sharded, {reduces} all-reduces"
            for shard, n in sharded.items()
        ]
        return cls(
            model,
            adapter,
            provider,
            dynamic,
            passes,
            replaced,
            left,
            dict(other),
            notes,
            [(w, str(t)) for w, t in choices.values()],
        )

    def counts(self) -> dict[str, int]:
        """Replaced nodes by kind: one key per kind of ``amxopt.patterns.KIND_TARGETS`` (``linear``, ...)."""
        c = collections.Counter(e.kind for e in self.replaced)
        return {k: c[k] for k in KINDS}

    def left_counts(self) -> dict[str, int]:
        c = collections.Counter(e.kind for e in self.left)
        return {k: c[k] for k in KINDS}

    def __str__(self) -> str:
        lines = [
            f"amxopt rewrite report: {self.model} (adapter {self.adapter}, provider {self.provider}, "
            f"{'dynamic' if self.dynamic else 'static'} shapes)",
            "passes: " + ", ".join(f"{n}{'' if m else ' (no change)'}" for n, m in self.passes),
            "",
            f"  {'kind':<12}{'replaced':>9}{'left':>6}   became",
        ]
        by_kind = collections.defaultdict(collections.Counter)
        for e in self.replaced:
            by_kind[e.kind][e.detail] += 1
        left = self.left_counts()
        for kind, n in self.counts().items():
            became = ", ".join(f"{d} x{c}" for d, c in by_kind[kind].items()) or "-"
            lines.append(f"  {kind:<12}{n:>9}{left[kind]:>6}   {became}")
        if self.left:
            width = max(len(e.node) for e in self.left)
            source = max(len(e.source) for e in self.left)
            lines += ["", "left alone (kind | node | target | reason):"]
            lines += [f"  {e.kind:<12} | {e.node:<{width}} | {e.source:<{source}} | {e.detail}" for e in self.left]
        if self.choices:
            lines += ["", "kernel choices (timed at optimize, best of interleaved rounds; the faster one runs):"]
            lines += [f"  {winner:<7} {timing}" for winner, timing in self.choices]
        if self.other_ops:
            other = ", ".join(f"{op} x{n}" for op, n in sorted(self.other_ops.items()))
            lines += ["", f"other compute kept as ATen (outside amxopt's op set): {other}"]
        if self.notes:
            lines += ["", "notes:"] + [f"  {n}" for n in self.notes]
        return "\n".join(lines)
