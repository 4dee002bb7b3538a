"""Data-parallel and multi-process training: the same run on 1, 2 and 8 host devices and 2 processes.

A run on a mesh of n devices splits every batch n ways and replicates the parameters; it must
compute what one device computes, up to float32 rounding: the same loss at every step, the same
parameters at the end. The runs use the tiny mnist1d_lru of tests/test_train.py with LayerNorm
and dropout (with BatchNorm after the encoder the encoder bias has no gradient, and Adam turns
rounding noise into steps of the learning rate, so the parameters would not be comparable), and
a BatchNorm check of two train steps. tests/test_ppo.py runs PPO on 8 devices and resumes it on 1.
Every run of this module uses the default backend's devices where it has 8, else the CPU's
(the `host_devices` fixture), so the runs compared with each other share a backend.
"""

import functools
import json
import math
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ssmkit import cli, train
from ssmkit._src.train.core import metrics, parallel
from ssmkit._src.train.lm import train as lm_train
from ssmkit._src.train.supervised import train as supervised_train
from ssmkit._src.train.supervised.data import split_arrays

pytestmark = pytest.mark.usefixtures("host_devices")

STEPS = 6
TINY = (
    "data.kwargs.num_samples=200",
    "data.batch_size=16",
    "model.num_blocks=1",
    "model.features=16",
    "model.layer_kwargs.d_state=8",
    "model.norm=layer",
    "model.dropout_rate=0.1",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=0.01",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=3",
    "train.checkpoint_every=3",
)


def _run(workdir, *overrides, hooks=()):
  with jax.enable_x64(False):
    return train.train_and_evaluate(train.load_config("mnist1d_lru", [*TINY, *overrides]), workdir,
                                    hooks=hooks)


def _losses(workdir):
  return [r["loss"] for r in metrics.read(pathlib.Path(workdir) / "metrics.jsonl")]


def _params(workdir, step=STEPS):
  """The parameters of a checkpoint, restored onto one device whatever the devices that saved them."""
  path = pathlib.Path(workdir, "checkpoints", str(step), "state").absolute()
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  with ocp.StandardCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(path).item_metadata
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), metadata)
    return checkpointer.restore(path, target)["params"]


def _assert_same_run(workdir, reference):
  np.testing.assert_allclose(_losses(workdir), _losses(reference), rtol=2e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6),
               _params(workdir), _params(reference))
  summary, expected = (json.loads((pathlib.Path(w) / "summary.json").read_text())
                       for w in (workdir, reference))
  assert summary["test_loss"] == pytest.approx(expected["test_loss"], rel=1e-5)


@pytest.fixture(scope="module")
def one_device(host_devices, tmp_path_factory):
  workdir = tmp_path_factory.mktemp("one_device")
  _run(workdir, "mesh.data=1")
  return workdir


def test_run_on_every_device_resumed_on_two_equals_one_device(one_device, tmp_path, capsys):
  """The default mesh is every device; its checkpoints restore onto another number of them."""

  def send_sigint(step):
    if step == 4:
      signal.raise_signal(signal.SIGINT)

  assert jax.device_count() == 8
  platform = jax.devices()[0].platform
  with pytest.raises(train.Interrupted):
    _run(tmp_path, hooks=[send_sigint])
  assert f"on 8 {platform} device(s) (data 8)" in capsys.readouterr().out
  shutil.rmtree(tmp_path / "checkpoints" / "4")  # resume from step 3, saved by 8 devices
  _run(tmp_path, "mesh.data=2")
  assert f"on 2 {platform} device(s) (data 2), resuming from step 3" in capsys.readouterr().out
  _assert_same_run(tmp_path, one_device)


def test_batch_norm_statistics_span_the_whole_batch():
  """Train steps with BatchNorm; each device's 2 sequences alone would give other statistics.

  The running statistics are compared after the first step, which computes them with the
  initial parameters: the encoder bias, which BatchNorm makes gradient-free, moves by rounding
  noise from then on, and the running mean with it.
  """
  losses, stats = {}, {}
  for devices in (1, 8):
    config = train.load_config("mnist1d_lru", [*TINY, "model.norm=batch", f"mesh.data={devices}"])
    with jax.enable_x64(False):
      run = train.supervised.setup(config)
      replicated = parallel.replicated(run.mesh)
      steps = jax.jit(functools.partial(train.supervised.train_steps, sharding=parallel.split(run.mesh)))
      arrays = parallel.place(split_arrays(run.dataset, "train"), replicated)
      state, losses[devices] = run.state, []
      for _ in range(2):
        indices = parallel.place(run.order.take(1, rows=1), replicated)
        state, sums = steps(state, arrays, indices, 1, run.dropout_key)
        losses[devices].append(float(sums["loss"][0]))
        stats.setdefault(devices, jax.device_get(state.batch_stats))
  np.testing.assert_allclose(losses[8], losses[1], rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7), stats[8], stats[1])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("mesh.data=0", r"`mesh.data` must be -1"),
        ("mesh.data=16", r"`mesh.data` x `mesh.fsdp` x `mesh.expert` x `mesh.seq`=16 asks for more "
                         r"devices than the 8"),
        ("mesh.data=3", r"`data.batch_size`=16 must be a multiple of `mesh.data` x `mesh.fsdp` x "
                        r"`mesh.expert`, 3 "),
        ("mesh.fsdp=0", r"`mesh.fsdp` must be a device count >= 1, got 0"),
        ("mesh.fsdp=3", r"`mesh.fsdp` x `mesh.expert` x `mesh.seq`=3 must divide the 8 devices"),
        ("mesh.expert=0", r"`mesh.expert` must be a device count >= 1, got 0"),
    ],
)
def test_bad_mesh_is_a_config_error(override, message, tmp_path):
  with pytest.raises(train.ConfigError, match=message):
    _run(tmp_path, override)


