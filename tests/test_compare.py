"""max_abs_error: the error the CLI, the tools and the tests report."""

from __future__ import annotations

import math

import pytest
import torch

from amxopt.runtime import max_abs_error
from amxopt.runtime.compare import leaf_errors


def test_a_nan_in_any_output_is_an_error_of_nan():
    a = (torch.zeros(3), torch.tensor([1.0, float("nan")]))
    e = (torch.zeros(3), torch.tensor([1.0, 2.0]))
    assert math.isnan(max_abs_error(a, e)) and math.isnan(max_abs_error(e, a))
    assert max_abs_error((torch.zeros(3), torch.tensor([1.0, 2.5])), e) == 0.5


def test_outputs_of_other_shapes_are_refused_not_broadcast():
    with pytest.raises(ValueError, match=r"output 0 has shape \(3, 4\), expected \(1, 4\)"):
        max_abs_error(torch.zeros(3, 4), torch.zeros(1, 4))
    assert max_abs_error(torch.zeros(0, 4), torch.zeros(0, 4)) == 0.0


def test_equal_infinities_differ_by_nothing_and_others_by_inf():
    inf = float("inf")
    e = torch.tensor([inf, -inf, 1.0])
    assert max_abs_error(e.clone(), e) == 0.0
    assert max_abs_error(torch.tensor([-inf, -inf, 1.0]), e) == inf
    assert max_abs_error(torch.tensor([inf, -inf, 2.0]), e) == 1.0


def test_leaves_that_are_not_tensors_are_compared_too():
    assert max_abs_error((torch.zeros(2), 3), (torch.zeros(2), 4)) == 1.0
    with pytest.raises(ValueError, match="output 1 is 'a', expected 'b'"):
        max_abs_error((torch.zeros(2), "a"), (torch.zeros(2), "b"))
    with pytest.raises(ValueError, match=r"output 1 is 2.0, expected a tensor \(\)"):
        max_abs_error((torch.zeros(2), 2.0), (torch.zeros(2), torch.tensor(2.0)))


def test_leaves_of_other_objects_are_not_compared():
    # A KV cache object, an array: equal only by identity, so not compared (as before).
    import numpy as np

    class Cache:
        pass

    assert max_abs_error((torch.ones(2), Cache(), np.zeros(3)), (torch.ones(2), Cache(), np.ones(3))) == 0.0


def test_outputs_of_another_structure_are_refused():
    # An output the optimized model dropped or added was not compared at all.
    t = torch.ones(3)
    with pytest.raises(ValueError, match="outputs differ in structure"):
        max_abs_error((t,), (t, t * 5))


def test_one_element_and_0d_tensors_are_compared():
    assert max_abs_error(torch.tensor([1.0]), torch.tensor([2.0])) == 1.0
    assert max_abs_error(torch.tensor(0.5), torch.tensor(0.75)) == 0.25  # a scalar loss


def test_equal_infinite_numbers_differ_by_nothing():
    inf = float("inf")
    t = torch.ones(3)
    assert max_abs_error((t, inf), (t, inf)) == 0.0
    assert max_abs_error((t, -inf), (t, inf)) == inf


def test_an_output_without_tensors_is_an_error():
    with pytest.raises(ValueError, match="no tensor outputs to compare"):
        max_abs_error((1, 2), (1, 2))


def test_flags_are_compared_as_flags_not_numbers():
    t = torch.ones(3)
    with pytest.raises(ValueError, match="output 1 is True, expected False"):
        max_abs_error((t, True), (t, False))
    assert max_abs_error((t, True), (t, True)) == 0.0


def test_an_outputs_scale_is_its_largest_finite_magnitude():
    # The scale a tolerance is a fraction of: one large value sets it, infinities do not.
    assert leaf_errors(torch.tensor([100.0, 1, 1, 1]), torch.tensor([100.0, 1, 1, 2])) == [(1.0, 100.0)]
    assert leaf_errors(torch.tensor([-torch.inf, 2.0]), torch.tensor([-torch.inf, -3.0])) == [(5.0, 3.0)]
