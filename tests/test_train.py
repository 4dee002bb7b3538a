"""Tests of ssmkit.train and the `ssmkit train` / `ssmkit eval` commands.

Training runs use the shipped mnist1d_lru config made tiny by the `TINY` overrides (a 1-block
model of about 1.4k parameters, 160 train and 40 test sequences, 6 steps), so each run takes a
few seconds, mostly compilation. Runs are shared by the tests of a module-scoped fixture.
"""

import ast
import contextlib
import dataclasses
import functools
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

import ssmkit
from ssmkit import cli, data, layers, train
from ssmkit._src.layers.parallel import BRANCHES
from ssmkit._src.layers.registry import LAYERS
from ssmkit._src.train import reference
from ssmkit._src.train.core import loop, metrics, parallel
from ssmkit._src.train.supervised.data import split_arrays
from ssmkit.train import supervised
from ssmkit.train.core import parameter_labels
from ssmkit.train.supervised import TrainOrder, eval_indices, metric_sums

STEPS = 6
TINY = (
    "data.kwargs.num_samples=200",  # 160 train and 40 test sequences
    "data.batch_size=16",  # 40 test sequences: the last eval batch is half padding
    "model.num_blocks=1",
    "model.features=16",
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


@contextlib.contextmanager
def _compiles(name):
  """Yields a list that receives the messages of JAX compiling `jit(name)` inside the context."""
  compiles = []
  handler = logging.Handler()
  handler.emit = lambda record: compiles.extend(
      [record.getMessage()] if record.getMessage().startswith(f"Compiling jit({name})") else [])
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with jax.log_compiles():
      yield compiles
  finally:
    logger.removeHandler(handler)


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
      ["train.steps=7", "model.layer_kwargs.d_state=16", "optimizer.grad_clip=null", "model.norm=rms"],
  )
  assert config.train.steps == 7
  assert config.model.layer_kwargs["d_state"] == 16
  assert config.model.layer_kwargs["r_min"] == 0.4  # from the file
  assert config.optimizer.grad_clip is None
  assert config.model.norm == "rms"


@pytest.mark.parametrize(
    "overrides, layer, kwargs",
    [
        # A new layer starts from its own defaults: the file's LRU arguments are not Mamba's.
        (["model.layer=mamba"], "mamba", {}),
        (["model.layer=mamba", "model.layer_kwargs.d_state=8"], "mamba", {"d_state": 8}),
        (["model.layer_kwargs.d_state=8", "model.layer=mamba"], "mamba", {"d_state": 8}),
        # The same layer keeps them; a dict set whole replaces the file's.
        (["model.layer=lru"], "lru", {"d_state": 64, "r_min": 0.4, "r_max": 0.99}),
        (["model.layer_kwargs={}"], "lru", {}),
        (["model.layer_kwargs=null"], "lru", {}),
        (["model.layer_kwargs={d_state: 4}"], "lru", {"d_state": 4}),
    ],
)
def test_switching_the_layer_drops_the_old_layers_arguments(overrides, layer, kwargs):
  config = train.load_config("mnist1d_lru", overrides)
  assert (config.model.layer, config.model.layer_kwargs) == (layer, kwargs)
  assert config.data.kwargs["num_samples"] == 5000  # other dicts stay as the file has them


def test_a_workdir_that_is_a_file_is_refused(tmp_path, capsys):
  (tmp_path / "run").write_text("notes")
  assert cli.main(["train", "mnist1d_lru", "--workdir", str(tmp_path / "run")]) == 2
  assert "is a file" in capsys.readouterr().err.splitlines()[-1]
  assert (tmp_path / "run").read_text() == "notes"


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


