"""Compile time of a deep published architecture with its blocks unrolled and under `nn.scan`.

Takes a fixture's config.json (`tests/fixtures/pretrained/NAME`), deepens it to LAYERS layers
(its `layer_types` cycled, Kimi Linear's `mlp_layer_types` continued by their last), and
compiles the model's forward pass and the gradient of its summed logits (B=2, T=40) from
`ssmkit.pretrained.load(..., abstract=True)`, without and with `scan_blocks=True`; then times
greedy `generate` of 16 tokens after a prompt of 8 (parameters all 0.01), its first call
(compiling) and a second. Run with the persistent compilation cache off so that nothing is read
back:

  JAX_ENABLE_COMPILATION_CACHE=false python scripts/compile_scanned_checkpoint.py qwen3_next 48
"""

from __future__ import annotations

import argparse
import json
import pathlib
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import ssmkit.pretrained
from ssmkit.layers import generate

FIXTURES = pathlib.Path(__file__).parents[1] / "tests" / "fixtures" / "pretrained"


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("name", help="a fixture under tests/fixtures/pretrained")
  parser.add_argument("layers", type=int, help="the depth to compile")
  args = parser.parse_args()
  config = json.loads((FIXTURES / args.name / "config.json").read_text())
  text = config.get("text_config", config)
  depth, text["num_hidden_layers"] = text["num_hidden_layers"], args.layers
  if "layer_types" in text:
    text["layer_types"] = [text["layer_types"][i % depth] for i in range(args.layers)]
  if "mlp_layer_types" in text:  # Kimi Linear's: the added layers' MLPs as the last layer's
    text["mlp_layer_types"] = [text["mlp_layer_types"][min(i, depth - 1)] for i in range(args.layers)]
  folder = pathlib.Path(tempfile.mkdtemp())
  (folder / "config.json").write_text(json.dumps(config))
  ids = jax.ShapeDtypeStruct((2, 40), jnp.int32)
  for scan in (False, True):
    model, shapes, _ = ssmkit.pretrained.load(folder, abstract=True, scan_blocks=scan)
    loss = lambda variables, ids, model=model: model.apply(variables, ids).sum()
    for what, function in (("forward", model.apply), ("gradient", jax.grad(loss))):
      start = time.perf_counter()
      lowered = jax.jit(function).lower(shapes, ids)
      traced = time.perf_counter()
      lowered.compile()
      done = time.perf_counter()
      print(f"{args.name} {args.layers} layers, scan_blocks={scan}, {what}: traced and lowered "
            f"in {traced - start:.1f} s, compiled in {done - traced:.1f} s", flush=True)
    variables = jax.tree.map(lambda s: jnp.full(s.shape, 0.01, s.dtype), shapes)
    prompt = jnp.arange(3, 11, dtype=jnp.int32)[None]
    times = []
    for _ in range(2):
      start = time.perf_counter()
      np.asarray(generate(model, variables, prompt, 16, temperature=0.0))
      times.append(time.perf_counter() - start)
    print(f"{args.name} {args.layers} layers, scan_blocks={scan}, generate: first call "
          f"{times[0]:.1f} s, second {times[1] * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
  main()
