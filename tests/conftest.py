"""Test configuration: 8 host devices, strict rank promotion, exact float32 matrix products,
float64 available for references, one persistent compilation cache for the whole run, compiled
programs freed after each module, and a garbage collector tuned for tracing."""

import gc
import os
from pathlib import Path

import jax
import jaxlib.version
import pytest

import multi_device

# Set before anything initialises the backend. The sequence-parallel tests split time over
# these devices; every other test runs on the first one, as with a single device. Where the
# default backend has fewer devices (one GPU), the multi-device tests run on these through
# the `host_devices` fixture.
jax.config.update("jax_num_cpu_devices", multi_device.COUNT)
jax.config.update("jax_numpy_rank_promotion", "raise")
# The tests compare float32 results with float64 references at float32 tolerances. GPUs run
# float32 matrix products in TF32 and TPUs in bfloat16 passes by default (docs/precision.md):
# ask every backend for full float32, as the CPU computes anyway.
jax.config.update("jax_default_matmul_precision", "highest")
# Most of the suite's time is XLA compiling small programs, many of them more than once: in
# each xdist worker, in the subprocesses some tests start, and where a test builds a new
# function that traces to the same program. A program compiled once is read back from disk,
# unless it compiled in under 50 ms: serialising and writing those (7 of 10 of the suite's
# programs) cost more than compiling them again (tests/test_nnx.py, one process, cold: 101.8
# against 105.0 s caching every program).
# XLA's optimisation passes cost the tests more than they save: the programs are small and
# run a few times (the benchmarks, not the tests, measure speed). The environment carries
# these settings into the subprocesses the tests start.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(Path(__file__).parents[1] / ".cache" / "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.05")
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
# XLA's CPU fusion emitters and parallel code generation cost the small programs of the
# tests more compile time than they save (measured: test_models 86 s -> 54 s, one process).
# Read when the backend starts; a flag the user set in XLA_FLAGS wins. jaxlib 0.11 no longer
# knows them, and jaxlib aborts every process whose XLA_FLAGS names a flag it does not know,
# so they are asked for only from the jaxlib releases that have them.
_CPU_COMPILE_FLAGS = ("--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1")
if jaxlib.version.__version_info__[:2] < (0, 11):
  _user_flags = os.environ.get("XLA_FLAGS", "")
  os.environ["XLA_FLAGS"] = " ".join(
      [f for f in _CPU_COMPILE_FLAGS if f.split("=")[0] not in _user_flags] + [_user_flags]).strip()
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs",
                  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
jax.config.update("jax_disable_most_optimizations",
                  os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] not in ("0", "false", "False"))


# Tracing and compiling allocate objects by the million, most of them long-lived (jaxprs, caches):
# at Python's default thresholds the collector ran 5200 times over test_models.py and
# test_hybrid.py in one process, scanning every imported module's objects in its full passes:
# 7.2 s of 128 s of CPU time, against 1.9 s of 117 s with the settings below (7.3 against 1.6 s
# of GC, 124 against 120 s in all, over two xdist workers).
gc.set_threshold(10_000, 10, 10)


def pytest_collection_finish(session):
  """Leaves what imports and collection built (modules, jax, flax, the cases) out of every later
  collection."""
  del session
  gc.collect()
  gc.freeze()


@pytest.fixture(autouse=True)
def _float64_available():
  """Lets a test build float64 inputs; float32 inputs stay float32."""
  with jax.enable_x64(True):
    yield


@pytest.fixture(scope="module")
def host_devices():
  """The module's tests run on 8 devices: the default backend's, or else the CPU's host devices."""
  with multi_device.on_host_devices():
    yield


@pytest.fixture(scope="module", autouse=True)
def _compiled_programs_freed():
  """Frees each module's compiled programs when it ends.

  A worker kept every program it compiled, 7-8 GB each by the end of a run on 2 workers; the
  next module that needs one reads it back from the persistent cache in milliseconds, or
  compiles it again where it took under 50 ms (faster than writing it).
  """
  yield
  jax.clear_caches()
  gc.collect()