def test_unknown_task_is_named():
  message = r"`task` must be one of \('supervised', 'lm', 'ppo'\), got 'rl'"
  with pytest.raises(train.ConfigError, match=message):
    train.load_config("mnist1d_lru", ["task=rl"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.layer_kwargs.d_state=abc", r"`model\.layer_kwargs\.d_state` must be int .*LRU.* 'abc'"),
        ("model.layer_kwargs.d_state=8.5", r"`model\.layer_kwargs\.d_state` must be int .*got 8\.5"),
        ("model.layer_kwargs.r_min=high", r"`model\.layer_kwargs\.r_min` must be float .*got 'high'"),
        ("model.layer_kwargs.param_dtype=float33", r"`model\.layer_kwargs\.param_dtype` must be a dty"),
    ],
)
def test_layer_kwargs_of_another_type_than_the_layer_field_are_named(override, message):
  with pytest.raises(train.ConfigError, match=message):
    _config(override)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["model.layer_kwargs.d_state=-3"], ["d_state"]),
        (["model.layer_kwargs.d_state=0"], ["d_state"]),
        (["model.layer_kwargs.r_max=0.3"], ["r_max"]),  # below the file's r_min of 0.4
        # Each fits the default of the other; together r_min > r_max.
        (["model.layer_kwargs.r_min=0.95", "model.layer_kwargs.r_max=0.92"], ["r_min", "r_max"]),
    ],
)
def test_layer_kwargs_the_layer_rejects_are_named_before_anything_is_written(overrides, named, tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(train.ConfigError, match=r"ssmkit\.layers\.LRU rejects") as error:
    train.train_and_evaluate(_config(*overrides), workdir)
  message = str(error.value)
  assert [key for key in ("d_state", "r_min", "r_max") if f"layer_kwargs.{key}`" in message] == named
  assert not workdir.exists()


def test_unknown_layer_kwarg_is_named():
  with pytest.raises(train.ConfigError, match=r"model\.layer_kwargs\.d_stat"):
    _config("model.layer_kwargs.d_stat=8")


def test_unknown_data_kwarg_is_named_before_anything_is_written(tmp_path):
  with pytest.raises(train.ConfigError, match="num_sample"):
    train.train_and_evaluate(_config("data.kwargs.num_sample=5"), tmp_path)
  assert not any(tmp_path.iterdir())


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
  model = train.core.build_model(config.model, num_outputs=3, vocab_size=None)
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


@pytest.mark.parametrize("name", sorted(LAYERS))
def test_every_layer_declares_parameter_groups_of_its_own_parameters(name):
  """A renamed parameter must be renamed in the declaration too, or this fails (the parameters
  of every test configuration, and with `use_bias` where a layer has it: some parameters, as
  biases, exist only with an option)."""
  names = set()
  cls = LAYERS[name].layer
  biased = [{**config, "use_bias": True} for config in LAYERS[name].test_configs
            if "use_bias" in cls.__dataclass_fields__]
  for config in [*LAYERS[name].test_configs, *biased]:
    layer = cls(**config)
    x = jnp.ones((1, 5, 16), jnp.float32)
    names |= set(jax.eval_shape(layer.init, jax.random.key(0), x)["params"])
  groups = LAYERS[name].layer.parameter_groups
  assert not groups.recurrence & groups.no_decay
  if cls is not layers.Parallel:
    assert groups.recurrence | groups.no_decay <= names
    return
  # A parallel layer's parameters are its branches', each in the group its branch gives it.
  for key in names:
    kind = next(kind for kind in BRANCHES if key.startswith(f"{kind}_"))
    own = BRANCHES[kind].parameter_groups
    rest = key[len(kind) + 1:]
    assert (key in groups.recurrence, key in groups.no_decay) == (rest in own.recurrence,
                                                                  rest in own.no_decay), key


PATTERN = ["model.layer=[lru, attention, lru]",
           "model.layer_kwargs={lru: {d_state: 4}, attention: {num_heads: 2}}",
           "model.features=8", "model.block=mixer", "model.mlp=gelu"]


# (num_blocks, scan_blocks, head_blocks) and the blocks' parameter scopes, each with its place
# in PATTERN: with a head of one block, block 0 takes place 0 and the later ones cycle over 1, 2.
PATTERN_SCOPES = [
    ((4, False, 0), [(("block_0",), 0), (("block_1",), 1), (("block_2",), 2), (("block_3",), 0)]),
    ((4, True, 0), [(("blocks", "block_0"), 0), (("blocks", "block_1"), 1),  # 1 repeat, a tail
                    (("blocks", "block_2"), 2), (("tail", "block_0"), 0)]),
    ((5, False, 1), [(("block_0",), 0), (("block_1",), 1), (("block_2",), 2), (("block_3",), 1),
                     (("block_4",), 2)]),
    ((5, True, 1), [(("head", "block_0"), 0), (("blocks", "block_0"), 1),  # 2 repeats of 2
                    (("blocks", "block_1"), 2)]),
]


@pytest.mark.parametrize("options, scopes", PATTERN_SCOPES,
                         ids=["unrolled", "scanned", "unrolled-head", "scanned-head"])
def test_a_layer_pattern_builds_each_layer_with_its_own_arguments_and_groups(options, scopes):
  """Block i holds layer i mod 3 of the pattern (after a head, the places after it in turn),
  and its parameters its own layer's groups."""
  num_blocks, scan_blocks, head_blocks = options
  config = train.load_config(None, ["data.name=mnist1d", *PATTERN, f"model.num_blocks={num_blocks}",
                                    f"model.scan_blocks={scan_blocks}",
                                    f"model.head_blocks={head_blocks}"])
  model = train.core.build_model(config.model, num_outputs=3, vocab_size=None)
  assert [(make.func, make.keywords) for make in model.layer] == [
      (layers.LRU, {"d_state": 4}), (layers.Attention, {"num_heads": 2}), (layers.LRU, {"d_state": 4})]
  assert (model.block, model.mlp, model.num_blocks, model.head_blocks) == (
      "mixer", "gelu", num_blocks, head_blocks)
  params = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 5, 2)))["params"]
  labels = parameter_labels(params, train.core.layer_names(config.model), head_blocks)
  assert {scope[0] for scope, _ in scopes} == {key for key in labels if key.startswith("block_")
                                                or key in ("head", "blocks", "tail")}
  for scope, place in scopes:
    mixer = functools.reduce(dict.__getitem__, scope, labels)["mixer"]
    if place == 1:
      assert set(mixer.values()) == {"decay"} and "q_proj" in mixer
    else:
      assert mixer["nu_log"] == mixer["B_re"] == "ssm" and mixer["C_re"] == "decay"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.layer=[lru, gru]"], r"`model\.layer\[1\]` must be one of"),
        (["model.layer=[]"], r"`model\.layer` must be one of .* or a non-empty list of them, got \[\]"),
        (["model.layer_kwargs={lru: {d_state: 4}, mamba: {}}"],
         r"`model\.layer_kwargs\.mamba`: .* not in"),
        (["model.layer_kwargs={lru: 4}"], r"`model\.layer_kwargs\.lru` must be a mapping"),
        (["model.layer_kwargs={attention: {windw: 4}}"],
         r"`model\.layer_kwargs\.attention\.windw` is not"),
        (["model.layer_kwargs={attention: {num_heads: 3}}"],
         r"Attention rejects `model\.layer_kwargs\.attention\.num_heads`=3"),
        (["model.mlp=relu"], r"`model\.mlp` must be one of"),
        (["model.block=ssm"], r"`model\.mlp` needs block='mixer'"),
        (["model.prenorm=false"], r"`model\.prenorm` must be True"),
        (["model.tie_embeddings=true"], r"`model\.tie_embeddings` needs token inputs"),
        (["model.logit_cap=0"], r"`model\.logit_cap` must be > 0"),
        (["model.norm_eps=-1e-5"], r"`model\.norm_eps` must be > 0"),
        (["model.mlp_expansion=0"], r"`model\.mlp_expansion` must be > 0"),
        (["model.scan_blocks=true", "model.num_blocks=2"],
         r"`model\.scan_blocks` needs `num_blocks` >="),
        (["model.head_blocks=3"], r"`model\.head_blocks` must be an int from 0 to .* \(2\), got 3"),
    ],
)
def test_bad_patterns_and_block_options_are_named_before_anything_is_written(overrides, message,
                                                                              tmp_path):
  workdir = tmp_path / "run"
  with pytest.raises(train.ConfigError, match=message):
    train.train_and_evaluate(
        train.load_config(None, ["data.name=mnist1d", *SMALL_DATA["mnist1d"], *PATTERN, *overrides]),
        workdir)
  assert not workdir.exists()


