"""Tolerances for fp32 comparisons against transformers, calibrated by a float64 run of the reference.

A fixed absolute tolerance passes or fails by which CPU runs the test when the input is
ill-conditioned (large hidden states, a peaked softmax): there transformers' own fp32 forward
already strays from the exact (float64) result by a good part of the tolerance, and ours, summing
in another order, strays by a similar amount in another direction.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

# |ours - ref| <= |ours - exact| + |ref - exact|. One evaluation's error is a random-sign sum of
# roundings: on an ill-conditioned prompt the same input's fp32 error varied 2-3x with the summation
# order (CPU ISA, BLAS path, TP split; measured 2e-5..5.4e-5 for one tiny-llama logit row), so the
# reference's own error, one such sample, bounds the difference only with a factor: 8 = 1 + up to 7x.
REFERENCE_ERROR_FACTOR = 8.0


def float64_copy(hf_model: Any) -> Any:
    """A float64 copy of a (tiny) transformers model: the exact-arithmetic stand-in for error estimates."""
    return copy.deepcopy(hf_model).to(torch.float64)


def fp32_atol(ref32: torch.Tensor, ref64: torch.Tensor, floor: float) -> float:
    """``floor``, or REFERENCE_ERROR_FACTOR times the reference's own fp32 error where that is larger."""
    own_error = float((ref32.double() - ref64.double()).abs().max())
    return max(floor, REFERENCE_ERROR_FACTOR * own_error)


def assert_same_dot_products(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: Any = None) -> None:
    """got == x @ w.T (+ b) up to summation order: within twice Higham's gamma_K of the float64 product.

    Any order of K products (+ bias) errs by at most K * 2^-24 * sum|terms|, so two orders differ by at most
    twice that; BLAS kernels and sglite's own CPU kernels pick the order by shape and CPU ISA.
    """
    want = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
    terms = x.abs().double() @ w.abs().double().t() + (0 if b is None else b.abs().double())
    bound = 2 * (x.shape[-1] + 1) * 2.0**-24 * terms
    assert got.shape == want.shape
    assert bool(((got.double() - want).abs() <= bound).all())
