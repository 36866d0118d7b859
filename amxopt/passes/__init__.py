"""The rewrite passes. Order is data: ``DEFAULT_PASSES`` runs first to last.

Inference-mode dropout goes first (it hides the ops behind it from the rules), then attention and
patch embedding (they change layouts around their nodes), the glue before norms (a modulated norm
is matched whole before its norm alone), the rotary embeddings into the attentions once both are
amxopt ops, norms before Linear (a norm feeding a Linear is matched on
its own), tensor-parallel sharding once every Linear and attention is an amxopt op (a no-op without
``AmxConfig.tp``), and weight packing last, once every amxopt op that reads a constant weight exists
and each rank packs only its shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from torch import fx
from torch.fx.passes.infra.pass_base import PassResult

from amxopt.config import AmxConfig
from amxopt.passes._graph import DEFER_RECOMPILE
from amxopt.passes._snapshot import snapshot
from amxopt.passes.fuse_rotary import fuse_rotary
from amxopt.passes.pack_weights import pack_weights
from amxopt.passes.remove_dropout import remove_dropout
from amxopt.passes.replace_attention import replace_attention
from amxopt.passes.replace_conv2d import replace_conv2d
from amxopt.passes.replace_glue import replace_glue
from amxopt.passes.replace_linear import replace_linear
from amxopt.passes.replace_norms import replace_norms
from amxopt.passes.replace_patch_embed import replace_patch_embed
from amxopt.passes.shard_tensor_parallel import shard_tensor_parallel

Pass = Callable[[fx.GraphModule, AmxConfig], PassResult]

DEFAULT_PASSES: tuple[Pass, ...] = (
    remove_dropout,
    replace_attention,
    replace_patch_embed,
    replace_conv2d,
    replace_glue,
    fuse_rotary,
    replace_norms,
    replace_linear,
    shard_tensor_parallel,
    pack_weights,
)
PASSES: dict[str, Pass] = {p.__name__: p for p in DEFAULT_PASSES}


@dataclasses.dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, whether it changed the graph, graph text before and after, and
    (``keep_text``) the graphs before and after as networkx (``amxopt/passes/_snapshot.py``)."""

    name: str
    modified: bool
    before: str
    after: str
    graphs: tuple = ()


def selected_passes(config: AmxConfig) -> tuple[Pass, ...]:
    if config.passes is None:
        return DEFAULT_PASSES
    unknown = [n for n in config.passes if n not in PASSES]
    if unknown:
        raise ValueError(f"amxopt: unknown passes {unknown}; known: {list(PASSES)}")
    return tuple(PASSES[n] for n in config.passes)


def run_passes(gm: fx.GraphModule, config: AmxConfig, keep_text: bool = False) -> list[PassRecord]:
    """Run the configured passes in order on ``gm`` (in place); return what each did."""
    records = []
    setattr(gm, DEFER_RECOMPILE, True)  # one code generation for the whole list, not one per pass
    try:
        for p in selected_passes(config):
            before = gm.print_readable(print_output=False) if keep_text else ""
            graph_before = snapshot(gm) if keep_text else None
            result = p(gm, config)
            after = result.graph_module.print_readable(print_output=False) if keep_text else ""
            graphs = (graph_before, snapshot(gm)) if keep_text else ()
            records.append(PassRecord(p.__name__, result.modified, before, after, graphs))
    finally:
        delattr(gm, DEFER_RECOMPILE)
        gm.recompile()
    return records


__all__ = ["DEFAULT_PASSES", "PASSES", "PassRecord", "run_passes", "selected_passes"] + list(PASSES)
