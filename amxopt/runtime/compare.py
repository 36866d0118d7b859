"""Comparing model outputs: the one measure of error used by the CLI, the tools and the tests."""

from __future__ import annotations

import math

import torch
import torch.utils._pytree as pytree


def max_abs_error(actual, expected) -> float:
    """Max abs difference over every leaf of two outputs of the same structure, in fp32.

    Args:
        actual: a model output (tensor, tuple, ``ModelOutput``, ...).
        expected: an output of the same structure.

    Returns:
        The largest ``|actual - expected|`` over all tensor and number leaves (an infinity equal to
        its counterpart differs by 0, one that is not by inf); NaN when either output has a NaN.

    Raises:
        ValueError: the structures, the shapes of two leaves, or two plain leaves (a string, a
            tensor where the other has a number) differ. Other objects (a KV cache) are not compared.

    Example::

        err = max_abs_error(opt(**inputs), model(**inputs))
    """
    a_leaves, a_spec = pytree.tree_flatten(actual)
    e_leaves, e_spec = pytree.tree_flatten(expected)
    if a_spec != e_spec:
        raise ValueError(f"amxopt: outputs differ in structure: {a_spec} vs {e_spec}")
    errors, tensors = [], 0
    for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
        if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor):
            tensors += 1
            if a.shape != e.shape:
                raise ValueError(f"amxopt: output {i} has shape {tuple(a.shape)}, expected {tuple(e.shape)}")
            if a.numel():
                errors.append(_leaf_error(a, e))
        elif _number(a) and _number(e):
            errors.append(0.0 if a == e else abs(float(a) - float(e)))
        elif isinstance(a, torch.Tensor) or isinstance(e, torch.Tensor) or (_plain(a) and _plain(e) and a != e):
            raise ValueError(f"amxopt: output {i} is {_short(a)}, expected {_short(e)}")
        # other leaves (a KV cache object, an array) compare by identity at best: not compared
    if not tensors:
        raise ValueError("amxopt: no tensor outputs to compare")
    return math.nan if any(math.isnan(x) for x in errors) else max(errors, default=0.0)


def leaf_errors(actual, expected) -> list[tuple[float, float]]:
    """Per tensor leaf: ``(max abs error, largest finite |expected|)``, for a tolerance per output.

    The outputs are first compared whole by :func:`max_abs_error` (same structure and shapes, plain
    leaves equal; raises ``ValueError`` otherwise). An empty leaf has error 0 and scale 0; a leaf
    whose values are all infinite or NaN has scale 0 (its infinities count only when they differ).
    """
    max_abs_error(actual, expected)
    pairs = zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected))
    return [(_leaf_error(a, e), _finite_max(e)) for a, e in pairs if isinstance(e, torch.Tensor)]


def _leaf_error(a: torch.Tensor, e: torch.Tensor) -> float:
    if not a.numel():
        return 0.0
    a, e = a.float(), e.float()
    return float(torch.where(a == e, 0.0, (a - e).abs()).max())  # NaN where either is


def _finite_max(t: torch.Tensor) -> float:
    t = t.float().abs()
    t = t[torch.isfinite(t)]
    return float(t.max()) if t.numel() else 0.0


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _plain(x) -> bool:
    return x is None or isinstance(x, (bool, int, float, str))


def _short(x) -> str:
    return f"a tensor {tuple(x.shape)}" if isinstance(x, torch.Tensor) else repr(x)[:60]
