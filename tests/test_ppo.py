"""Tests of PPO with recurrent policies (ssmkit.train.ppo) and `ssmkit train` on PPO configs.

Training runs use the shipped ppo_memory_* configs made tiny by the `TINY` overrides (8
environments x 16 steps, MemoryChain with memory_length 3, a 1-block LRU of width 8, 4 updates).
A run takes seconds, nearly all of them compiling the update, which a persistent compilation
cache shares among the runs of one config; runs are shared through module-scoped fixtures. The
PPO pieces are checked against independent NumPy formulas and loops. The run split over 8
devices and the whole run it is compared with use the default backend's devices where it has
8, else the CPU's (`multi_device.on_host_devices`), so the two share a backend.
"""

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
from jax.experimental.compilation_cache import compilation_cache

import multi_device
from ssmkit import cli, train
from ssmkit._src.train.core import metrics
from ssmkit.train import ppo
from ssmkit.train.ppo import (
    advantages_and_targets,
    collect_rollout,
    create_ppo_state,
    init_actor,
    sequences,
)

UPDATES = 4
TINY = (
    "env.num_envs=8",
    "env.kwargs.memory_length=3",  # episodes of 4 steps: they cross the 16-step rollouts
    "ppo.rollout_steps=16",
    "ppo.epochs=2",
    "ppo.minibatches=2",
    "model.features=8",
    "model.layer_kwargs.d_state=4",
    f"train.updates={UPDATES}",
    "train.log_every=1",
    "train.eval_every=2",
    "train.eval_steps=16",
    "train.checkpoint_every=2",
    "mesh.data=1",  # one device: tests/test_data_parallel.py runs on all eight
)


@pytest.fixture(scope="module", autouse=True)
def _compilation_cache(tmp_path_factory):
  """A persistent compilation cache: the runs of one config compile their programs once."""
  options = {
      "jax_compilation_cache_dir": str(tmp_path_factory.mktemp("jax_cache")),
      "jax_persistent_cache_min_compile_time_secs": 0.0,
      "jax_persistent_cache_min_entry_size_bytes": 0,
  }
  before = {name: getattr(jax.config, name) for name in options}
  for name, value in options.items():
    jax.config.update(name, value)
  yield
  for name, value in before.items():
    jax.config.update(name, value)
  compilation_cache.reset_cache()


def _config(name="ppo_memory_lru", *overrides):
  return train.load_config(name, [*TINY, *overrides])


def _checkpoint(workdir, update=UPDATES):
  """The raw tree of a run's checkpoint: train_state, actor, key, update."""
  path = pathlib.Path(workdir, "checkpoints", str(update), "state").absolute()
  return ocp.StandardCheckpointer().restore(path)


def _last_line(text):
  return text.strip().splitlines()[-1]


