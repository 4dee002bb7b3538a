"""What `import ssmkit` needs: the scans, the RL estimators and the linen layers import and run
where flax's NNX cannot (a flax made for an older jax), and `ssmkit.nnx` then says why."""

import subprocess
import sys
import textwrap


def test_scans_and_linen_layers_work_where_flax_nnx_cannot_import():
  script = textwrap.dedent("""
      import sys
      sys.modules["flax.nnx"] = None  # `import flax.nnx` now fails, as flax 0.12.8 does under jax 0.11

      import jax
      import jax.numpy as jnp
      import numpy as np

      import ssmkit

      h = ssmkit.scan.linear_recurrence(jnp.full((5, 2), 0.5), jnp.ones((5, 2)))
      np.testing.assert_allclose(h[-1], 2 - 0.5 ** 4)
      returns = ssmkit.rl.discounted_returns(jnp.ones(3), jnp.full(3, 0.5))
      np.testing.assert_allclose(returns, [1.75, 1.5, 1.0])
      layer = ssmkit.layers.LRU(d_state=4)
      x = jnp.ones((1, 3, 2))
      assert layer.apply(layer.init(jax.random.key(0), x), x).shape == x.shape
      try:
        ssmkit.nnx
      except ImportError as error:
        print(error)
      else:
        raise AssertionError("ssmkit.nnx imported without flax.nnx")
  """)
  run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False,
                       timeout=240)
  assert run.returncode == 0, run.stderr
  message = run.stdout
  assert "ssmkit.nnx needs flax's NNX" in message
  for name in ("flax", "jax", "jaxlib"):
    assert f"{name} 0." in message
  assert "ssmkit.scan, ssmkit.rl and the linen layers" in message
