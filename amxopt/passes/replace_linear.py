"""replace_linear: ``aten.linear`` (+ a following gelu/silu) -> ``amxopt.linear``.

Why: a packed-weight GEMM with the activation in its epilogue saves a pass over the output and
lets the weight be packed once at load time. Refuses (and reports) weights computed in the graph,
dtypes other than fp32/bf16, and x/weight dtype mismatches. The activation is fused only when it
is the linear's single user, so no intermediate is needed by anything else. The rules are
``amxopt/patterns/linear.py``.

    before:  y = aten.linear(x, W, b);  z = aten.gelu(y, approximate="tanh")
    after:   z = amxopt.linear(x, amxopt.pack_linear_weight(W), b, "gelu_tanh", N)
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import cleanup
from amxopt.passes._rewrite import apply_rules
from amxopt.patterns import linear


def replace_linear(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = apply_rules(gm, linear.rules(), config)
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
