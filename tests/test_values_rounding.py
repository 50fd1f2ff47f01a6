"""attnlib.rounding's values on hand-sized cases, exact to the last bit: where the bound of
``assert_rounding_close`` sits (``gap <= bound`` passes, one ulp more fails), what it takes
as the size of an empty or all-zero result, and that it compares in the expected's dtype.
Written to kill what mutation testing (``make mutants``) found unchecked."""

from __future__ import annotations

import pytest
import torch

from attnlib import assert_rounding_close, rounding_tolerance

EPS32, EPS64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps


def test_a_gap_equal_to_the_bound_passes_and_one_ulp_more_fails() -> None:
    one = torch.ones(1, dtype=torch.float64)
    assert assert_rounding_close(one + EPS64, one, 1) == EPS64  # gap == bound: allowed
    with pytest.raises(AssertionError):
        assert_rounding_close(one + 2 * EPS64, one, 1)  # gap 2 eps > bound eps


def test_the_size_of_an_all_zero_result_is_1e_30() -> None:
    zero = torch.zeros(3, dtype=torch.float64)
    assert assert_rounding_close(zero, zero, 2) == 2 * EPS64 * 1e-30
    with pytest.raises(AssertionError):
        assert_rounding_close(zero + 1e-40, zero, 2)  # 1e-40 > 2 eps 1e-30, though tiny


def test_the_size_is_the_largest_expected_entry() -> None:
    expected = torch.tensor([1e-3, -4e-3, 2e-3], dtype=torch.float64)
    assert assert_rounding_close(expected, expected, 5) == 5 * EPS64 * 4e-3


def test_empty_tensors_agree_with_size_one() -> None:
    empty = torch.zeros(0, 4)
    assert assert_rounding_close(empty, empty, 3) == rounding_tolerance(torch.float32, 3) == 3 * EPS32


def test_the_gap_is_taken_in_float64() -> None:
    """A float64 ``actual`` against a float32 ``expected`` is compared in float64, not rounded
    to float32 first: 1.5 ulps above 1.5 (a tie that float32 would round up to 2 ulps) sits
    exactly on the bound eps32 x 1.5 and passes; a hair more fails."""
    ulp = 2.0**-23  # of numbers in [1, 2) in float32
    expected = torch.tensor([1.5], dtype=torch.float32)
    actual = torch.tensor([1.5 + 1.5 * ulp], dtype=torch.float64)
    assert float(actual.float()) == 1.5 + 2 * ulp  # float32 would have rounded the tie up
    assert assert_rounding_close(actual, expected, 1) == 1.5 * EPS32
    with pytest.raises(AssertionError):
        assert_rounding_close(actual + 2.0**-40, expected, 1)