def _train_command(name, workdir, *overrides):
  """`ssmkit train` in-process: (exit status, stdout)."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    status = cli.main(["train", name, "--workdir", str(workdir), *TINY, *overrides])
  return status, out.getvalue()


# Configs.


def test_ppo_configs_are_shipped_apart_from_the_other_kinds():
  assert train.shipped_configs("ppo") == ["ppo_memory_lru", "ppo_memory_mlp"]
  by_kind = [train.shipped_configs(kind) for kind in ("ppo", "supervised", "lm")]
  assert sorted(train.shipped_configs()) == sorted(name for names in by_kind for name in names)
  assert len(set(train.shipped_configs())) == sum(map(len, by_kind))


@pytest.mark.parametrize("name", train.shipped_configs("ppo"))
def test_every_ppo_config_loads_and_comments_every_field(name):
  config = train.load_config(name)
  assert isinstance(config, ppo.PPOConfig)
  assert config.env.name == "MemoryChain-bsuite"
  assert config.model.recurrent == (name == "ppo_memory_lru")
  path = pathlib.Path(train.__file__).parents[1] / "configs" / f"{name}.yaml"
  for line in path.read_text().splitlines():
    key, _, value = line.partition(":")
    if not line.lstrip().startswith("#") and value.split("#")[0].strip():  # a field, not a section
      assert "#" in value, f"{name}.yaml: field {key.strip()!r} has no comment"


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["ppo.gama=0.9"], "ppo.gama"),
        (["env.num_env=4"], "env.num_env"),
        (["enw.name=x"], "enw"),
        (["env.num_envs=many"], "env.num_envs"),
        (["ppo.gamma=1.5"], "ppo.gamma"),
        (["ppo.clip_eps=0"], "ppo.clip_eps"),
        (["ppo.minibatches=3"], "ppo.minibatches"),
        (["model.norm=batch"], "model.norm"),
        (["model.pooling=mean"], "model.pooling"),
        (["model.dropout_rate=0.1"], "model.dropout_rate"),
        (["train.updates=0"], "train.updates"),
        (["ppo.epochs"], "ppo.epochs"),  # no "="
    ],
)
def test_bad_overrides_raise_errors_naming_the_key(overrides, key):
  with pytest.raises(train.ConfigError, match=key):
    train.load_config("ppo_memory_lru", overrides)


def test_the_declared_task_picks_the_schema_and_env_name_is_mandatory(tmp_path):
  assert isinstance(train.load_config(None, ["task=ppo", "env.name=MemoryChain-bsuite"]), ppo.PPOConfig)
  with pytest.raises(train.ConfigError, match=r"env\.name"):
    train.load_config(None, ["task=ppo", "ppo.gamma=0.9"])
  path = tmp_path / "bad.yaml"
  path.write_text("task: ppo\nenv:\n  name: MemoryChain-bsuite\nmodel:\n  num_block: 3\n")
  with pytest.raises(train.ConfigError, match=r"model\.num_block"):
    train.load_config(path)


@pytest.mark.parametrize("overrides", [["env.name=MemoryChain-bsuite"], ["ppo.gamma=0.9"]])
def test_a_ppo_section_without_the_task_says_which_task_to_declare(overrides):
  with pytest.raises(train.ConfigError, match=r"section of `task: ppo` configs.*declare `task: ppo`"):
    train.load_config(None, overrides)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["env.kwargs.memory_lenght=5"], r"env\.kwargs\.memory_lenght"),
        (["env.name=NoSuchEnv-v0"], r"env\.name"),
        (["model.layer_kwargs.d_stat=4"], r"model\.layer_kwargs\.d_stat"),
    ],
)
def test_config_errors_found_when_building_the_run_name_the_key(overrides, key, tmp_path):
  with pytest.raises(train.ConfigError, match=key):
    train.train_and_evaluate(_config("ppo_memory_lru", *overrides), tmp_path)
  assert not any(tmp_path.iterdir())  # found before anything is written


def test_train_command_reports_config_errors(tmp_path, capsys):
  assert cli.main(["train", "ppo_memory_lru", "--workdir", str(tmp_path), "ppo.clip_ep=0.1"]) == 2
  assert "ppo.clip_ep" in capsys.readouterr().err


# The PPO pieces against independent references.


def _numpy_ppo_loss(logits, values, action, old_log_prob, old_value, advantage, target, hp):
  logits, values = np.float64(logits), np.float64(values)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  log_prob = np.take_along_axis(log_probs, action[..., None], -1)[..., 0]
  ratio = np.exp(log_prob - old_log_prob)
  if hp.normalize_advantages:
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
  clipped_ratio = np.clip(ratio, 1 - hp.clip_eps, 1 + hp.clip_eps)
  policy_loss = -np.mean(np.minimum(ratio * advantage, clipped_ratio * advantage))
  value_error = (values - target) ** 2
  if hp.clip_value:
    clipped = old_value + np.clip(values - old_value, -hp.clip_eps, hp.clip_eps)
    value_error = np.maximum(value_error, (clipped - target) ** 2)
  value_loss = 0.5 * value_error.mean()
  entropy = -np.mean(np.sum(np.exp(log_probs) * log_probs, -1))
  return policy_loss + hp.vf_coef * value_loss - hp.ent_coef * entropy, {
      "policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy,
      "approx_kl": np.mean(ratio - 1 - np.log(ratio)),
  }


@pytest.mark.parametrize("clip_value, normalize", [(True, True), (False, False)])
def test_ppo_loss_matches_the_clipped_objective_in_numpy(clip_value, normalize):
  hp = ppo.PPOHyperparameters(clip_eps=0.2, vf_coef=0.7, ent_coef=0.05, clip_value=clip_value,
                                normalize_advantages=normalize)
  rng = np.random.default_rng(0)
  shape = (6, 9)
  logits = rng.normal(size=(*shape, 3)).astype(np.float32)
  action = rng.integers(0, 3, size=shape).astype(np.int32)
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  # Old log-probabilities 0.5 away on average: many ratios fall outside [0.8, 1.2].
  old_log_prob = (np.take_along_axis(log_probs, action[..., None], -1)[..., 0]
                  + rng.normal(scale=0.5, size=shape)).astype(np.float32)
  values, old_value, advantage, target = (rng.normal(size=shape).astype(np.float32) for _ in range(4))
  loss, got = jax.jit(functools.partial(ppo.ppo_loss, hp=hp))(
      logits, values, action, old_log_prob, old_value, advantage, target)
  expected_loss, expected = _numpy_ppo_loss(
      logits, values, action, old_log_prob, old_value, advantage, target, hp)
  assert 0.1 < got["clip_fraction"] < 0.9  # both branches of the clipping are exercised
  np.testing.assert_allclose(loss, expected_loss, rtol=1e-5, atol=1e-6)
  for key, value in expected.items():
    np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def _numpy_gae(rollout, gamma, lambda_):
  """A float64 loop over time, episode ends included: termination and truncation."""
  r, v = np.float64(rollout.reward), np.float64(rollout.value)
  terminated, truncated = np.asarray(rollout.terminated), np.asarray(rollout.truncated)
  next_v = np.concatenate([v[1:], np.float64(rollout.last_value)[None]])
  next_v = np.where(truncated, np.float64(rollout.final_value), next_v)
  advantages, running = np.zeros_like(r), np.zeros_like(r[0])
  for t in reversed(range(len(r))):
    discount = gamma * (1 - terminated[t])
    delta = r[t] + discount * next_v[t] - v[t]
    running = delta + discount * lambda_ * (1 - truncated[t]) * running
    advantages[t] = running
  return advantages


ROLLOUT_STEPS = 10  # not a multiple of the 4-step episodes: the second rollout starts mid-episode


def _two_rollouts(agent, env, params, actor):
  """Two consecutive rollouts of `ROLLOUT_STEPS` steps from `actor`."""
  collect = jax.jit(functools.partial(collect_rollout, agent, env, num_steps=ROLLOUT_STEPS))
  actor, first = collect(params, actor, jax.random.key(1))
  _, second = collect(params, actor, jax.random.key(2))
  return first, second


@pytest.fixture(scope="module")
def tiny():
  """The tiny recurrent config's environments, policy, initial state and two rollouts."""
  config = _config()
  env = ppo.make_env(config.env)
  agent = ppo.make_agent(config.model, env)
  tx, _ = ppo.make_optimizer(config.ppo, config.train.updates)
  state = create_ppo_state(agent, env, tx, jax.random.key(0))
  params = state.train_state.params
  return {"config": config, "env": env, "agent": agent, "params": params,
          "rollouts": _two_rollouts(agent, env, params, state.actor)}


