"""Tests of ssmkit.train and the `ssmkit train` / `ssmkit eval` commands.

Training runs use the shipped mnist1d_lru config made tiny by the `TINY` overrides (a 1-block
model of about 1.4k parameters, 160 train and 40 test sequences, 6 steps), so each run takes a
few seconds, mostly compilation. Runs are shared by the tests of a module-scoped fixture.
"""

import contextlib
import io
import json
import logging
import pathlib
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from ssmkit import cli, train
from ssmkit._src.train import metrics
from ssmkit._src.train.batches import TrainBatches, eval_batches
from ssmkit._src.train.model import parameter_labels
from ssmkit._src.train.steps import metric_sums

STEPS = 6
TINY = (
    "data.kwargs.num_samples=200",  # 160 train and 40 test sequences
    "data.batch_size=16",  # 40 test sequences: the last eval batch is half padding
    "model.num_blocks=1",
    "model.features=16",
    "model.layer_kwargs.d_state=8",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=0.01",
    f"train.steps={STEPS}",
    "train.log_every=1",
    "train.eval_every=3",
    "train.checkpoint_every=3",
    "mesh.data=1",  # one device: tests/test_data_parallel.py runs on all eight
)


def _config(*overrides):
  return train.load_config("mnist1d_lru", [*TINY, *overrides])


def _final_state(workdir, step=STEPS):
  """The raw tree (params, opt_state, batch_stats, step) of a run's checkpoint."""
  path = pathlib.Path(workdir, "checkpoints", str(step), "state").absolute()
  return ocp.StandardCheckpointer().restore(path)


def _last_line(text):
  return text.strip().splitlines()[-1]


# Configs.


@pytest.mark.parametrize("name", train.shipped_configs("supervised"))
def test_every_shipped_config_loads_and_comments_every_field(name):
  config = train.load_config(name)
  assert config.data.name
  path = pathlib.Path(train.__file__).parents[1] / "configs" / f"{name}.yaml"
  for line in path.read_text().splitlines():
    key, _, value = line.partition(":")
    if not line.lstrip().startswith("#") and value.split("#")[0].strip():  # a field, not a section
      assert "#" in value, f"{name}.yaml: field {key.strip()!r} has no comment"


def test_top_level_configs_directory_is_the_shipped_one():
  root = pathlib.Path(train.__file__).parents[2]
  assert (root / "configs").resolve() == (root / "ssmkit" / "configs").resolve()


def test_overrides_apply_on_top_of_the_file_with_yaml_values():
  config = train.load_config(
      "configs/mnist1d_lru.yaml",
      ["train.steps=7", "model.layer_kwargs.d_state=16", "optimizer.grad_clip=null", "model.layer=s5"],
  )
  assert config.train.steps == 7
  assert config.model.layer_kwargs["d_state"] == 16
  assert config.model.layer_kwargs["r_min"] == 0.4  # from the file
  assert config.optimizer.grad_clip is None
  assert config.model.layer == "s5"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.featurs=3"], "model.featurs"),
        (["trian.steps=3"], "trian"),
        (["train.steps=abc"], "train.steps"),
        (["optimizer.learning_rate=fast"], "optimizer.learning_rate"),
        (["model.layer=gru"], "model.layer"),
        (["model.norm=group"], "model.norm"),
        (["data.batch_size=0"], "data.batch_size"),
        (["model.dropout_rate=1.5"], "model.dropout_rate"),
        (["train.steps"], "train.steps"),  # no "="
    ],
)
def test_bad_overrides_raise_errors_naming_the_key(overrides, key):
  with pytest.raises(train.ConfigError, match=key):
    train.load_config("mnist1d_lru", overrides)


def test_unknown_key_in_a_file_is_named(tmp_path):
  path = tmp_path / "bad.yaml"
  path.write_text("data:\n  name: mnist1d\nmodel:\n  num_block: 3\n")
  with pytest.raises(train.ConfigError, match=r"model\.num_block"):
    train.load_config(path)


def test_missing_dataset_name_is_named():
  with pytest.raises(train.ConfigError, match=r"data\.name"):
    train.load_config(None, [])


def test_unknown_config_lists_the_shipped_ones():
  with pytest.raises(FileNotFoundError, match="mnist1d_lru"):
    train.load_config("no_such_config")


def test_unknown_layer_kwarg_is_named_when_the_model_is_built():
  config = _config("model.layer_kwargs.d_stat=8")
  with pytest.raises(train.ConfigError, match=r"model\.layer_kwargs\.d_stat"):
    train.build_model(config.model, num_outputs=10, vocab_size=None)


