"""S4D (Gu et al., "On the parameterization and initialization of diagonal state space
models", NeurIPS 2022): one diagonal complex SSM per channel, run as an FFT convolution
with its Vandermonde kernel or as a recurrence."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ssmkit._src import discretization, hippo
from ssmkit._src.layers import common, functional, initializers
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.modes import Mode, parse_mode

Array = jax.Array

CONVOLUTION = "convolution"


def _initial_modes(cfg: Any) -> tuple[np.ndarray, np.ndarray]:
  """The initial A and B `(d_state / 2,)` complex of `cfg.a_init`."""
  if cfg.d_state % 2:
    raise ValueError(f"`d_state` must be a positive even int, got {cfg.d_state!r}.")
  modes = cfg.d_state // 2
  if cfg.a_init == "legs":
    return hippo.s4d_legs(modes)
  if cfg.a_init == "lin":
    return hippo.s4d_lin(modes), np.ones(modes, complex)
  raise ValueError(f"`a_init` must be 'legs' or 'lin', got {cfg.a_init!r}.")


def param_specs(cfg: Any, features: int) -> dict[str, common.ParamSpec]:
  """S4D's parameters for inputs of width `features` H, in `cfg`'s configuration.

  Args:
    cfg: any object with the attributes of `S4D` (d_state, a_init, dt_min, dt_max,
      bidirectional).
    features: the input width H.

  Returns:
    log_dt `(H,)`; log_a_real, a_imag, B_re, B_im `(H, N/2)`; C_re, C_im
    `(directions, H, N/2)`; D `(H,)`.
  """
  common.check_positive_int(cfg.d_state, "d_state")
  a, b = _initial_modes(cfg)
  discretization.by_name(cfg.discretization)  # an unknown name is refused here, on creation
  shape = (features, a.shape[0])
  directions = 2 if cfg.bidirectional else 1
  # Complex C with unit variance: each part N(0, 1/2), as in the paper's code.
  c = common.ParamSpec((directions, *shape), nn.initializers.normal(np.sqrt(0.5)))
  return {
      "log_dt": common.ParamSpec((features,),
                                 discretization.log_step_init(cfg.dt_min, cfg.dt_max)),
      "log_a_real": common.ParamSpec(shape, initializers.constant(np.log(-a.real))),
      "a_imag": common.ParamSpec(shape, initializers.constant(a.imag)),
      "B_re": common.ParamSpec(shape, initializers.constant(b.real)),
      "B_im": common.ParamSpec(shape, initializers.constant(b.imag)),
      "C_re": c,
      "C_im": c,
      "D": common.ParamSpec((features,), nn.initializers.normal(1.0)),
  }


def _system(cfg: Any, params: dict[str, Array]) -> tuple[Array, Array, Array]:
  """(A_bar, B_bar `(H, N/2)` complex, C `(directions, H, N/2)` complex)."""
  a = common.complex_from(-jnp.exp(params["log_a_real"]), params["a_imag"])
  discretize = discretization.by_name(cfg.discretization)
  a_bar, b_bar = discretize(a, common.complex_from(params["B_re"], params["B_im"]),
                            jnp.exp(params["log_dt"].astype(a.real.dtype))[:, None])
  return a_bar, b_bar, common.complex_from(params["C_re"], params["C_im"])


def kernel(cfg: Any, params: dict[str, Array], length: int) -> Array:
  """The convolution kernel `(directions, length, H)`, float32."""
  a_bar, b_bar, c = _system(cfg, params)
  # Vandermonde: A_bar^l = exp(l log A_bar), one (H, N/2) x (N/2, L) product per direction.
  powers = jnp.exp(jnp.log(a_bar)[..., None] * jnp.arange(length)[None, None])
  return 2 * jnp.einsum("khn,hnl->klh", c * b_bar[None], powers).real


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None = None,
             mode: str | Mode = "auto", *, initial_state: Array | None = None,
             return_state: bool = False, axis_name: Hashable | None = None
             ) -> tuple[Array, Array | None]:
  """S4D over a whole sequence: `(y, final_state)` (see `S4D.__call__` for the arguments).

  The final state is None when the convolution runs: by `mode="convolution"`, or by "auto"
  without `reset`, `initial_state`, `return_state` (True: the caller reads the state) and
  `axis_name` (the recurrence crosses devices with one state per slice, where the
  convolution would need every earlier slice's inputs).
  """
  stateful = initial_state is not None or return_state
  if stateful:
    common.check_causal(cfg, "state to start from or return")
  if mode == CONVOLUTION and (reset is not None or stateful or axis_name is not None):
    raise ValueError(
        "`mode='convolution'` cannot take `reset`, `initial_state`, `return_state` or "
        "`axis_name`: use a scan mode."
    )
  mode = CONVOLUTION if mode == CONVOLUTION else parse_mode(mode)
  if mode is Mode.AUTO and reset is None and not stateful and axis_name is None:
    mode = CONVOLUTION
  xf = x.astype(accumulation_dtype(x.dtype))
  last = None
  if mode == CONVOLUTION:
    # An FFT has no length 0.
    y = _convolve(cfg, xf, kernel(cfg, params, x.shape[-2])) if x.shape[-2] else jnp.zeros_like(xf)
  else:
    y, last = _recurrence(cfg, params, xf, reset, mode, initial_state, axis_name)
  y = (y + xf * common.leading_ones(params["D"], xf.ndim)).astype(x.dtype)
  return y, last


def _convolve(cfg: Any, x: Array, k: Array) -> Array:
  length = x.shape[-2]
  n = 2 * length  # zero padding: a linear, not circular, convolution

  def causal(u: Array, kernel: Array) -> Array:
    spectrum = jnp.fft.rfft(kernel, n, axis=-2)
    product = jnp.fft.rfft(u, n, axis=-2) * common.leading_ones(spectrum, u.ndim)
    return jnp.fft.irfft(product, n, axis=-2)[..., :length, :]

  y = causal(x, k[0])
  if cfg.bidirectional:
    # Lag l >= 1 of the future takes kernel entry l - 1.
    backward = jnp.flip(causal(jnp.flip(x, -2), k[1]), -2)
    y = y + common.shift_back(backward, axis=-2)
  return y


def _recurrence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None, mode: Mode,
                initial_state: Array | None, axis_name: Hashable | None
                ) -> tuple[Array, Array]:
  """Outputs without the skip term, and the forward state after the last step."""
  a_bar, b_bar, c = _system(cfg, params)
  inputs = x[..., None] * common.leading_ones(b_bar, x.ndim + 1)
  # The last recurrence to read `inputs` may write its states over them.
  h, last = linear_recurrence(a_bar, inputs, initial_state, reset=reset, axis=-3, mode=mode,
                              return_final_state=True, overwrite_b=not cfg.bidirectional,
                              axis_name=axis_name)
  y = 2 * jnp.einsum("...hn,hn->...h", h, c[0]).real
  if cfg.bidirectional:
    # Step t reads the backward state after step t + 1: none when an episode starts there.
    after = None if reset is None else common.shift_back(reset, -1, axis_name)
    h = linear_recurrence(a_bar, inputs, reset=after, reverse=True, axis=-3, mode=mode,
                          overwrite_b=True, axis_name=axis_name)
    h = common.shift_back(h, -3, axis_name)
    if after is not None:
      h = jnp.where(after[..., None, None], jnp.zeros_like(h), h)
    y = y + 2 * jnp.einsum("...hn,hn->...h", h, c[1]).real
  return y, last


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Array:
  """The zero state `(*batch, H, d_state / 2)` complex64 for inputs `(*batch, H)`."""
  return jnp.zeros((*tuple(input_shape), cfg.d_state // 2), jnp.complex64)


def step(cfg: Any, params: dict[str, Array], state: Array, x_t: Array, reset: Array | None = None
         ) -> tuple[Array, Array]:
  """One step of a causal S4D: `(state, y_t)` (see `S4D.step`)."""
  common.check_causal(cfg, "step mode")
  a_bar, b_bar, c = _system(cfg, params)
  xf = x_t.astype(accumulation_dtype(x_t.dtype))
  state = common.leading_ones(a_bar, state.ndim) * common.clear(state, reset) + (
      xf[..., None] * common.leading_ones(b_bar, state.ndim))
  y = 2 * jnp.einsum("...hn,hn->...h", state, c[0]).real + xf * common.leading_ones(
      params["D"], xf.ndim)
  return state, y.astype(x_t.dtype)


class S4D(functional.LinenLayer):
  """Diagonal SSM per channel: x' = A x + B u, y = 2 Re(C x) + D u, A = -exp(a_re) + i a_im.

  Inputs `(..., T, H)` give outputs `(..., T, H)`. Each of the H channels has `d_state / 2`
  complex modes standing for `d_state` real states (the conjugate halves are implied by
  taking twice the real part). `mode="convolution"` computes the kernel
  K_l = 2 Re(sum_n C_n B_bar_n A_bar_n^l) by a Vandermonde product and convolves by FFT;
  the scan modes run the recurrence through `ssmkit.scan.linear_recurrence`. `"auto"` is
  the convolution without `reset`, `initial_state` and `return_state` (each needs the
  recurrence), and the scan otherwise. The state is `(*batch, H, d_state / 2)` complex64;
  a bidirectional S4D has none (no `initial_state`, `return_state` or `step`).

  Attributes:
    d_state: real state size N per channel (even): N / 2 complex modes.
    a_init: "legs" (S4D-LegS, diagonal of HiPPO-N with its projected B) or "lin" (S4D-Lin,
      A_n = -1/2 + i pi n, B = 1).
    discretization: "zoh" or "bilinear".
    dt_min: smallest initial step size (log-uniform between `dt_min` and `dt_max`).
    dt_max: largest initial step size.
    bidirectional: add an anti-causal SSM (its own C) run backwards over the sequence.
      No step mode then.
    param_dtype: dtype of the parameters.
  """

  d_state: int = 64
  a_init: str = "legs"
  discretization: str = "zoh"
  dt_min: float = 1e-3
  dt_max: float = 1e-1
  bidirectional: bool = False
  param_dtype: jnp.dtype = jnp.float32

  # Trained with the SSM learning rate and no weight decay, as in the S4 papers.
  parameter_groups = common.ParameterGroups(
      recurrence=frozenset({"log_dt", "log_a_real", "a_imag", "B_re", "B_im"}))
  maths = functional.Maths(param_specs, sequence, step, initialize_state,
                           final_state_on_request=True, methods={"kernel": kernel})

  def kernel(self, length: int, features: int) -> Array:
    """The convolution kernel `(directions, length, H)` for inputs of width `features`, float32."""
    return kernel(self, self._params(features), length)
