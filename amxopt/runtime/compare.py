"""Comparing model outputs: the one measure of error used by the CLI, the tools and the tests."""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree


def max_abs_error(actual, expected) -> float:
    """Max abs difference over every tensor of two outputs of the same structure, in fp32.

    Args:
        actual: a model output (tensor, tuple, ``ModelOutput``, ...).
        expected: an output of the same structure.

    Returns:
        The largest ``|actual - expected|`` over all tensor leaves; NaN when any leaf has a NaN
        difference (a NaN in either output, or infinities that differ).

    Raises:
        ValueError: the structures, or the shapes of two leaves, differ.

    Example::

        err = max_abs_error(opt(**inputs), model(**inputs))
    """
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        raise ValueError(f"amxopt: outputs differ in structure: {a_spec} vs {e_spec}")
    pairs = [(a, e) for a, e in zip(a_leaves, e_leaves) if isinstance(a, torch.Tensor)]
    if not pairs:
        raise ValueError("amxopt: no tensor outputs to compare")
    errors = []
    for i, (a, e) in enumerate(pairs):
        if a.shape != e.shape:
            raise ValueError(f"amxopt: output {i} has shape {tuple(a.shape)}, expected {tuple(e.shape)}")
        if a.numel():
            errors.append(float((a.float() - e.float()).abs().max()))  # NaN when any difference is
    return math.nan if any(math.isnan(x) for x in errors) else max(errors, default=0.0)