def test_unknown_data_kwarg_is_named(tmp_path):
  with pytest.raises(train.ConfigError, match="num_sample"):
    train.train_and_evaluate(_config("data.kwargs.num_sample=5"), tmp_path)


def test_per_step_targets_need_pooling_none(tmp_path):
  config = train.load_config(
      None, ["data.name=induction_heads", "data.kwargs={num_train: 4, num_test: 2, length: 8}"]
  )
  with pytest.raises(train.ConfigError, match=r"model\.pooling"):
    train.train_and_evaluate(config, tmp_path)


# Optimizer, batches and loss.


def _tiny_params(layer):
  """A config and the parameter shapes of its model."""
  config = train.load_config(
      None,
      ["data.name=mnist1d", f"model.layer={layer}", "model.features=8", "model.layer_kwargs.d_state=4"],
  )
  model = train.build_model(config.model, num_outputs=3, vocab_size=None)
  variables = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 5, 2), jnp.float32))
  return config, variables["params"]


@pytest.mark.parametrize(
    "layer, ssm",
    [
        ("lru", {"nu_log", "theta_log", "gamma_log", "B_re", "B_im"}),
        ("s4d", {"log_dt", "log_a_real", "a_imag", "B_re", "B_im"}),
        ("s5", {"Lambda_re", "Lambda_im", "B", "log_dt"}),
        ("mamba", set()),
    ],
)
def test_ssm_parameters_get_their_own_group(layer, ssm):
  _, params = _tiny_params(layer)
  labels = jax.tree_util.tree_flatten_with_path(parameter_labels(params, layer))[0]
  by_name = {}
  for path, label in labels:
    by_name.setdefault(path[-1].key, set()).add(label)
  assert {name for name, label in by_name.items() if label == {"ssm"}} == ssm
  assert by_name["kernel"] == {"decay"}
  assert by_name["bias"] == by_name["scale"] == {"no_decay"}
  if layer == "mamba":
    assert by_name["A_log"] == by_name["dt_bias"] == by_name["D"] == by_name["conv_bias"] == {"no_decay"}


def test_optimizer_gives_ssm_parameters_their_learning_rate_and_no_weight_decay():
  config, shapes = _tiny_params("lru")
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), shapes)
  lr, ssm_lr, decay = 0.01, 0.001, 0.1
  config.optimizer.learning_rate, config.optimizer.ssm_learning_rate = lr, ssm_lr
  config.optimizer.weight_decay, config.optimizer.grad_clip = decay, None
  config.optimizer.warmup_steps = 0
  tx = train.make_optimizer(config.optimizer, "lru", total_steps=100)
  labels = parameter_labels(params, "lru")
  # Zero gradients: AdamW's first update is -lr * decay * p on decayed parameters, 0 elsewhere.
  zeros = jax.tree.map(jnp.zeros_like, params)
  apply_tx = jax.jit(tx.update)
  updates, _ = apply_tx(zeros, tx.init(params), params)
  for update, param, label in zip(*map(jax.tree.leaves, (updates, params, labels)), strict=True):
    expected = -lr * decay * param if label == "decay" else np.zeros_like(param)
    np.testing.assert_allclose(update, expected, rtol=1e-5, atol=1e-9)
  # Unit gradients: Adam's first step has size lr (ssm_lr for SSM parameters), before decay.
  ones = jax.tree.map(jnp.ones_like, params)
  updates, _ = apply_tx(ones, tx.init(params), zeros)
  for update, label in zip(*map(jax.tree.leaves, (updates, labels)), strict=True):
    np.testing.assert_allclose(update, -(ssm_lr if label == "ssm" else lr), rtol=1e-4)


def test_train_batches_restart_exactly_from_a_saved_position():
  arrays = {"x": np.arange(10)[:, None].astype(np.float32), "y": np.arange(10, dtype=np.int32)}
  batches = TrainBatches(arrays, batch_size=3, seed=1)
  assert batches.steps_per_epoch == 3  # the 10th example is dropped each epoch
  epoch = [next(batches)["y"] for _ in range(3)]
  assert len(set(np.concatenate(epoch))) == 9
  for _ in range(2):
    next(batches)
  position = batches.state()
  expected = [next(batches)["y"] for _ in range(5)]
  restored = TrainBatches(arrays, batch_size=3, seed=1)
  restored.restore(position)
  np.testing.assert_array_equal([next(restored)["y"] for _ in range(5)], expected)