def test_mixed_precision_is_a_dtype_name_of_the_model_section():
  config = train.load_config("mnist1d_lru", ["model.dtype=bfloat16"])
  model = train.core.build_model(config.model, num_outputs=3, vocab_size=None)
  assert (model.dtype, model.param_dtype) == (jnp.bfloat16, jnp.float32)
  # As the layers' defaults are written: a model built from a config then hashes as the equal
  # model built in code or loaded from a checkpoint (one key of a cache or a static argument).
  assert {model.dtype, model.param_dtype} == {jnp.bfloat16, jnp.float32}
  assert hash(model.clone(dtype=jnp.bfloat16, param_dtype=jnp.float32)) == hash(model)
  assert train.core.build_model(_config().model, 3, None).dtype is None
  for override, key in [("model.dtype=int32", "model.dtype"), ("model.dtype=bfloat17", "model.dtype"),
                        ("model.param_dtype=bool", "model.param_dtype")]:
    with pytest.raises(train.ConfigError, match=rf"`{key}` must be a floating dtype name"):
      train.core.build_model(train.load_config("mnist1d_lru", [override]).model, 3, None)


def test_switching_between_a_layer_and_a_pattern_drops_the_old_arguments():
  config = train.load_config("mnist1d_lru", ["model.layer=[lru, attention]"])
  assert (config.model.layer, config.model.layer_kwargs) == (["lru", "attention"], {})
  config = train.load_config("mqar_hybrid", ["model.layer=lru"])
  assert (config.model.layer, config.model.layer_kwargs) == ("lru", {})


