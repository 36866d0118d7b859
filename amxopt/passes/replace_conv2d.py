"""replace_conv2d: ``aten.conv2d`` with a constant weight -> ``amxopt.conv2d``.

Why: on CPUs without bf16 arithmetic ATen's bf16 convolution is emulated, about 30x slower than the
same convolution in fp32 (the Qwen3-Omni audio encoder's three 3x3 stride-2 convs took most of its
eager bf16 time on an AMD Zen 3); ``amxopt.conv2d`` computes it at the precision the CPU's tier runs
fast (csrc/ops.cpp) and leaves it to ATen elsewhere, where autotune picks the faster of the two.
A gelu / gelu_tanh / silu that is the conv's only user is fused into it (``AmxConfig.fuse_activation``):
conv.cpp's direct kernel applies it before its one rounding, and it saves a pass over the output
(the Omni encoder's first conv writes 30 x 480 x 64 x 50 values, whose separate gelu took 30 ms of a
680 ms forward on an AMX Xeon, mostly in the page faults of a fresh 92 MB output).
Refuses (and reports) weights computed in the graph, string padding and dtypes without a kernel.
conv.cpp's kernels write channels-last where export saw aten.conv2d's contiguous output, and a
``.contiguous()`` that was a no-op there is not in the graph (the Omni audio encoder's
``permute(0, 3, 1, 2).contiguous().view(...)`` on a clip of at most 8 mel frames, whose time width
after the convs is 1): the views after it become reshapes (``_graph.relayout``).
The rules are ``amxopt/patterns/conv.py``.

    before:  y = aten.gelu(aten.conv2d(x, W, b, stride, padding, dilation, groups))
    after:   y = amxopt.conv2d(x, W, b, stride, padding, dilation, groups, "gelu")
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import cleanup
from amxopt.passes._rewrite import apply_rules
from amxopt.patterns import conv


def replace_conv2d(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = apply_rules(gm, conv.conv2d_rules(), config)
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