def test_eval_batches_count_every_example_once():
  arrays = {"x": np.arange(7)[:, None].astype(np.float32), "y": np.arange(7, dtype=np.int32)}
  batches = eval_batches(arrays, batch_size=3)
  assert [b["y"].shape for b in batches] == [(3,)] * 3
  counted = np.concatenate([b["y"][b["valid"]] for b in batches])
  np.testing.assert_array_equal(counted, np.arange(7))


def test_metric_sums_score_only_real_targets_of_real_examples():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 4, 5)).astype(np.float32)
  y = np.array([[1, -1, 2, 0], [4, 4, -1, -1], [0, 1, 2, 3]], np.int32)
  valid = np.array([True, True, False])
  sums = jax.jit(metric_sums)(logits, {"y": y, "valid": valid})
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  scored = [(b, t) for b in range(2) for t in range(4) if y[b, t] >= 0]
  np.testing.assert_allclose(sums["loss"], -sum(log_probs[b, t, y[b, t]] for b, t in scored), rtol=1e-5)
  assert sums["correct"] == sum(logits[b, t].argmax() == y[b, t] for b, t in scored)
  assert sums["count"] == len(scored) == 5


# Every shipped config, made tiny.

# Per dataset, the overrides that shrink it; `SMALL_MODEL` shrinks any model and run.
SMALL_DATA = {
    "mnist1d": ("data.kwargs.num_samples=200",),
    "sequential_digits": (),  # 1797 sequences in all: small already
    "selective_copying": ("data.kwargs={num_train: 64, num_test: 16, length: 20, num_tokens: 4}",),
}
SMALL_MODEL = (
    "data.batch_size=16",
    "model.num_blocks=1",
    "model.features=16",
    "model.layer_kwargs.d_state=8",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=0.01",
    "optimizer.ssm_learning_rate=0.01",
    "train.steps=8",
    "train.log_every=1",
    "train.eval_every=0",
    "mesh.data=1",
)


# mnist1d_lru's tiny variant is the run of the `uninterrupted` fixture below.
@pytest.mark.parametrize("name", sorted(set(train.shipped_configs("supervised")) - {"mnist1d_lru"}))
def test_every_shipped_config_trains_in_its_tiny_variant(name, tmp_path, capsys):
  dataset = train.load_config(name).data.name
  overrides = [*SMALL_DATA[dataset], *SMALL_MODEL]
  with jax.enable_x64(False):
    assert cli.main(["train", name, "--workdir", str(tmp_path), *overrides]) == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert _last_line(capsys.readouterr().out) == f"test_accuracy={summary['test_accuracy']:.4f}"
  assert summary["steps"] == 8 and (tmp_path / "curves.png").exists()
  assert (tmp_path / "checkpoints" / "8").is_dir()
  records = metrics.read(tmp_path / "metrics.jsonl")
  assert records[-1]["loss"] < records[0]["loss"]


# Training runs.


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One whole run, with the compilations of `train_step` counted."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  compiles = []
  handler = logging.Handler()
  handler.emit = lambda record: compiles.append(record.getMessage())
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.enable_x64(True), jax.log_compiles():
      summary = train.train_and_evaluate(_config(), workdir)
  finally:
    logger.removeHandler(handler)
  train_step_compiles = [m for m in compiles if m.startswith("Compiling jit(train_step)")]
  return workdir, summary, train_step_compiles


