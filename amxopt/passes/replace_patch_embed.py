"""replace_patch_embed: Conv3d / Conv2d whose kernel equals its stride -> ``amxopt.patch_embed`` (one GEMM).

Why: such a convolution is a patchify followed by a matrix multiply; as a GEMM it runs ~75x
faster than ATen's Conv3d on these shapes (90 ms vs 1.2 ms for Qwen3-VL's 784 patches). Conv2d
patch embeddings (CLIP, SigLIP) become the same op over a time axis of one. Refuses (and reports)
any other convolution (padding, dilation, groups, overlapping windows, e.g. the Wan VAE's causal
convs; a Conv2d refused here is left to replace_conv2d), weights computed in the graph, and inputs
not provably divisible by the kernel (the convolution would silently drop the remainder). The op
writes channels-last (Wan's ``flatten(2).transpose(1, 2)`` after it is then free), where export saw
the conv's contiguous output: a ``view`` after it (a 1x1 conv's ``y.view(B, -1)``) becomes a reshape
(``_graph.relayout``).

    before:  y = aten.conv3d(x, W[O, C, kt, kh, kw], b, stride=[kt, kh, kw])
    after:   y = amxopt.patch_embed(x, amxopt.pack_linear_weight(W.reshape(O, -1)), b, [kt, kh, kw], O)
    before:  y = aten.conv2d(x, W[O, C, kh, kw], b, stride=[kh, kw])
    after:   y = amxopt.patch_embed(x[:, :, None], pack(W.reshape(O, -1)), b, [1, kh, kw], O)[:, :, 0]

The rules are ``amxopt/patterns/conv.py``.
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import cleanup
from amxopt.passes._rewrite import apply_rules
from amxopt.patterns import conv


def replace_patch_embed(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = apply_rules(gm, conv.patch_embed_rules(), config)
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
