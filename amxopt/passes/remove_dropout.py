"""remove_dropout: inference-mode dropout -> its input.

Why: an eval model's ``nn.Dropout`` is captured as ``aten.dropout(x, p, train=False)``, which returns
x unchanged but still costs a call per node and hides the op behind it from the rules: Wan's
attention output is ``x + dropout(linear(h))``, so its residual add could not be fused into the
Linear's epilogue, nor the gated residual see its Linear (90 dropouts and 30 separate adds in a
Wan2.1-1.3B step). Removes ``dropout`` / ``feature_dropout`` / ``alpha_dropout`` /
``feature_alpha_dropout`` where ``train`` is False or ``p`` is 0; a dropout that drops (a model
captured in training mode) is left as it is.

    before:  y = aten.add(x, aten.dropout(aten.linear(h, W, b), 0.1, False))
    after:   y = aten.add(x, aten.linear(h, W, b))        # replace_linear then fuses the add
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import arg, cleanup

aten = torch.ops.aten
_DROPOUTS = (
    aten.dropout.default,
    aten.feature_dropout.default,
    aten.alpha_dropout.default,
    aten.feature_alpha_dropout.default,
)


def _is_identity_dropout(node: fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target in _DROPOUTS
        and (not arg(node, 2, "train") or arg(node, 1, "p") == 0)
    )


def remove_dropout(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_removed = 0
    for node in list(gm.graph.nodes):
        if _is_identity_dropout(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            n_removed += 1
    if n_removed:
        cleanup(gm)
    return PassResult(gm, n_removed > 0)