def test_run_writes_metrics_summary_curves_and_checkpoints(uninterrupted):
  workdir, summary, _ = uninterrupted
  records = metrics.read(workdir / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  for record in records:
    assert {"loss", "accuracy", "learning_rate", "examples_per_second"} <= record.keys()
  assert [r["step"] for r in records if "test_accuracy" in r] == [3, 6]
  assert json.loads((workdir / "summary.json").read_text()) == summary
  assert summary["steps"] == STEPS
  assert summary["params"] == sum(x.size for x in jax.tree.leaves(_final_state(workdir)["params"]))
  assert summary["test_accuracy"] == records[-1]["test_accuracy"]
  assert summary["config"]["train"]["steps"] == STEPS
  assert (workdir / "curves.png").read_bytes().startswith(b"\x89PNG")
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["3", "6"]
  assert train.load_config(workdir / "config.yaml") == _config()


def test_loss_falls(uninterrupted):
  records = metrics.read(uninterrupted[0] / "metrics.jsonl")
  assert records[-1]["loss"] < records[0]["loss"]


def test_train_step_compiles_once_and_params_stay_float32(uninterrupted):
  workdir, _, train_step_compiles = uninterrupted
  assert len(train_step_compiles) == 1
  assert {x.dtype for x in jax.tree.leaves(_final_state(workdir)["params"])} == {np.dtype(np.float32)}


def test_eval_command_reproduces_the_final_test_metrics(uninterrupted, capsys):
  workdir, summary, _ = uninterrupted
  assert cli.main(["eval", "--workdir", str(workdir)]) == 0
  out = capsys.readouterr().out
  assert f"step={STEPS} test_examples=40 test_loss={summary['test_loss']:.4f}" in out
  assert _last_line(out) == f"test_accuracy={summary['test_accuracy']:.4f}"


def test_eval_command_without_a_run_fails_clearly(tmp_path, capsys):
  assert cli.main(["eval", "--workdir", str(tmp_path)]) == 2
  assert "config.yaml" in capsys.readouterr().err


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """A run stopped by SIGINT after step 4, then resumed by `ssmkit train` from step 3."""
  workdir = tmp_path_factory.mktemp("interrupted")
  handler_before = signal.getsignal(signal.SIGINT)

  def send_sigint(step):
    if step == 4:
      signal.raise_signal(signal.SIGINT)

  with jax.enable_x64(True):
    with pytest.raises(train.Interrupted) as stop:
      train.train_and_evaluate(_config(), workdir, hooks=[send_sigint])
    after_stop = {
        "handler": signal.getsignal(signal.SIGINT),
        "checkpoints": sorted(p.name for p in (workdir / "checkpoints").iterdir()),
        "steps": [r["step"] for r in metrics.read(workdir / "metrics.jsonl")],
    }
    # As if the process had died before saving step 4: the run resumes from step 3.
    shutil.rmtree(workdir / "checkpoints" / "4")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      status = cli.main(["train", "mnist1d_lru", *TINY[:3], "--workdir", str(workdir), *TINY[3:]])
  return {"workdir": workdir, "stop": stop.value, "handler_before": handler_before,
          "after_stop": after_stop, "status": status, "out": out.getvalue()}


def test_sigint_saves_a_checkpoint_and_stops_at_the_step_boundary(interrupted):
  stop, after_stop = interrupted["stop"], interrupted["after_stop"]
  assert stop.signal_name == "SIGINT" and stop.step == 4
  assert after_stop["checkpoints"] == ["3", "4"]
  assert after_stop["steps"] == [1, 2, 3, 4]
  assert after_stop["handler"] is interrupted["handler_before"]


def test_resumed_run_matches_the_uninterrupted_one(interrupted, uninterrupted):
  workdir = interrupted["workdir"]
  assert interrupted["status"] == 0
  assert "resuming from step 3" in interrupted["out"]
  resumed, whole = _final_state(workdir), _final_state(uninterrupted[0])
  assert resumed["step"] == whole["step"] == STEPS
  # The same float32 operations in the same order on CPU; the tolerance only allows for a
  # different XLA fusion of the recompiled step.
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
  for key in ("params", "batch_stats", "opt_state"):
    jax.tree.map(close, resumed[key], whole[key])
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["test_accuracy"] == pytest.approx(uninterrupted[1]["test_accuracy"])


def test_resumed_run_logs_each_step_once(interrupted, uninterrupted):
  records = metrics.read(interrupted["workdir"] / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))
  whole = metrics.read(uninterrupted[0] / "metrics.jsonl")
  np.testing.assert_allclose([r["loss"] for r in records], [r["loss"] for r in whole], rtol=1e-5)


def test_train_command_prints_the_test_accuracy_last(interrupted):
  summary = json.loads((interrupted["workdir"] / "summary.json").read_text())
  assert _last_line(interrupted["out"]) == f"test_accuracy={summary['test_accuracy']:.4f}"


def test_workdir_of_another_model_is_refused(interrupted):
  with pytest.raises(train.ConfigError, match=r"model\.features"):
    train.train_and_evaluate(_config("model.features=32"), interrupted["workdir"])


def test_train_command_reports_config_errors(tmp_path, capsys):
  assert cli.main(["train", "mnist1d_lru", "--workdir", str(tmp_path), "model.featurs=3"]) == 2
  assert "model.featurs" in capsys.readouterr().err