def test_rollouts_record_episode_starts_returns_and_the_context(tiny):
  for rollout in tiny["rollouts"]:
    done = np.asarray(rollout.terminated)
    np.testing.assert_array_equal(rollout.first[1:], done[:-1])
    assert set(np.abs(np.asarray(rollout.episode_return)[done])) == {1.0}
    assert np.all(np.asarray(rollout.reward)[~done] == 0)
    assert np.all(np.abs(np.asarray(rollout.obs)[..., 2][np.asarray(rollout.first)]) == 1)
  first, second = tiny["rollouts"]
  assert first.first[0].all() and not second.first[0].any()
  assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(first.initial_state))


@pytest.mark.parametrize("max_steps", [1000, 3])  # episodes terminate after 4 steps, or are cut at 3
def test_advantages_equal_a_float64_gae_loop_over_episode_ends(max_steps, tiny):
  config, agent, params, (_, rollout) = tiny["config"], tiny["agent"], tiny["params"], tiny["rollouts"]
  if max_steps == 3:
    env = ppo.make_env(_config("ppo_memory_lru", f"env.kwargs.max_steps_in_episode={max_steps}").env)
    _, rollout = _two_rollouts(agent, env, params, init_actor(agent, env, jax.random.key(0)))
  assert (rollout.truncated if max_steps == 3 else rollout.terminated).any()
  assert not (rollout.truncated & rollout.terminated).any()
  if max_steps == 3:
    assert np.all(rollout.final_value[rollout.truncated] != 0)
  advantages, targets = advantages_and_targets(rollout, config.ppo.gamma, config.ppo.gae_lambda)
  expected = _numpy_gae(rollout, config.ppo.gamma, config.ppo.gae_lambda)
  np.testing.assert_allclose(advantages, expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(targets, expected + rollout.value, rtol=1e-5, atol=1e-6)
  # The update trains on these, batch-first.
  data = sequences(rollout, config.ppo)
  np.testing.assert_allclose(data.advantage, expected.T, rtol=1e-5, atol=1e-6)


def test_sequence_rerun_from_the_stored_state_reproduces_the_rollout(tiny):
  """The update's view of a rollout (whole sequences, resets, initial state) is the acting one.

  The second of two rollouts starts in the middle of episodes, from a nonzero recurrent state.
  """
  agent, params, (_, rollout) = tiny["agent"], tiny["params"], tiny["rollouts"]
  batch_first = lambda x: jnp.swapaxes(x, 0, 1)
  obs, first = batch_first(rollout.obs), batch_first(rollout.first)
  sequence = jax.jit(agent.sequence)
  logits, values = sequence(params, rollout.initial_state, obs, first)
  np.testing.assert_allclose(logits, batch_first(rollout.logits), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(values, batch_first(rollout.value), rtol=1e-5, atol=1e-5)
  # The stored state matters: from a zero state the outputs before the first reset differ.
  zero = jax.tree.map(jnp.zeros_like, rollout.initial_state)
  from_zero, _ = sequence(params, zero, obs, first)
  assert np.abs(from_zero - logits).max() > 1e-4
  # A minibatch of environments takes its rows of the state too.
  index = np.array([5, 2, 7, 0])
  rows = jax.tree.map(lambda x: jnp.take(x, index, axis=agent.state_batch_axis), rollout.initial_state)
  part, _ = sequence(params, rows, obs[index], first[index])
  np.testing.assert_allclose(part, logits[index], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["lru", "mamba"])
@pytest.mark.parametrize("scan_blocks", [False, True])
def test_state_batch_axis_is_the_environment_axis_of_every_state_leaf(layer, scan_blocks):
  config = train.load_config(None, [
      "task=ppo", "env.name=MemoryChain-bsuite", f"model.layer={layer}", "model.layer_kwargs.d_state=4",
      "model.features=8", "model.num_blocks=3", f"model.scan_blocks={scan_blocks}"])
  agent = ppo.make_agent(config.model, ppo.make_env(config.env))
  state = jax.eval_shape(lambda: agent.initialize_state(5, 3))
  assert {leaf.shape[agent.state_batch_axis] for leaf in jax.tree.leaves(state)} == {5}
  assert {leaf.shape[0] for leaf in jax.tree.leaves(state)} == ({3} if scan_blocks else {5})


def test_feed_forward_policy_acts_on_the_current_observation_only(tiny):
  """The same network with `recurrent=False` maps every observation alone, in sequence mode too."""
  agent = dataclasses.replace(tiny["agent"], recurrent=False)
  params, (_, rollout) = tiny["params"], tiny["rollouts"]
  logits, values = jax.jit(agent.sequence)(
      params, rollout.initial_state, jnp.swapaxes(rollout.obs, 0, 1), jnp.swapaxes(rollout.first, 0, 1))
  obs = rollout.obs.reshape(-1, rollout.obs.shape[-1])  # (T * B, F): every step its own batch row
  zero = agent.initialize_state(obs.shape[0], obs.shape[1])
  _, alone, alone_values = jax.jit(agent.step)(params, zero, obs, jnp.zeros(obs.shape[:1], bool))
  time_first = lambda x: jnp.swapaxes(x, 0, 1).reshape(-1, *x.shape[2:])
  np.testing.assert_allclose(time_first(logits), alone, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(time_first(values), alone_values, rtol=1e-5, atol=1e-6)


# Training runs.


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """One whole run of the tiny recurrent config through `ssmkit train`, compilations counted."""
  workdir = tmp_path_factory.mktemp("uninterrupted")
  compiles = []
  handler = logging.Handler()
  handler.emit = lambda record: compiles.append(record.getMessage())
  logger = logging.getLogger("jax")
  logger.addHandler(handler)
  try:
    with multi_device.on_host_devices(), jax.enable_x64(True), jax.log_compiles():
      status, out = _train_command("ppo_memory_lru", workdir)
  finally:
    logger.removeHandler(handler)
  return {"workdir": workdir, "status": status, "out": out,
          "update_compiles": [m for m in compiles if m.startswith("Compiling jit(ppo_updates)")]}


def _check_run_outputs(workdir, out):
  summary = json.loads((workdir / "summary.json").read_text())
  assert _last_line(out) == f"mean_episode_return={summary['mean_episode_return']:.4f}"
  assert summary["updates"] == UPDATES and summary["steps"] == UPDATES * 8 * 16
  assert summary["params"] > 0 and summary["wall_seconds"] > 0
  assert summary["config"]["train"]["updates"] == UPDATES
  assert -1 <= summary["mean_episode_return"] <= 1 and summary["eval_episodes"] == 8 * 4
  records = metrics.read(workdir / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, UPDATES + 1))
  for record in records:
    assert {"env_steps", "mean_episode_return", "policy_loss", "value_loss", "entropy", "approx_kl",
            "learning_rate", "env_steps_per_second"} <= record.keys()
  assert [r["step"] for r in records if "eval_mean_episode_return" in r] == [2, 4]
  assert records[-1]["eval_mean_episode_return"] == summary["mean_episode_return"]
  assert (workdir / "curves.png").read_bytes().startswith(b"\x89PNG")
  assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["2", "4"]


def test_recurrent_run_writes_metrics_summary_curves_and_checkpoints(uninterrupted):
  assert uninterrupted["status"] == 0
  _check_run_outputs(uninterrupted["workdir"], uninterrupted["out"])
  assert train.load_config(uninterrupted["workdir"] / "config.yaml") == _config()


def test_feed_forward_run_writes_metrics_summary_curves_and_checkpoints(tmp_path):
  status, out = _train_command("ppo_memory_mlp", tmp_path)
  assert status == 0
  _check_run_outputs(tmp_path, out)


def test_update_compiles_once_and_params_stay_float32(uninterrupted):
  assert len(uninterrupted["update_compiles"]) == 1
  params = _checkpoint(uninterrupted["workdir"])["train_state"]["params"]
  assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(np.float32)}


def test_eval_command_reproduces_the_final_evaluation(uninterrupted, capsys):
  summary = json.loads((uninterrupted["workdir"] / "summary.json").read_text())
  assert cli.main(["eval", "--workdir", str(uninterrupted["workdir"])]) == 0
  out = capsys.readouterr().out
  assert f"step={UPDATES} episodes={summary['eval_episodes']}" in out
  assert _last_line(out) == f"mean_episode_return={summary['mean_episode_return']:.4f}"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
  """A run on 8 devices (data=2, fsdp=4) stopped by SIGINT after update 3, resumed on 1 device
  from update 2.

  The environments are split over the 8 devices and the parameters and optimizer state sharded
  over 4 of them, so a resumed run that continues the one-device trajectory also shows that
  the sharded run computes what one device does.
  """
  workdir = tmp_path_factory.mktemp("interrupted")
  handler_before = signal.getsignal(signal.SIGINT)

  def send_sigint(update):
    if update == 3:
      signal.raise_signal(signal.SIGINT)

  with multi_device.on_host_devices(), jax.enable_x64(True):
    with pytest.raises(train.Interrupted) as stop:
      train.train_and_evaluate(_config("ppo_memory_lru", "mesh.data=2", "mesh.fsdp=4"), workdir,
                               hooks=[send_sigint])
    after_stop = {
        "handler": signal.getsignal(signal.SIGINT),
        "checkpoints": sorted(p.name for p in (workdir / "checkpoints").iterdir()),
        "steps": [r["step"] for r in metrics.read(workdir / "metrics.jsonl")],
    }
    # As if the process had died before saving update 3: the run resumes from update 2.
    shutil.rmtree(workdir / "checkpoints" / "3")
    status, out = _train_command("ppo_memory_lru", workdir)
  return {"workdir": workdir, "stop": stop.value, "handler_before": handler_before,
          "after_stop": after_stop, "status": status, "out": out}


def test_sigint_saves_a_checkpoint_and_stops_at_the_update_boundary(interrupted):
  stop, after_stop = interrupted["stop"], interrupted["after_stop"]
  assert stop.signal_name == "SIGINT" and stop.step == 3
  assert after_stop["checkpoints"] == ["2", "3"]
  assert after_stop["steps"] == [1, 2, 3]
  assert after_stop["handler"] is interrupted["handler_before"]


def test_resumed_run_continues_the_same_trajectory(interrupted, uninterrupted):
  workdir = interrupted["workdir"]
  assert interrupted["status"] == 0
  assert "resuming from update 2" in interrupted["out"]
  resumed, whole = _checkpoint(workdir), _checkpoint(uninterrupted["workdir"])
  assert int(resumed["update"]) == int(whole["update"]) == UPDATES
  np.testing.assert_array_equal(resumed["key"], whole["key"])
  # Environments, observations and episode bookkeeping restored exactly; parameters, optimizer
  # and recurrent state up to a different XLA fusion of the recompiled update.
  for key in ("env_state", "obs", "first", "episode_return"):
    jax.tree.map(np.testing.assert_array_equal, resumed["actor"][key], whole["actor"][key])
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  jax.tree.map(close, resumed["actor"]["policy_state"], whole["actor"]["policy_state"])
  for key in ("params", "opt_state"):
    jax.tree.map(close, resumed["train_state"][key], whole["train_state"][key])
  records = metrics.read(workdir / "metrics.jsonl")
  assert [r["step"] for r in records] == list(range(1, UPDATES + 1))
  _check_run_outputs(workdir, interrupted["out"])


def test_workdir_of_another_task_kind_is_refused_before_anything_is_written(uninterrupted):
  workdir = uninterrupted["workdir"]
  files = {path: path.read_bytes() for path in workdir.rglob("*") if path.is_file()}
  config = train.load_config("mnist1d_lru", ["data.kwargs.num_samples=200", "mesh.data=1"])
  with pytest.raises(train.ConfigError, match="holds a run of another kind than 'supervised'"):
    train.train_and_evaluate(config, workdir)
  assert {path: path.read_bytes() for path in workdir.rglob("*") if path.is_file()} == files


def test_load_gives_the_policy_network_its_parameters_and_its_config(uninterrupted):
  model, variables, config = train.load(uninterrupted["workdir"])
  assert config == _config() and set(variables) == {"params"}
  params = _checkpoint(uninterrupted["workdir"])["train_state"]["params"]
  jax.tree.map(np.testing.assert_array_equal, variables["params"], params)
  obs = jnp.zeros((2, 5, 3), jnp.float32)  # MemoryChain observations: 3 features
  assert model.apply(variables, obs, None, jnp.ones((2, 5), bool)).shape == (2, 5, 3)  # 2 logits, value


def test_workdir_of_another_policy_is_refused(interrupted):
  with pytest.raises(train.ConfigError, match=r"model\.features"):
    train.train_and_evaluate(_config("ppo_memory_lru", "model.features=16"), interrupted["workdir"])
