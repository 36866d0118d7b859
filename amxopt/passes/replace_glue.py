"""replace_glue: the elementwise chains between Wan's GEMMs -> ``amxopt.norm_modulate``,
``amxopt.gated_residual``, ``amxopt.rotary_embedding``.

Why: once the GEMMs run on amxopt's kernels, the glue is what is left of a diffusion step: each
chain is 4 to 14 ATen ops, every one a pass over the activations with an fp32 intermediate in
memory; each becomes one pass that reads bf16 and writes bf16. Runs before replace_norms, whose
rules would otherwise take the modulated norm's LayerNorm alone. The rules are
``amxopt/patterns/glue.py``.

    before:  x32 = to(x, f32); n = layer_norm(x32); m = n * (1 + scale) + shift; y = type_as(m, x)
    after:   y = amxopt.norm_modulate(x, None, None, scale, shift, eps, False)
             (x.float() + y * gate).type_as(x) -> amxopt.gated_residual(x, y, gate)
             Wan's apply_rotary_emb -> amxopt.rotary_embedding(x, cos, sin, interleaved=True)
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import cleanup
from amxopt.passes._rewrite import apply_rules
from amxopt.patterns import glue


def replace_glue(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = apply_rules(gm, glue.rules(), config)
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