def test_optimizer_gives_ssm_parameters_their_learning_rate_and_no_weight_decay():
  config, shapes = _tiny_params("lru")
  params = jax.tree.map(lambda s: jnp.full(s.shape, 0.5, s.dtype), shapes)
  lr, ssm_lr, decay = 0.01, 0.001, 0.1
  config.optimizer.learning_rate, config.optimizer.ssm_learning_rate = lr, ssm_lr
  config.optimizer.weight_decay, config.optimizer.grad_clip = decay, None
  config.optimizer.warmup_steps = 0
  tx = train.supervised.make_optimizer(config.optimizer, "lru", total_steps=100)
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


def test_train_order_restarts_exactly_from_a_saved_position():
  order = TrainOrder(10, batch_size=3, seed=1)
  assert order.steps_per_epoch == 3  # the 10th example is dropped each epoch
  epoch = [next(order) for _ in range(3)]
  assert len(set(np.concatenate(epoch))) == 9
  for _ in range(2):
    next(order)
  position = order.state()
  expected = [next(order) for _ in range(5)]
  restored = TrainOrder(10, batch_size=3, seed=1)
  restored.restore(position)
  np.testing.assert_array_equal([next(restored) for _ in range(5)], expected)
  # A span of 2 steps in 4 rows: the next 2 batches, then zero rows.
  restored.restore(position)
  np.testing.assert_array_equal(restored.take(2, rows=4), [*expected[:2], [0] * 3, [0] * 3])
  np.testing.assert_array_equal(next(restored), expected[2])


def test_eval_batches_count_every_example_once():
  indices, valid = eval_indices(7, batch_size=3)
  assert indices.shape == valid.shape == (3, 3)
  np.testing.assert_array_equal(indices[valid], np.arange(7))
  np.testing.assert_array_equal(indices[~valid], [0, 0])  # padding repeats the first example


