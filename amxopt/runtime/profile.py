"""Where an optimized graph spends its time: every node timed as it runs, summed per op.

The graph runs through an ``fx.Interpreter`` that times each node (a wall clock around the node's
call, the graph's own inputs); the plain graph call is timed too, so the reader sees what the
interpreter adds. Rows are per op (``amxopt.linear``, ``aten.mul.Tensor``, ...) and, with
``by_shape``, per op and input shapes. For the ops that do arithmetic worth counting (amxopt's
GEMMs, attention and convolutions, and the ATen ones they replace) a row also has its GFLOP and
TFLOP/s, so a GEMM's speed can be read against the CPU's limit.

A profile is the node-timed run of median total among ``repeats`` runs after one warm-up of each kind
(per-op medians of a noisy machine's runs add up to more than any run took). It says what a node costs inside
the model: small ops after a large GEMM read their inputs from memory and cost 2-3x what they cost
alone, which a per-op benchmark does not show.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import time
from typing import Any, Callable

import torch
import torch.utils._pytree as pytree
from torch import fx

from amxopt.passes._graph import op_name

aten = torch.ops.aten
amxopt_ops = torch.ops.amxopt


def _numel(shape) -> int:
    return math.prod(int(s) for s in shape)


def _linear_flops(args: tuple, kwargs: dict, out: Any) -> float:
    # x (..., K) -> (..., N): 2 K per output element, whatever the weight's packed layout.
    return 2.0 * out.numel() * args[0].shape[-1]


def _attention_flops(args: tuple, kwargs: dict, out: Any) -> float:
    # q (T, Hq, Dq), out (T, Hq, Dv); per segment of n queries and m keys, Q K^T and P V: 2 Dq and
    # 2 Dv per (query, visible key) pair and head (causal, bottom-right: query i of n sees
    # clamp(m - n + i + 1, 0, m) keys).
    q, cu_q, cu_k = args[0], args[3].tolist(), args[4].tolist()
    causal = bool(args[8]) if len(args) > 8 else bool(kwargs.get("causal", False))
    pairs = 0
    for q0, q1, k0, k1 in zip(cu_q, cu_q[1:], cu_k, cu_k[1:]):
        n, m = q1 - q0, k1 - k0
        pairs += sum(min(max(m - n + i + 1, 0), m) for i in range(n)) if causal else n * m
    return 2.0 * pairs * q.shape[1] * (q.shape[2] + out.shape[2])


def _patch_embed_flops(args: tuple, kwargs: dict, out: Any) -> float:
    # x (B, C, ...) -> (B, out_channels, ...): C * prod(kernel_size) per output element.
    return 2.0 * out.numel() * args[0].shape[1] * _numel(args[3])


def _conv_flops(args: tuple, kwargs: dict, out: Any) -> float:
    weight = args[1]  # (Cout, Cin / groups, *kernel): 2 Cin/groups * prod(kernel) per output element
    return 2.0 * out.numel() * _numel(weight.shape[1:])


def _convolution_flops(args: tuple, kwargs: dict, out: Any) -> float:
    transposed = args[6] if len(args) > 6 else kwargs.get("transposed", False)
    return 0.0 if transposed else _conv_flops(args, kwargs, out)  # a transposed one is not counted


def _mm_flops(args: tuple, kwargs: dict, out: Any) -> float:
    b = args[-1]  # mm / bmm / matmul's second operand, addmm's last
    return 2.0 * out.numel() * (b.shape[-2] if b.dim() > 1 else b.shape[0])


def _sdpa_flops(args: tuple, kwargs: dict, out: Any) -> float:
    q, k = args[0], args[1]  # (..., L, E), (..., S, E); v's last dim is out's
    causal = bool(args[5]) if len(args) > 5 else bool(kwargs.get("is_causal", False))
    length, keys = q.shape[-2], k.shape[-2]
    pairs = sum(min(i + 1, keys) for i in range(length)) if causal else length * keys  # top-left aligned
    return 2.0 * _numel(q.shape[:-2]) * pairs * (q.shape[-1] + out.shape[-1])


# op -> FLOPs of one call from its (run-time) args and output.
_FLOPS: dict[Any, Callable[[tuple, dict, Any], float]] = {
    amxopt_ops.linear.default: _linear_flops,
    amxopt_ops.varlen_attention.default: _attention_flops,
    amxopt_ops.patch_embed.default: _patch_embed_flops,
    amxopt_ops.conv2d.default: _conv_flops,
    aten.linear.default: _linear_flops,
    aten.convolution.default: _convolution_flops,
    aten.conv1d.default: _conv_flops,
    aten.conv2d.default: _conv_flops,
    aten.conv3d.default: _conv_flops,
    aten.mm.default: _mm_flops,
    aten.addmm.default: _mm_flops,
    aten.bmm.default: _mm_flops,
    aten.matmul.default: _mm_flops,
    aten.scaled_dot_product_attention.default: _sdpa_flops,
}


def _shape(t: torch.Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


def _shapes(node: fx.Node, env: dict[fx.Node, Any], out: Any) -> str:
    # The activations' shapes (not the weights': a packed weight is one flat buffer) -> the output's.
    inputs = [env[a] for a in node.all_input_nodes if a.op != "get_attr"]
    text = ", ".join(_shape(t) for t in inputs if isinstance(t, torch.Tensor))
    return f"{text} -> {_shape(out)}" if isinstance(out, torch.Tensor) else text


@dataclasses.dataclass(frozen=True)
class Row:
    op: str
    shapes: str  # input shapes ("" unless the profile is by shape)
    calls: int
    seconds: float  # all calls, in the node-timed run of median total
    flops: float  # all calls; 0 where not counted

    @property
    def tflops(self) -> float | None:
        return self.flops / self.seconds / 1e12 if self.flops and self.seconds > 0 else None


@dataclasses.dataclass
class Profile:
    """Per-op time of one graph call; ``str(profile)`` is a table, largest first."""

    rows: list[Row]
    graph_seconds: float  # the graph's own call, median
    timed_seconds: float  # the interpreter's run (nodes + what it adds): the run of median total
    parts: int = 1  # graph calls summed: a call the model runs in parts (merged)

    @property
    def node_seconds(self) -> float:
        return sum(r.seconds for r in self.rows)

    @classmethod
    def merged(cls, profiles: list[Profile]) -> Profile:
        """The profiles of a call's parts as one: rows of the same op (and shapes) summed, and the
        times of the parts' graph calls and timed runs."""
        if len(profiles) == 1:
            return profiles[0]
        rows: dict[tuple[str, str], Row] = {}
        for row in (r for p in profiles for r in p.rows):
            had = rows.get((row.op, row.shapes))
            rows[row.op, row.shapes] = (
                row
                if had is None
                else dataclasses.replace(
                    row, calls=had.calls + row.calls, seconds=had.seconds + row.seconds, flops=had.flops + row.flops
                )
            )
        return cls(
            sorted(rows.values(), key=lambda r: -r.seconds),
            sum(p.graph_seconds for p in profiles),
            sum(p.timed_seconds for p in profiles),
            sum(p.parts for p in profiles),
        )

    def __str__(self) -> str:
        total = self.node_seconds
        parts = f"a call in {self.parts} parts, summed: " if self.parts > 1 else ""
        lines = [
            f"{parts}graph call {self.graph_seconds * 1e3:.1f} ms; timed run {self.timed_seconds * 1e3:.1f} ms, "
            f"of it in nodes {total * 1e3:.1f} ms",
            f"{'ms':>9} {'share':>6} {'calls':>6} {'GFLOP':>8} {'TFLOP/s':>8}  op",
        ]
        for r in self.rows:
            gflop = f"{r.flops / 1e9:8.1f}" if r.flops else f"{'':>8}"
            tflops = f"{r.tflops:8.3f}" if r.tflops else f"{'':>8}"
            where = f"{r.op}  [{r.shapes}]" if r.shapes else r.op
            share = r.seconds / total if total > 0 else 0.0
            lines.append(f"{r.seconds * 1e3:9.2f} {share:6.1%} {r.calls:6d} {gflop} {tflops}  {where}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        return dict(
            graph_seconds=self.graph_seconds,
            timed_seconds=self.timed_seconds,
            parts=self.parts,
            rows=[dataclasses.asdict(r) | dict(tflops=r.tflops) for r in self.rows],
        )


