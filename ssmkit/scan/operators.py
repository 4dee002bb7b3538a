"""Associative operators for `ssmkit.scan.associative_scan` (earlier element first).

* `affine`: (a1, b1), (a2, b2) -> (a1 a2, a2 b1 + b2); identity (1, 0).
* `add`, `maximum`, `logaddexp`: elementwise over pytrees; identities 0, -inf, -inf.
* `forward_fill`: x, y -> y where y != 0 else x ("right flood"); identity 0.
* `matrix_affine`: (A1, b1), (A2, b2) -> (A2 A1, A2 b1 + b2) for A `(..., n, n)`,
  b `(..., n)`: h_t = A_t h_{t-1} + b_t, also higher-order recurrences in companion form.
* `with_resets(fn)`: the segmented version of `fn` over `(reset, value)` elements.
"""

from ssmkit._src.operators import (
    Operator,
    add,
    affine,
    forward_fill,
    logaddexp,
    matrix_affine,
    maximum,
    with_resets,
)

__all__ = [
    "Operator",
    "add",
    "affine",
    "forward_fill",
    "logaddexp",
    "matrix_affine",
    "maximum",
    "with_resets",
]
