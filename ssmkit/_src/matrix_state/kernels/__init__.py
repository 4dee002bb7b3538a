"""Pallas kernels of the chunked matrix-state recurrences (GPU; interpret mode elsewhere)."""
