"""replace_norms: LayerNorm / RMSNorm (and the fp32-upcast LayerNorm) -> ``amxopt.layer_norm`` / ``rms_norm``.

Why: one pass over memory with fp32 accumulation, reading bf16 and writing bf16, instead of an
upcast copy, a norm and a downcast copy. The upcast pattern is diffusers' ``FP32LayerNorm`` (Wan):
the amxopt op accumulates in fp32 whatever its input dtype, so the casts fold away. Refuses (and
reports) norms over more than the last dim, dtypes without a kernel, and outputs whose dtype differs
from the input's. The rules are ``amxopt/patterns/norms.py``.

    before:  x32 = aten.to(x, f32);  y32 = aten.layer_norm(x32, [D], w, b, eps);  y = aten.to(y32, bf16)
    after:   y = amxopt.layer_norm(x, w, b, eps)
             (aten.rms_norm(x, [D], w, eps) -> amxopt.rms_norm(x, w, eps) likewise)
"""

from __future__ import annotations

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import cleanup
from amxopt.passes._rewrite import apply_rules
from amxopt.patterns import norms


def replace_norms(gm: fx.GraphModule, config: AmxConfig) -> PassResult:
    n_replaced = apply_rules(gm, norms.rules(), config)
    if n_replaced:
        cleanup(gm)
    return PassResult(gm, n_replaced > 0)
