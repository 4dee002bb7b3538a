"""Independent float64 NumPy references: plain Python loops, no ssmkit code."""

from __future__ import annotations

import numpy as np


def scan_loop(fn, elems, reverse=False):
  """Inclusive scan of a binary `fn` over the leading axis of a tuple of arrays."""
  length = elems[0].shape[0]
  order = range(length - 1, -1, -1) if reverse else range(length)
  outs = [np.empty_like(np.asarray(e)) for e in elems]
  acc = None
  for t in order:
    item = tuple(np.asarray(e)[t] for e in elems)
    acc = item if acc is None else fn(acc, item)
    for out, value in zip(outs, acc, strict=False):
      out[t] = value
  return tuple(outs)


def linear_recurrence(a, b, h0=None, reset=None, reverse=False):
  """h_t = a_t h_{t-1} + b_t over axis 0 in float64/complex128; a, reset broadcast to b."""
  b = np.asarray(b)
  dtype = np.complex128 if np.iscomplexobj(a) or np.iscomplexobj(b) else np.float64
  b = b.astype(dtype)
  a = np.broadcast_to(np.asarray(a).astype(dtype), b.shape)
  reset = np.zeros(b.shape, bool) if reset is None else np.broadcast_to(reset, b.shape)
  h = np.zeros(b.shape[1:], dtype) if h0 is None else np.asarray(h0).astype(dtype)
  out = np.empty_like(b)
  order = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
  for t in order:
    h = np.where(reset[t], b[t], a[t] * h + b[t])
    out[t] = h
  return out