class _NodeTimer(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, by_shape: bool):
        super().__init__(gm)
        self.by_shape = by_shape
        self.seconds: dict[tuple[str, str], float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        self.flops: dict[tuple[str, str], float] = collections.defaultdict(float)

    def run_node(self, n: fx.Node) -> Any:
        if n.op not in ("call_function", "call_method", "call_module"):
            return super().run_node(n)
        start = time.perf_counter()
        out = super().run_node(n)
        took = time.perf_counter() - start
        with self._set_current_node(n):
            args, kwargs = self.fetch_args_kwargs_from_env(n)
        target = n.target if n.op != "call_module" else type(self.module.get_submodule(n.target)).__name__
        key = (op_name(target), _shapes(n, self.env, out) if self.by_shape else "")
        self.seconds[key] += took
        self.calls[key] += 1
        count = _FLOPS.get(n.target)
        if count is not None and isinstance(out, torch.Tensor):
            self.flops[key] += count(args, kwargs, out)
        return out


def profile_graph(
    gm: fx.GraphModule, graph_inputs: dict[str, Any], repeats: int = 3, by_shape: bool = False
) -> Profile:
    """Time every node of ``gm`` called on ``graph_inputs`` (its placeholders by name).

    Args:
        gm: a graph of ``OptimizedModule.graphs`` (or any GraphModule).
        graph_inputs: the graph's inputs, keyed by placeholder name.
        repeats: timed runs of each kind (graph call, node-timed run); the rows are those of the
            node-timed run of median total.
        by_shape: one row per op and input shapes instead of per op.

    Returns:
        A :class:`Profile`.
    """
    if repeats < 1:
        raise ValueError(f"amxopt profile: repeats must be >= 1, got {repeats}")
    placeholders = [n.target for n in gm.graph.nodes if n.op == "placeholder"]
    if all(p in graph_inputs for p in placeholders):
        inputs = [graph_inputs[p] for p in placeholders]
    else:  # a list or dict argument: one placeholder per leaf, in the order the graph flattens them
        inputs = pytree.tree_leaves(graph_inputs)
        if len(inputs) != len(placeholders):
            raise ValueError(f"amxopt profile: {len(inputs)} inputs for the graph's placeholders {placeholders}")
    graph_times, timed_times, runs = [], [], []
    with torch.no_grad():
        gm(**graph_inputs)  # warm-up: first-call allocations, thread pools
        _NodeTimer(gm, by_shape).run(*inputs, enable_io_processing=False)  # and the interpreter's first run (~40 ms)
        for _ in range(repeats):
            start = time.perf_counter()
            gm(**graph_inputs)
            graph_times.append(time.perf_counter() - start)
            timer = _NodeTimer(gm, by_shape)
            start = time.perf_counter()
            timer.run(*inputs, enable_io_processing=False)
            timed_times.append(time.perf_counter() - start)
            runs.append(timer)
    # The rows of one run, the one of median total (the lower middle of an even count): per-op
    # medians of several runs sum to more than any run took when the machine is noisy.
    middle = sorted(range(repeats), key=timed_times.__getitem__)[(repeats - 1) // 2]
    run = runs[middle]
    rows = [
        Row(op, shapes, run.calls[key], run.seconds[key], run.flops[key]) for key in run.seconds for op, shapes in [key]
    ]
    rows.sort(key=lambda r: -r.seconds)
    return Profile(rows, statistics.median(graph_times), timed_times[middle])
