"""S5 (Smith et al., "Simplified state space layers for sequence modeling", ICLR 2023): one
multi-input multi-output diagonal SSM over all channels, initialised from the
diagonalised HiPPO-N matrix."""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import scipy.linalg

from ssmkit._src import discretization, hippo
from ssmkit._src.layers import common, functional, initializers
from ssmkit._src.linear_recurrence import accumulation_dtype, linear_recurrence
from ssmkit._src.modes import Mode

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


def _eigenbasis(cfg: Any) -> tuple[np.ndarray, np.ndarray]:
  """Initial Lambda `(modes,)` and V `(P, modes)`, complex128."""
  p, j = cfg.d_state, cfg.blocks
  if not isinstance(j, int) or j < 1 or p < 1 or p % j or (cfg.conj_sym and (p // j) % 2):
    raise ValueError(
        f"`d_state`={p} must split into `blocks`={j} equal blocks (of even size with "
        "`conj_sym`)."
    )
  size = p // j
  lam, v, _ = hippo.legs_normal_diagonalized(size)
  if cfg.conj_sym:
    lam, v = lam[: size // 2], v[:, : size // 2]
  return np.tile(lam, j), scipy.linalg.block_diag(*[v] * j)


def param_specs(cfg: Any, features: int) -> dict[str, common.ParamSpec]:
  """S5's parameters for inputs of width `features` H, in `cfg`'s configuration.

  Args:
    cfg: any object with the attributes of `S5` (d_state, blocks, conj_sym, dt_min, dt_max,
      bidirectional).
    features: the input width H.

  Returns:
    Lambda_re, Lambda_im `(M,)` for M modes; B `(2, M, H)` and C `(2, directions, H, M)`
    (real and imaginary parts stacked); D `(H,)`; log_dt `(M,)`.
  """
  common.check_positive_int(cfg.d_state, "d_state")
  lam, v = _eigenbasis(cfg)
  discretization.by_name(cfg.discretization)  # an unknown name is refused here, on creation
  modes = lam.shape[0]
  lecun = nn.initializers.lecun_normal()
  draw_b = lambda key: lecun(key, (cfg.d_state, features))
  directions = 2 if cfg.bidirectional else 1

  def draw_c(key: Array) -> Array:
    """C `(directions, H, P)` with real and imaginary parts each LeCun-normal."""
    re, im = jax.random.split(key)
    shape = (directions, features, cfg.d_state)
    return jax.lax.complex(lecun(re, shape), lecun(im, shape))

  return {
      "Lambda_re": common.ParamSpec((modes,), initializers.constant(lam.real)),
      "Lambda_im": common.ParamSpec((modes,), initializers.constant(lam.imag)),
      "B": common.ParamSpec((2, modes, features),
                            _in_eigenbasis(draw_b, np.linalg.pinv(v), left=True)),
      "C": common.ParamSpec((2, directions, features, modes),
                            _in_eigenbasis(draw_c, v, left=False)),
      "D": common.ParamSpec((features,), nn.initializers.normal(1.0)),
      "log_dt": common.ParamSpec((modes,), discretization.log_step_init(cfg.dt_min, cfg.dt_max)),
  }


def _system(cfg: Any, params: dict[str, Array]) -> tuple[Array, Array, Array]:
  """(Lambda_bar `(M,)`, B_bar `(M, H)`, C `(directions, H, M)` complex)."""
  b, c = params["B"], params["C"]
  discretize = discretization.by_name(cfg.discretization)
  lam = common.complex_from(params["Lambda_re"], params["Lambda_im"])
  lam_bar, b_bar = discretize(lam, common.complex_from(b[0], b[1]),
                              jnp.exp(params["log_dt"].astype(lam.real.dtype)))
  return lam_bar, b_bar, common.complex_from(c[0], c[1])


def _read(cfg: Any, h: Array, c: Array) -> Array:
  y = jnp.einsum("...m,hm->...h", h, c)
  return 2 * y.real if cfg.conj_sym else y.real


def sequence(cfg: Any, params: dict[str, Array], x: Array, reset: Array | None = None,
             mode: str | Mode = "auto", *, initial_state: Array | None = None,
             return_state: bool = False, axis_name: Hashable | None = None
             ) -> tuple[Array, Array]:
  """S5 over a whole sequence: `(y, final_state)` (see `S5.__call__` for the arguments).

  `return_state` says the caller reads the final state, which a bidirectional S5 refuses.
  """
  if initial_state is not None or return_state:
    common.check_causal(cfg, "state to start from or return")
  lam_bar, b_bar, c = _system(cfg, params)
  xf = x.astype(accumulation_dtype(x.dtype))
  inputs = xf.astype(b_bar.dtype) @ b_bar.T
  # The last recurrence to read `inputs` may write its states over them.
  h, last = linear_recurrence(lam_bar, inputs, initial_state, reset=reset, axis=-2, mode=mode,
                              return_final_state=True, overwrite_b=not cfg.bidirectional,
                              axis_name=axis_name)
  y = _read(cfg, h, c[0])
  if cfg.bidirectional:
    # Backwards, step t starts afresh when a new episode starts at t + 1.
    after = None if reset is None else common.shift_back(reset, -1, axis_name)
    h = linear_recurrence(lam_bar, inputs, reset=after, reverse=True, axis=-2, mode=mode,
                          overwrite_b=True, axis_name=axis_name)
    y = y + _read(cfg, h, c[1])
  y = (y + xf * common.leading_ones(params["D"], xf.ndim)).astype(x.dtype)
  return y, last


def initialize_state(cfg: Any, input_shape: tuple[int, ...]) -> Array:
  """The zero state `(*batch, modes)` complex64 for inputs `(*batch, H)`."""
  modes = cfg.d_state // 2 if cfg.conj_sym else cfg.d_state
  return jnp.zeros((*tuple(input_shape)[:-1], modes), jnp.complex64)


def step(cfg: Any, params: dict[str, Array], state: Array, x_t: Array, reset: Array | None = None
         ) -> tuple[Array, Array]:
  """One step of a causal S5: `(state, y_t)` (see `S5.step`)."""
  common.check_causal(cfg, "step mode")
  lam_bar, b_bar, c = _system(cfg, params)
  xf = x_t.astype(accumulation_dtype(x_t.dtype))
  state = (common.leading_ones(lam_bar, state.ndim) * common.clear(state, reset)
           + xf.astype(b_bar.dtype) @ b_bar.T)
  y = _read(cfg, state, c[0]) + xf * common.leading_ones(params["D"], xf.ndim)
  return state, y.astype(x_t.dtype)


class S5(functional.LinenLayer):
  """MIMO diagonal SSM: x_t = Lambda_bar x_{t-1} + B_bar u_t, y_t = Re(C x_t) + D u_t.

  Inputs `(..., T, H)` give outputs `(..., T, H)` through one state of `d_state` complex
  dimensions shared by all channels. Lambda starts at the eigenvalues of HiPPO-N (in
  `blocks` diagonal blocks), B and C are drawn in the original basis and moved into the
  eigenbasis (V^-1 B, C V). With `conj_sym` only half the modes are kept and the output
  takes twice the real part, as in the paper's code. The state is `(*batch, modes)`
  complex64; a bidirectional S5 has none (no `initial_state`, `return_state` or `step`).

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
  maths = functional.Maths(param_specs, sequence, step, initialize_state, final_state_on_request=True)
