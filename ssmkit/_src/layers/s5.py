"""S5 (Smith et al., "Simplified state space layers for sequence modeling", ICLR 2023): one
multi-input multi-output diagonal SSM over all channels, initialised from the
diagonalised HiPPO-N matrix."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from ssmkit._src import discretization, hippo
from ssmkit._src.layers import common
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence

Array = jax.Array


def _in_eigenbasis(draw, project: np.ndarray, left: bool) -> nn.initializers.Initializer:
  """A real matrix from `draw(key)` moved into the eigenbasis: `project @ m` or `m @ project`.

  The result is stored as its real and imaginary parts stacked on a leading axis of 2.
  """
  project = jnp.asarray(project, jnp.complex64)

  def init(key: Array, shape, dtype=jnp.float32) -> Array:
    del shape
    m = draw(key).astype(jnp.complex64)
    x = project @ m if left else m @ project
    return jnp.stack([x.real, x.imag]).astype(dtype)

  return init


class S5(nn.Module):
  """MIMO diagonal SSM: x_t = Lambda_bar x_{t-1} + B_bar u_t, y_t = Re(C x_t) + D u_t.

  Inputs `(..., T, H)` give outputs `(..., T, H)` through one state of `d_state` complex
  dimensions shared by all channels. Lambda starts at the eigenvalues of HiPPO-N (in
  `blocks` diagonal blocks), B and C are drawn in the original basis and moved into the
  eigenbasis (V^-1 B, C V). With `conj_sym` only half the modes are kept and the output
  takes twice the real part, as in the paper's code.

  Attributes:
    d_state: state size P (with `conj_sym`, P / 2 complex modes are stored).
    blocks: number J of HiPPO-N blocks on the diagonal of the initial state matrix.
    conj_sym: keep one of each conjugate pair of modes.
    discretization: "zoh" or "bilinear".
    dt_min: smallest initial step size (log-uniform per mode between `dt_min`, `dt_max`).
    dt_max: largest initial step size.
    bidirectional: add a backward recurrence with its own C (both include step t).
      No step mode then.
    param_dtype: dtype of the parameters.
  """

  d_state: int = 64
  blocks: int = 1
  conj_sym: bool = True
  discretization: str = "zoh"
  dt_min: float = 1e-3
  dt_max: float = 1e-1
  bidirectional: bool = False
  param_dtype: jnp.dtype = jnp.float32

  # Trained with the SSM learning rate and no weight decay, as in the S5 paper.
  parameter_groups = common.ParameterGroups(
      recurrence=frozenset({"Lambda_re", "Lambda_im", "B", "log_dt"}))

  def __post_init__(self) -> None:
    common.check_positive_int(self.d_state, "d_state")
    super().__post_init__()

  def _eigenbasis(self) -> tuple[np.ndarray, np.ndarray]:
    """Initial Lambda `(modes,)` and V `(P, modes)`, complex128."""
    p, j = self.d_state, self.blocks
    if not isinstance(j, int) or j < 1 or p < 1 or p % j or (self.conj_sym and (p // j) % 2):
      raise ValueError(
          f"`d_state`={p} must split into `blocks`={j} equal blocks (of even size with "
          "`conj_sym`)."
      )
    size = p // j
    lam, v, _ = hippo.legs_normal_diagonalized(size)
    if self.conj_sym:
      lam, v = lam[: size // 2], v[:, : size // 2]
    return np.tile(lam, j), scipy.linalg.block_diag(*[v] * j)

  @nn.compact
  def _parameters(self, features: int) -> tuple[Array, Array, Array, Array]:
    """(Lambda_bar `(M,)`, B_bar `(M, H)`, C `(directions, H, M)` complex, D `(H,)`)."""
    lam, v = self._eigenbasis()
    modes, dtype = lam.shape[0], self.param_dtype
    v_inverse = np.linalg.pinv(v)
    lam_re = self.param("Lambda_re", common.constant(lam.real), (modes,), dtype)
    lam_im = self.param("Lambda_im", common.constant(lam.imag), (modes,), dtype)
    lecun = nn.initializers.lecun_normal()
    draw_b = lambda key: lecun(key, (self.d_state, features))
    b = self.param("B", _in_eigenbasis(draw_b, v_inverse, left=True), (2, modes, features), dtype)
    directions = 2 if self.bidirectional else 1

    def draw_c(key: Array) -> Array:
      """C `(directions, H, P)` with real and imaginary parts each LeCun-normal."""
      re, im = jax.random.split(key)
      shape = (directions, features, self.d_state)
      return jax.lax.complex(lecun(re, shape), lecun(im, shape))

    c = self.param("C", _in_eigenbasis(draw_c, v, left=False), (2, directions, features, modes),
                   dtype)
    d = self.param("D", nn.initializers.normal(1.0), (features,), dtype)
    log_dt = self.param(
        "log_dt", discretization.log_step_init(self.dt_min, self.dt_max), (modes,), dtype
    )
    discretize = discretization.by_name(self.discretization)
    lam_bar, b_bar = discretize(
        jax.lax.complex(lam_re, lam_im), jax.lax.complex(b[0], b[1]), jnp.exp(log_dt)
    )
    return lam_bar, b_bar, jax.lax.complex(c[0], c[1]), d

  def _read(self, h: Array, c: Array) -> Array:
    y = jnp.einsum("...m,hm->...h", h, c)
    return 2 * y.real if self.conj_sym else y.real

  def __call__(self, x: Array, reset: Array | None = None, mode: str = "auto", *,
               initial_state: Array | None = None, return_state: bool = False
               ) -> Array | tuple[Array, Array]:
    """Runs the whole sequence.

    Args:
      x: `(..., T, H)` inputs.
      reset: optional `(..., T)` booleans; True clears the state before that step (in
        both directions when bidirectional).
      mode: scan mode of the recurrence ("auto", "sequential", "parallel", "chunked").
      initial_state: optional `(..., modes)` complex state to start from, as `step` makes it;
        default zeros (causal S5 only).
      return_state: also return the state after the last step (causal S5 only).

    Returns:
      `(..., T, H)` outputs in `x`'s dtype; with `return_state`, `(outputs, state)`.
    """
    x, reset = common.check_sequence(x, reset)
    if self.bidirectional and (initial_state is not None or return_state):
      raise ValueError("a bidirectional S5 has no state to start from or return: it reads the future.")
    common.check_initial_state(initial_state, self.initialize_state(x.shape[:-2] + x.shape[-1:]))
    lam_bar, b_bar, c, d = self._parameters(x.shape[-1])
    xf = x.astype(accumulation_dtype(x.dtype))
    inputs = xf.astype(b_bar.dtype) @ b_bar.T
    # The last recurrence to read `inputs` may write its states over them.
    h, last = linear_recurrence(lam_bar, inputs, initial_state, reset=reset, axis=-2, mode=mode,
                                return_final_state=True, overwrite_b=not self.bidirectional)
    y = self._read(h, c[0])
    if self.bidirectional:
      # Backwards, step t starts afresh when a new episode starts at t + 1.
      after = None if reset is None else common.shift_back(reset, axis=-1)
      h = linear_recurrence(lam_bar, inputs, reset=after, reverse=True, axis=-2, mode=mode,
                            overwrite_b=True)
      y = y + self._read(h, c[1])
    y = (y + xf * common.leading_ones(d, xf.ndim)).astype(x.dtype)
    return (y, last) if return_state else y

  def initialize_state(self, input_shape: tuple[int, ...]) -> Array:
    """The zero state `(*batch, modes)` complex64 for inputs `(*batch, H)`."""
    modes = self.d_state // 2 if self.conj_sym else self.d_state
    return jnp.zeros((*tuple(input_shape)[:-1], modes), jnp.complex64)

  def step(self, state: Array, x_t: Array, reset: Array | None = None) -> tuple[Array, Array]:
    """Advances one step (causal S5 only).

    Args:
      state: `(*batch, modes)` complex state.
      x_t: `(*batch, H)` input of this step.
      reset: optional `(*batch,)` booleans; True clears the state before this step.

    Returns:
      `(state, y_t)`: the new state and the `(*batch, H)` output.
    """
    if self.bidirectional:
      raise ValueError("a bidirectional S5 has no step mode: its output needs the future.")
    x_t, reset = common.check_step(x_t, reset)
    lam_bar, b_bar, c, d = self._parameters(x_t.shape[-1])
    state = common.clear(state, reset)
    xf = x_t.astype(accumulation_dtype(x_t.dtype))
    state = common.leading_ones(lam_bar, state.ndim) * state + xf.astype(b_bar.dtype) @ b_bar.T
    y = self._read(state, c[0]) + xf * common.leading_ones(d, xf.ndim)
    return state, y.astype(x_t.dtype)