@pytest.mark.parametrize(
    "total, log_every, eval_every, checkpoint_every, start",
    [(10, 4, 3, 5, 0), (7, 50, 0, 500, 0), (11, 2, 0, 3, 5), (1, 1, 1, 1, 0),
     (2480, 50, 500, 500, 1000)],
)
def test_spans_end_at_every_step_that_logs_evaluates_or_saves(total, log_every, eval_every,
                                                             checkpoint_every, start):
  rhythm = train.core.Rhythm(total, log_every, eval_every, checkpoint_every)
  spans, step = [], start
  while step < total:
    spans.append(rhythm.span(step))
    step = spans[-1].end
  due = lambda every, s: (every and s % every == 0) or s == total
  ends = [s for s in range(start + 1, total + 1)
          if due(log_every, s) or due(eval_every, s) or due(checkpoint_every, s)]
  assert [span.end for span in spans] == ends
  assert [span.start for span in spans] == [start, *ends[:-1]]
  for span in spans:
    assert (span.log, span.evaluate, span.checkpoint, span.last) == (
        due(log_every, span.end), due(eval_every, span.end), due(checkpoint_every, span.end),
        span.end == total)
    assert 1 <= span.length <= rhythm.max_span


def test_a_span_runs_count_steps_of_a_step_traced_once():
  """`run_steps`: the first `count` of `size` rows are the steps' outputs in order, the rest
  zero, the state is `count` steps on; the step is traced once (its output shapes and the
  loop's body share one trace)."""
  traces = []

  def step(state, i):
    traces.append(i)
    return state * 2.0 + i.astype(state.dtype), {"before": state}

  run = jax.jit(lambda state, count: loop.run_steps(step, state, count, 5))
  state, outputs = run(jnp.ones(2), jnp.int32(3))
  np.testing.assert_array_equal(state, [12.0, 12.0])  # 2 s + i: 1 -> 2 -> 5 -> 12
  np.testing.assert_array_equal(outputs["before"][:, 0], [1.0, 2.0, 5.0, 0.0, 0.0])
  assert len(traces) == 1


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
    "mqar": ("data.kwargs={num_train: 64, num_test: 16, length: 16, num_pairs: 2, vocab_size: 16}",),
}
SMALL_MODEL = (
    "data.batch_size=16",
    "model.num_blocks=1",
    "model.features=16",
    "optimizer.warmup_steps=0",
    "optimizer.learning_rate=0.01",
    "optimizer.ssm_learning_rate=0.01",
    "train.steps=8",
    "train.log_every=1",
    "train.eval_every=0",
    "mesh.data=1",
)


# Trained end to end through the command line, tiny: one config of each dataset but MNIST-1D
# (mnist1d_lru's tiny variant is the run of the `uninterrupted` fixture below) and the layer
# patterns. Every other config is built and its training step traced, which finds a config
# that does not fit its data or its layers without compiling the step again for each layer
# (the layers train in test_layers and test_models).
TRAINED = {"mqar_hybrid", "sdigits_lru", "selective_copy_mamba"}


def _tiny_overrides(config) -> list[str]:
  pattern = isinstance(config.model.layer, list)
  overrides = [*SMALL_DATA[config.data.name], *SMALL_MODEL]
  for layer in train.core.layer_names(config.model):
    sized = {f.name for f in dataclasses.fields(LAYERS[layer].layer)} & {"d_state", "head_dim"}
    overrides += [f"model.layer_kwargs.{f'{layer}.' if pattern else ''}{option}=8" for option in sized]
  if pattern:  # one block of each layer
    overrides.append(f"model.num_blocks={len(config.model.layer)}")
  return overrides


@pytest.mark.parametrize("name", sorted(TRAINED))
def test_a_shipped_config_of_each_kind_trains_in_its_tiny_variant(name, tmp_path, capsys):
  with jax.enable_x64(False):
    assert cli.main(["train", name, "--workdir", str(tmp_path),
                     *_tiny_overrides(train.load_config(name))]) == 0
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert _last_line(capsys.readouterr().out) == f"test_accuracy={summary['test_accuracy']:.4f}"
  assert summary["steps"] == 8 and (tmp_path / "curves.png").exists()
  assert (tmp_path / "checkpoints" / "8").is_dir()
  records = metrics.read(tmp_path / "metrics.jsonl")
  assert records[-1]["loss"] < records[0]["loss"]


