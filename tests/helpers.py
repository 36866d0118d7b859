"""Shared test helpers: capture-and-run-one-pass, and check_rewrite for end-to-end cases."""

from __future__ import annotations

import dataclasses

import torch
import torch.utils._pytree as pytree
from torch import fx

import amxopt
from amxopt.capture import prepare, split_inputs
from amxopt.capture.base import export
from amxopt.ops import providers
from amxopt.runtime import max_abs_error  # noqa: F401 - re-exported for the tests

# autotune: tests/passes/test_autotune.py; keep_source: the tests compare against the original model
CONFIG = amxopt.AmxConfig(provider="reference", autotune=False, keep_source=True)


def captured(model, inputs, dynamic: bool = True) -> tuple[fx.GraphModule, dict]:
    """Export ``model`` like optimize() does, without running passes; returns (gm, graph inputs)."""
    adapter, graph_inputs = prepare(model, inputs)
    return export(model, adapter, graph_inputs, dynamic).gm, graph_inputs


def targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def count(gm: fx.GraphModule, target) -> int:
    return targets(gm).count(target)


def providers_of(gm: fx.GraphModule) -> set[str]:
    """The provider argument of every amxopt op in ``gm``."""
    found = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "amxopt":
            names = [a.name for a in node.target._schema.arguments]
            i = names.index("provider")
            found.add(node.args[i] if len(node.args) > i else node.kwargs.get("provider", "auto"))
    return found


def check_rewrite(model, inputs, expected_counts: dict[str, int], config: amxopt.AmxConfig = CONFIG, **optimize_kw):
    """Optimize ``model``, check the replaced-node counts, that nothing was left, and that the outputs
    equal eager's (fp32), or are within bf16 rounding of them.

    Returns the optimized module for further checks.
    """
    opt = amxopt.optimize(model, inputs, dataclasses.replace(config, **optimize_kw))
    counts = opt.report.counts()
    for kind, n in expected_counts.items():
        assert counts[kind] == n, f"{kind}: {counts[kind]} replaced, expected {n}\n{opt.report}"
    assert not opt.report.left, str(opt.report)
    want = providers.resolve(dataclasses.replace(config, **optimize_kw).provider)
    assert providers_of(opt.graph_module) <= {want}, f"ops not on provider {want!r}:\n{opt.report}"
    args, kwargs = split_inputs(inputs)
    with torch.no_grad():
        expected = model(*args, **kwargs)
        actual = opt(*args, **kwargs)
    assert type(actual) is type(expected)
    first = next(model.parameters(), None)
    if first is None:  # a module of functional ops only: its inputs' dtype
        first = next(t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor))
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True):
        if first.dtype == torch.float32:
            torch.testing.assert_close(a, e)
        elif isinstance(a, torch.Tensor) and a.is_floating_point():  # bf16: rounding apart, not a wrong answer
            torch.testing.assert_close(a.float(), e.float(), atol=5e-2, rtol=2e-2)
    return opt
