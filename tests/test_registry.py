"""The layer registry is the one list of layers: every contract runs every registered layer, and
a new layer needs one file and one registry entry to pass them all."""

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import ssmkit.nnx as snx
from ssmkit import layers
from ssmkit._src.layers.registry import LAYERS

TESTS = Path(__file__).parent
# The modules whose tests take a layer as a parameter.
CONTRACTS = ["test_layers.py", "test_nnx.py", "test_models.py", "test_train.py",
             "test_layer_sequence_parallel.py"]


def _layers_of(node_id: str) -> set[str]:
  """The registered layers a test id names among its parameters."""
  params = node_id.partition("[")[2].rstrip("]")
  return set(re.split(r"[-\[\]]", params)) & set(LAYERS) | (
      {"throwaway"} if "throwaway" in params else set())


def test_every_shipped_layer_is_exported_by_name_from_both_front_ends():
  for entry in LAYERS.values():
    name = entry.layer.__name__
    assert getattr(layers, name) is entry.layer
    assert getattr(snx, name) is snx.front_end(entry.layer)
    assert getattr(snx, name).linen is entry.layer


def test_a_new_layer_is_one_file_and_one_entry(tmp_path):
  """`throwaway_layer.py` registers a layer; every contract then runs it too, and it passes them."""
  collected = tmp_path / "collected.txt"
  env = {**os.environ, "SSMKIT_COLLECTED": str(collected),
         "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-p", "throwaway_layer", "-p", "no:cacheprovider",
       "-o", "addopts=", "--import-mode=importlib", "-q", "-k", "throwaway",
       str(TESTS / "throwaway_layer.py"), *(str(TESTS / name) for name in CONTRACTS)],
      capture_output=True, text=True, env=env, cwd=TESTS.parent, timeout=240)
  assert run.returncode == 0, run.stdout[-5000:] + run.stderr[-5000:]
  # A test that runs most layers (a contract, not a check of a few layers' particulars)
  # runs them all, the new one too.
  by_test = collections.defaultdict(set)
  for node_id in collected.read_text().split():
    by_test[node_id.partition("[")[0]] |= _layers_of(node_id)
  contracts = {test: names for test, names in by_test.items()
               if len(names & set(LAYERS)) > len(LAYERS) / 2}
  assert len(contracts) >= 20
  missing = {test: sorted({*LAYERS, "throwaway"} - names) for test, names in contracts.items()
             if names != {*LAYERS, "throwaway"}}
  assert not missing, f"contracts that leave registered layers out: {missing}"
  # And the new layer passed each of them, and its own reference test.
  ran = int(re.search(r"(\d+) passed", run.stdout).group(1))
  assert ran >= len(contracts) + 1 and " failed" not in run.stdout, run.stdout[-3000:]