@pytest.mark.parametrize("name", sorted(set(train.shipped_configs("supervised")) - TRAINED))
def test_every_shipped_config_builds_and_traces_its_training_step(name):
  """Each shipped config's run is set up (its state traced, as the template of a restore: its
  initialisation compiles in the tiny runs of each kind) and its training step traces to the
  state's shapes."""
  config = train.load_config(name, _tiny_overrides(train.load_config(name)))
  with jax.enable_x64(False):
    run = supervised.setup(config, abstract=True)
    arrays = split_arrays(run.dataset, "train")
    step = functools.partial(supervised.train_steps, sharding=parallel.split(run.mesh))
    state, sums = jax.eval_shape(step, run.state, arrays, run.order.take(1, 1), np.int32(1),
                                 run.dropout_key)
  assert jax.tree.map(lambda a: (a.shape, a.dtype), state.params) == jax.tree.map(
      lambda a: (a.shape, a.dtype), run.state.params)
  assert sums["loss"].shape == (1,)  # one per step


# Training runs.


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One whole run, one step per call, with the compilations of `train_steps` counted."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  with jax.enable_x64(True), _compiles("train_steps") as compiles:
    summary = train.train_and_evaluate(_config(), workdir)
  return workdir, summary, compiles


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


def test_eval_command_evaluates_the_checkpoint_of_a_chosen_step(uninterrupted, capsys):
  workdir = uninterrupted[0]
  at_3 = next(r for r in metrics.read(workdir / "metrics.jsonl") if r["step"] == 3)
  assert cli.main(["eval", "--workdir", str(workdir), "--step", "3"]) == 0
  out = capsys.readouterr().out
  assert f"step=3 test_examples=40 test_loss={at_3['test_loss']:.4f}" in out
  assert _last_line(out) == f"test_accuracy={at_3['test_accuracy']:.4f}"
  assert cli.main(["eval", "--workdir", str(workdir), "--step", "4"]) == 2
  assert "no checkpoint of step 4" in capsys.readouterr().err


def test_load_gives_the_trained_model_its_variables_and_its_config(uninterrupted):
  workdir, summary, _ = uninterrupted
  model, variables, config = train.load(workdir)
  assert config == _config()
  assert set(variables) == {"params", "batch_stats"}  # the config's model has BatchNorm
  # Evaluation mode by default, on the dataset's own test features.
  dataset = data.load(config.data.name, **config.data.kwargs)
  logits = jax.jit(model.apply)(variables, dataset.x_test)
  assert logits.shape == (40, 10)
  assert np.mean(np.argmax(logits, axis=-1) == dataset.y_test) == pytest.approx(summary["test_accuracy"])


def test_a_run_in_spans_of_steps_computes_what_a_run_step_by_step_does(uninterrupted, tmp_path):
  """Logs every 4 steps: the steps run 3, 1 and 2 per jitted call (evaluations at 3 and 6).

  On CPU each step in a span does the same float32 operations in the same order as a step
  of its own, so the results are equal bit for bit; elsewhere to rounding.
  """
  with jax.enable_x64(True), _compiles("train_steps") as compiles:
    summary = train.train_and_evaluate(_config("train.log_every=4"), tmp_path)
  assert len(compiles) == 1  # one compilation for spans of every length
  by_step = metrics.read(uninterrupted[0] / "metrics.jsonl")
  records = metrics.read(tmp_path / "metrics.jsonl")
  assert [r["step"] for r in records] == [3, 4, 6]
  assert "loss" not in records[0] and records[0]["test_loss"] == by_step[2]["test_loss"]
  for record, steps in ((records[1], by_step[:4]), (records[2], by_step[4:])):
    # Every batch scores 16 examples: the mean over a log interval is the mean of the step means.
    np.testing.assert_allclose(record["loss"], np.mean([r["loss"] for r in steps]), rtol=1e-6)
  if jax.default_backend() == "cpu":
    jax.tree.map(np.testing.assert_array_equal, _final_state(tmp_path), _final_state(uninterrupted[0]))
    assert summary["test_loss"] == uninterrupted[1]["test_loss"]
  else:
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 _final_state(tmp_path), _final_state(uninterrupted[0]))


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


