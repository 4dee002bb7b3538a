"""Scan primitives: one engine over associative operators, several execution modes."""

from ssmkit._src.engine import associative_scan
from ssmkit._src.forward_fill import expand_runs, forward_fill
from ssmkit._src.linear_recurrence import linear_recurrence, linear_recurrence_final_state
from ssmkit._src.matrix_state.delta_product import delta_product
from ssmkit._src.matrix_state.delta_rule import delta_rule
from ssmkit._src.matrix_state.generalized_delta_rule import generalized_delta_rule
from ssmkit._src.matrix_state.linear_attention import linear_attention
from ssmkit._src.matrix_state.mamba3 import Mamba3State, mamba3
from ssmkit._src.modes import Inner, Mode
from ssmkit.scan import operators

__all__ = [
    "Inner",
    "Mamba3State",
    "Mode",
    "associative_scan",
    "delta_product",
    "delta_rule",
    "expand_runs",
    "forward_fill",
    "generalized_delta_rule",
    "linear_attention",
    "linear_recurrence",
    "linear_recurrence_final_state",
    "mamba3",
    "operators",
]