def test_ppo_environments_must_split_evenly(tmp_path, capsys):
  overrides = ["env.num_envs=12", "ppo.minibatches=2", "mesh.data=8", "train.updates=1"]
  assert cli.main(["train", "ppo_memory_lru", "--workdir", str(tmp_path), *overrides]) == 2
  assert ("`env.num_envs`=12 must be a multiple of `mesh.data` x `mesh.fsdp` x `mesh.expert`, "
          "8 devices") in capsys.readouterr().err


def _free_port():
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    return sock.getsockname()[1]


def test_two_processes_train_like_one_device(one_device, tmp_path):
  """`ssmkit train` in 2 processes of 2 CPU devices each, joined by jax.distributed."""
  address = f"localhost:{_free_port()}"
  env = {**os.environ, "JAX_NUM_CPU_DEVICES": "2", "JAX_PLATFORMS": "cpu"}
  command = [sys.executable, "-m", "ssmkit", "train", "mnist1d_lru", "--workdir", str(tmp_path),
             "--coordinator-address", address, "--num-processes", "2", *TINY]
  processes = [
      subprocess.Popen([*command, "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True)
      for i in range(2)
  ]
  try:
    outputs = [process.communicate(timeout=120)[0] for process in processes]
  finally:  # a process left waiting for its peer would outlive the test run
    for process in processes:
      process.kill()
  assert [process.returncode for process in processes] == [0, 0], outputs
  assert "on 4 cpu device(s) (data 4)" in outputs[0]
  assert "on 4 cpu device(s)" not in outputs[1]  # only process 0 prints
  _assert_same_run(tmp_path, one_device)


@pytest.fixture
def not_cached():
  """Keeps the test's programs out of the persistent compilation cache.

  On 8 CPU devices (jaxlib 0.10.2), the train step of a model whose blocks run under `nn.scan`
  with parameters sharded over "fsdp" aborts the process most times it is read back from the
  cache, and never when compiled afresh.
  """
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update("jax_persistent_cache_min_compile_time_secs", float("inf"))
  yield
  jax.config.update("jax_persistent_cache_min_compile_time_secs", before)


def _corpus(path):
  """40 small Python files of random characters, two bytes of UTF-8 among them."""
  path.mkdir()
  rng = np.random.default_rng(0)
  for i in range(40):
    text = "".join(rng.choice(list("def x():\n  return 1 + é\n"), rng.integers(3, 60)))
    (path / f"module_{i}.py").write_text(text, encoding="utf-8")
  return path


@pytest.mark.parametrize(("overrides", "match"), [
    (["mesh.seq=3"], "`mesh.seq`=3 must divide the sequence length"),
    (["mesh.seq=2", "model.norm=batch"], "norm='batch'"),
    (["mesh.seq=0"], "`mesh.seq` must be a device count"),
    (["mesh.seq=2", "model.norm=layer", "model.dtype=bfloat16"],
     "`mesh.seq`=2 with `model.dtype`='bfloat16' aborts XLA's CPU compiler"),
])
def test_a_bad_split_over_time_is_named_before_training(overrides, match, monkeypatch):
  """Named before the model's state is built (its initialisation compiles)."""
  config = train.load_config("mnist1d_lru", ["data.kwargs.num_samples=200", "mesh.data=1", *overrides])
  monkeypatch.setattr(supervised_train, "create_train_state", None)  # built: a TypeError
  with pytest.raises(train.ConfigError, match=match):
    train.supervised.setup(config)


@pytest.mark.usefixtures("not_cached")
def test_a_language_model_over_fsdp_experts_and_time_trains_as_one_device(tmp_path):
  """`lm_hybrid` (a global-attention block as a head, then two Gated DeltaNet blocks, under
  `nn.scan`, each with a mixture of 4 experts) on fsdp=2 x expert=2 x seq=2 devices: each
  sequence of 16 bytes split into two slices of 8, with documents crossing them, each device
  holding half the parameters and optimizer state and a quarter of the experts'. The loss at
  every step, the test loss and the final parameters are one device's."""
  overrides = [f"data.path={_corpus(tmp_path / 'corpus')}", "data.seq_len=16", "data.batch_size=4",
               "data.validation_fraction=0.3", "model.features=16",
               "model.layer=[attention,gated_deltanet]", "model.num_blocks=3",
               "model.head_blocks=1", "model.scan_blocks=true", "model.mlp=experts",
               "model.experts={num_experts: 4, top_k: 2, width: 8, shared_width: 4}",
               "optimizer.warmup_steps=0", "train.steps=4", "train.log_every=1",
               "train.eval_every=0", "samples.documents=0"]
  config = lambda *mesh: train.load_config("lm_hybrid", [*overrides, *mesh])
  mesh = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2", "mesh.seq=2"]
  with jax.enable_x64(False):
    for name, devices in (("one", ["mesh.data=1"]), ("split", mesh)):
      train.lm.train_and_evaluate(config(*devices), tmp_path / name)
    run = train.supervised.setup(config(*mesh), lm_train.TASK, abstract=True)
  assert dict(run.mesh.shape) == {"data": 1, "fsdp": 2, "expert": 2, "seq": 2}
  # The model ran split over time: its convolution windows crossed devices.
  tokens = np.zeros((4, 16), np.int32)
  program = str(jax.make_jaxpr(lambda p: run.state.apply_fn({"params": p}, tokens))(run.state.params))
  assert "shard_map" in program and "ppermute" in program
  np.testing.assert_allclose(_losses(tmp_path / "split"), _losses(tmp_path / "one"), rtol=2e-5)
  # Adam divides each gradient entry by its own size, so where the devices' partial sums nearly
  # cancel, their rounding moves the update by a fraction of the learning rate: every entry but
  # a few to rounding, those few within a tenth of the learning rate per step (measured: one of
  # 256 entries off by 1.7e-4 on an AMD EPYC, none on others).
  step_size = config(*mesh).optimizer.learning_rate
  for a, b in zip(*(jax.tree.leaves(_params(tmp_path / name, 4)) for name in ("split", "one")),
                  strict=True):
    a, b = np.asarray(a), np.asarray(b)
    close = np.abs(a - b) <= 1e-5 + 1e-4 * np.abs(b)
    assert close.mean() >= 0.99, f"{close.size - close.sum()} of {close.size} entries differ"
    np.testing.assert_allclose(a, b, rtol=0, atol=0.1 * step_size * 4)
  summaries = [json.loads((tmp_path / name / "summary.json").read_text()) for name in ("one", "split")]
  np.testing.assert_allclose(summaries[1]["test_loss"], summaries[0]["test_loss"], rtol=2e-5)
  # The state's shapes and shardings (`abstract`): the bytes each device holds of a leaf.
  size = lambda shape, leaf: math.prod(shape) * leaf.dtype.itemsize
  held = lambda leaf: size(leaf.sharding.shard_shape(leaf.shape), leaf)
  assert set(run.state.params) >= {"head", "blocks"} and "tail" not in run.state.params
  for scope in ("head", "blocks"):
    experts = run.state.params[scope]["block_0"]["mlp_experts"]
    for name in ("gate", "up", "down"):  # (blocks, experts, ...): experts over "expert"
      assert experts[name].sharding.spec[1] == "expert"
      assert held(experts[name]) == size(experts[name].shape, experts[name]) // 4
  leaves = jax.tree.leaves((run.state.params, run.state.opt_state))
  total = sum(size(leaf.shape, leaf) for leaf in leaves)
  assert 0.25 * total < sum(map(held, leaves)) < 0.55 * total


def test_experts_are_split_over_the_expert_axis_and_must_divide_it():
  """Per-expert matrices beside a `router` (and their optimizer state, of the same structure)
  are cut over "expert" along the experts' axis, stacked under `nn.scan` or not; a matrix of
  another name, or of a scope without a router, is not."""
  mesh = parallel.make_mesh(parallel.MeshConfig(data=1, fsdp=2, expert=2), 4, "batch")
  shape = lambda *dims: jax.ShapeDtypeStruct(dims, np.float32)
  tree = {"block": {"mlp_experts": {"router": shape(6, 4), "gate": shape(4, 6, 10),
                                    "down": shape(4, 10, 6)},
                    "stacked": {"router": shape(3, 6, 4), "up": shape(3, 4, 6, 10)},
                    "mixer": {"gate": shape(4, 6, 10)}}}
  specs = jax.tree.map(lambda s: tuple(s.spec), parallel.state_shardings(mesh, tree))
  assert specs["block"]["mlp_experts"]["gate"] == ("expert", None, "fsdp")
  assert specs["block"]["mlp_experts"]["down"] == ("expert", "fsdp", None)
  assert specs["block"]["stacked"]["up"] == (None, "expert", None, "fsdp")
  assert "expert" not in specs["block"]["mixer"]["gate"]
  odd = {"mlp_experts": {"router": shape(6, 3), "gate": shape(3, 6, 10)}}
  with pytest.raises(train.ConfigError, match=r"`mesh.expert`=2 must divide the 3 experts"):
    parallel.state_shardings(mesh, odd)