def test_resuming_with_another_length_of_the_cosine_schedule_is_refused(interrupted):
  """A longer run would stretch the cosine schedule and raise the decayed learning rate again."""
  workdir = interrupted["workdir"]
  files = {path: path.read_bytes() for path in workdir.rglob("*") if path.is_file()}
  for overrides in (["train.steps=12"], ["train.steps=null", "train.epochs=1"]):  # 10 steps an epoch
    message = (r"cosine learning-rate schedule reaches 0 after 6 steps; resuming it with (12|10) steps"
               r".*own `train.steps`.*in another workdir")
    with pytest.raises(train.ConfigError, match=message):
      train.train_and_evaluate(_config(*overrides), workdir)
  assert {path: path.read_bytes() for path in workdir.rglob("*") if path.is_file()} == files


def test_train_command_reports_config_errors(tmp_path, capsys):
  assert cli.main(["train", "mnist1d_lru", "--workdir", str(tmp_path), "model.featurs=3"]) == 2
  assert "model.featurs" in capsys.readouterr().err


def test_train_command_with_an_unknown_config_lists_the_shipped_ones(tmp_path, capsys):
  assert cli.main(["train", "nonexistent", "--workdir", str(tmp_path / "run")]) == 2
  err = capsys.readouterr().err
  assert "'nonexistent' is neither a file nor a shipped config" in err
  assert all(name in err for name in train.shipped_configs()) and "ssmkit configs" in err
  assert not (tmp_path / "run").exists()


def test_train_command_needs_a_config_and_no_overrides(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["train"])
  err = capsys.readouterr().err
  assert exit_.value.code == 2
  assert err.splitlines()[-1].endswith("the following arguments are required: config")


def test_configs_command_lists_every_shipped_config_with_its_task_and_description(capsys):
  assert cli.main(["configs"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert sorted(line.split()[0] for line in lines) == train.shipped_configs()
  for line in lines:
    name, task, description = line.split(maxsplit=2)
    assert name in train.shipped_configs(task)
    path = pathlib.Path(train.__file__).parents[1] / "configs" / f"{name}.yaml"
    assert path.read_text().splitlines()[0] == f"# {description}"


def test_version_flag_prints_the_version(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["--version"])
  assert exit_.value.code == 0
  assert capsys.readouterr().out.strip() == f"ssmkit {ssmkit.__version__}"


# The package itself.


def test_the_config_reference_in_the_docs_is_the_generated_one():
  text = (pathlib.Path(train.__file__).parents[2] / "docs" / "training.md").read_text()
  written = text.split(reference.BEGIN)[1].split(reference.END)[0]
  assert written.strip() == train.core.config_reference().strip(), (
      "docs/training.md is out of date: run `python -m ssmkit._src.train.reference docs/training.md`")


def _imports(path, package, modules):
  """The modules of `modules` that the module at `path` imports at its top level."""
  found = set()
  for node in ast.parse(path.read_text()).body:  # Imports under `if TYPE_CHECKING:` do not run.
    if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(package):
      for alias in node.names:
        submodule = f"{node.module}.{alias.name}"
        found.add(submodule if submodule in modules else node.module)
  return found & modules.keys()


def test_the_training_package_has_no_import_cycles():
  root = pathlib.Path(train.__file__).parents[1] / "_src" / "train"
  package = "ssmkit._src.train"
  modules = {}
  for path in root.rglob("*.py"):
    parts = path.relative_to(root).with_suffix("").parts
    modules[".".join((package, *parts)).removesuffix(".__init__")] = path
  graph = {name: _imports(path, package, modules) for name, path in modules.items()}
  assert graph["ssmkit._src.train.registry"]  # the graph sees the imports

  def visit(name, stack):
    assert name not in stack, f"import cycle: {' -> '.join([*stack, name])}"
    for imported in graph[name]:
      visit(imported, [*stack, name])

  for name in graph:
    visit(name, [])
