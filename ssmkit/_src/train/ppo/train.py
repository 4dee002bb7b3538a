"""`train_ppo` and `evaluate_ppo`: a PPO run on a gymnax environment in a workdir, resumable.

A workdir holds what a supervised run's does: `config.yaml`, `checkpoints/`, `metrics.jsonl`
(one record per logged update), `summary.json` and `curves.png` (episode return against
environment steps). A checkpoint holds the whole `PPOState` (parameters, optimizer state, the
environments' states, the recurrent state and the PRNG key), so a resumed run continues the same
trajectory as an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh
from matplotlib.figure import Figure

from ssmkit._src.train import metrics, parallel
from ssmkit._src.train.checkpoint import Checkpoints
from ssmkit._src.train.config import to_dict
from ssmkit._src.train.errors import ConfigError, Interrupted
from ssmkit._src.train.interrupt import stop_requests
from ssmkit._src.train.model import build_model, count_parameters
from ssmkit._src.train.ppo import (
  Agent,
  PPOState,
  VecEnv,
  create_ppo_state,
  evaluate_policy,
  ppo_update,
)
from ssmkit._src.train.ppo_config import EnvConfig, PolicyConfig, PPOConfig, PPOHyperparameters, validate
from ssmkit._src.train.workdir import (
  CURVES_FILE,
  METRICS_FILE,
  SUMMARY_FILE,
  restore_latest,
  start_or_resume,
)

# Metrics of `ppo_update` averaged over the updates of a log interval.
_LOSS_METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")


def make_env(config: EnvConfig) -> VecEnv:
  """The vectorised gymnax environment of the `env` section.

  Raises:
    ConfigError: for an unknown environment, a key of `env.kwargs` that is neither an argument of
      the environment class nor a field of its EnvParams, or an action space that is not discrete.
  """
  # Imported on use: importing gymnax takes seconds (it loads seaborn and pandas), which
  # `import ssmkit.train` for supervised training should not pay.
  import gymnax

  if config.name not in gymnax.registered_envs:
    raise ConfigError(
        f"`env.name` must be a gymnax environment, one of {', '.join(gymnax.registered_envs)}; "
        f"got {config.name!r}."
    )
  env, params = gymnax.make(config.name)
  fields = {field.name for field in dataclasses.fields(params)}
  arguments = set(inspect.signature(type(env)).parameters)
  for key in config.kwargs:
    if key not in fields | arguments:
      raise ConfigError(
          f"`env.kwargs.{key}` is neither an argument of {type(env).__name__} "
          f"({', '.join(sorted(arguments)) or 'none'}) nor a field of its EnvParams "
          f"({', '.join(sorted(fields))})."
      )
  env_kwargs = {key: value for key, value in config.kwargs.items() if key in arguments}
  if env_kwargs:
    env, params = gymnax.make(config.name, **env_kwargs)
  params = params.replace(**{key: value for key, value in config.kwargs.items() if key in fields})
  if not hasattr(env.action_space(params), "n"):
    raise ConfigError(f"`env.name`={config.name!r} has a continuous action space; PPO here needs a "
                      "discrete one.")
  return VecEnv(env, params, config.num_envs)


def make_agent(config: PolicyConfig, env: VecEnv) -> Agent:
  """The actor-critic of the `model` section for `env`'s actions."""
  model = build_model(config, env.num_actions + 1, None)
  return Agent(model, env.num_actions, recurrent=config.recurrent, mode=config.mode)


def make_ppo_optimizer(hp: PPOHyperparameters, updates: int
                       ) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """Adam (eps 1e-5) after global-norm clipping, with a constant or linearly annealed learning rate.

  Args:
    hp: the `ppo` section of the config.
    updates: the number of updates of the run, each `hp.epochs * hp.minibatches` optimizer steps.

  Returns:
    `(optimizer, schedule)`, the schedule a function of the optimizer step.
  """
  if hp.anneal:
    schedule = optax.linear_schedule(hp.learning_rate, 0.0, updates * hp.epochs * hp.minibatches)
  else:
    schedule = optax.constant_schedule(hp.learning_rate)
  tx = optax.adam(schedule, eps=1e-5)
  if hp.grad_clip is not None:
    tx = optax.chain(optax.clip_by_global_norm(hp.grad_clip), tx)
  return tx, schedule


@dataclasses.dataclass
class _Run:
  """What a config builds: the environments, the devices, the policy, the initial state and the jitted
  steps."""

  env: VecEnv
  mesh: Mesh
  agent: Agent
  state: PPOState
  schedule: optax.Schedule
  update: Callable[[PPOState], tuple[PPOState, dict[str, jax.Array]]]
  evaluate: Callable[[Any], dict[str, float]]


def _setup(config: PPOConfig) -> _Run:
  env = make_env(config.env)
  agent = make_agent(config.model, env)
  tx, schedule = make_ppo_optimizer(config.ppo, config.train.updates)
  key = jax.random.key(config.train.seed)
  mesh = parallel.data_mesh(config.mesh, config.env.num_envs, "env.num_envs")
  replicated, split = parallel.replicated(mesh), parallel.split(mesh)
  # The environments, and all that goes with them, are split over the devices.
  shardings = PPOState(train_state=replicated, actor=split, key=replicated, update=replicated)
  state = jax.tree.map(lambda sharding, part: parallel.place(part, sharding), shardings,
                       create_ppo_state(agent, env, tx, key))
  evaluate_fn = jax.jit(functools.partial(
      evaluate_policy, agent, env, num_steps=config.train.eval_steps, greedy=config.train.eval_greedy
  ), out_shardings=replicated)
  # Every evaluation plays the same episodes, so evaluations of a run compare like with like.
  eval_key = parallel.place(jax.random.fold_in(key, 1), replicated)

  def evaluate(params: Any) -> dict[str, float]:
    return_sum, episodes = jax.device_get(evaluate_fn(params, eval_key))
    return {"eval_mean_episode_return": _mean(return_sum, episodes), "eval_episodes": int(episodes)}

  return _Run(
      env=env,
      mesh=mesh,
      agent=agent,
      state=state,
      schedule=schedule,
      update=jax.jit(functools.partial(ppo_update, agent, env, config.ppo),
                     out_shardings=(shardings, replicated)),
      evaluate=evaluate,
  )


def _mean(total: float, count: float) -> float | None:
  return float(total) / float(count) if count else None


def train_ppo(config: PPOConfig, workdir: str | pathlib.Path, *,
              hooks: Sequence[Callable[[int], None]] = ()) -> dict[str, Any]:
  """Trains the policy of `config` with PPO in `workdir`, then evaluates it.

  Logs metrics every `train.log_every` updates and evaluates every `train.eval_every` updates and
  after the last one (to `metrics.jsonl`); saves a checkpoint every `train.checkpoint_every`
  updates, after the last one and on SIGINT/SIGTERM (then raises `Interrupted`). A workdir with
  checkpoints resumes from the latest one, dropping the metrics logged after it. At the end writes
  `summary.json` and `curves.png`.

  Args:
    config: the run's config, e.g. from `load_config` of a file with an `env` section.
    workdir: the run's directory; created if needed.
    hooks: functions called with the update number after every update.

  The records of `metrics.jsonl` have "step" (the update), "env_steps", the train metrics
  ("mean_episode_return" of the episodes that ended since the previous record, "policy_loss",
  "value_loss", "entropy", "approx_kl", "clip_fraction", "learning_rate",
  "env_steps_per_second") and, at evaluations, "eval_mean_episode_return" and "eval_episodes".

  Returns:
    The summary: "mean_episode_return" (of the final evaluation), "eval_episodes",
    "train_mean_episode_return" (over the last log interval), "steps" (environment steps),
    "updates", "wall_seconds" (over all sessions of the run), "params" and "config".

  Raises:
    ConfigError: for a config with values out of range or that does not fit the environment,
      or a workdir holding another run.
    Interrupted: after saving a checkpoint on SIGINT or SIGTERM.
  """
  validate(config)
  return start_or_resume(
      config, workdir, sections=("env", "model"), setup=_setup,
      train=lambda workdir, run, state, checkpoints, wall_seconds: _train(
          config, workdir, run, state, checkpoints, hooks, wall_seconds),
  )


def _log_record(config: PPOConfig, run: _Run, update: int, pending: list[dict[str, Any]],
                seconds: float) -> dict[str, Any]:
  """The metrics of the `len(pending)` updates up to `update`, which took `seconds`."""
  steps_per_update = config.env.num_envs * config.ppo.rollout_steps
  episodes = sum(float(m["episodes"]) for m in pending)
  optimizer_steps = config.ppo.epochs * config.ppo.minibatches
  return {
      "env_steps": update * steps_per_update,
      "mean_episode_return": _mean(sum(float(m["episode_return_sum"]) for m in pending), episodes),
      "episodes": int(episodes),
      **{key: float(np.mean([m[key] for m in pending])) for key in _LOSS_METRICS},
      "learning_rate": float(run.schedule(update * optimizer_steps - 1)),
      "env_steps_per_second": len(pending) * steps_per_update / seconds,
  }


def _line(update: int, values: dict[str, Any]) -> str:
  shown = (f"{key}={value:.4f}" for key, value in values.items() if isinstance(value, float))
  return f"update {update}: " + " ".join(shown)


def _train(config: PPOConfig, workdir: pathlib.Path, run: _Run, state: PPOState,
           checkpoints: Checkpoints, hooks: Sequence[Callable[[int], None]],
           wall_seconds: Callable[[], float]) -> dict[str, Any]:
  """The update loop from `state` to `train.updates`, then the summary."""
  total = config.train.updates
  metrics_path = workdir / METRICS_FILE
  update = int(state.update)
  metrics.truncate(metrics_path, update)
  num_params = count_parameters(state.train_state.params)
  steps_per_update = config.env.num_envs * config.ppo.rollout_steps
  bar, write = metrics.console(total, update, "ppo", "update")
  write(
      f"{'recurrent' if run.agent.recurrent else 'feed-forward'} {config.model.layer} policy with "
      f"{num_params:,} parameters on {config.env.name}, {total} updates of {config.env.num_envs} x "
      f"{config.ppo.rollout_steps} steps on {run.mesh.size} {run.mesh.devices.flat[0].platform} "
      "device(s)" + (f", resuming from update {update}" if update else "")
  )
  evaluation, train_return = None, None
  pending, log_time = [], time.perf_counter()
  with stop_requests() as stop, bar:
    while update < total:
      state, update_metrics = run.update(state)
      update += 1
      pending.append(update_metrics)
      bar.update()
      last = update == total
      record: dict[str, Any] = {}
      if update % config.train.log_every == 0 or last:
        pending = jax.device_get(pending)  # Waits for the updates, so `now` is when they ended.
        now = time.perf_counter()
        record.update(_log_record(config, run, update, pending, now - log_time))
        train_return = record["mean_episode_return"]
        if train_return is not None:
          bar.set_postfix(episode_return=f"{train_return:.3f}")
        if bar.disable:
          write(_line(update, record))
        pending, log_time = [], now
      if (config.train.eval_every and update % config.train.eval_every == 0) or last:
        evaluation = run.evaluate(state.train_state.params)
        record.update(evaluation, env_steps=update * steps_per_update)
        write(_line(update, evaluation))
        log_time = time.perf_counter()  # Throughput counts training only.
      if record:
        metrics.append(metrics_path, {"step": update, **record})
      for hook in hooks:
        hook(update)
      stopping = bool(stop) and not last
      if update % config.train.checkpoint_every == 0 or last or stopping:
        checkpoints.save(update, state, {"wall_seconds": wall_seconds()})
      if stopping:
        raise Interrupted(stop.signal_name, update, str(workdir))
  records = metrics.read(metrics_path)
  if evaluation is None:  # The run had already reached its last update.
    evaluation = run.evaluate(state.train_state.params)
    write(_line(update, evaluation))
    train_return = next((r["mean_episode_return"] for r in reversed(records)
                         if "mean_episode_return" in r), None)
  summary = {
      "mean_episode_return": evaluation["eval_mean_episode_return"],
      "eval_episodes": evaluation["eval_episodes"],
      "train_mean_episode_return": train_return,
      "steps": update * steps_per_update,
      "updates": update,
      "wall_seconds": wall_seconds(),
      "params": num_params,
      "config": to_dict(config),
  }
  metrics.write_summary(workdir / SUMMARY_FILE, summary)
  plot_returns(records, workdir / CURVES_FILE)
  return summary


@metrics.primary_only
def plot_returns(records: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
  """Plots episode returns and the PPO losses against environment steps into a PNG file.

  Args:
    records: `metrics.jsonl` records of `train_ppo`.
    path: the image file to write.
  """
  figure = Figure(figsize=(10, 4), layout="constrained")
  returns, losses = figure.subplots(1, 2)
  curves = (
      (returns, "mean_episode_return", "train (sampled actions)"),
      (returns, "eval_mean_episode_return", "evaluation"),
      (losses, "policy_loss", "policy loss"),
      (losses, "value_loss", "value loss"),
      (losses, "entropy", "entropy"),
  )
  for axes, key, label in curves:
    points = [(r["env_steps"], r[key]) for r in records if r.get(key) is not None]
    if points:
      steps, values = zip(*points, strict=True)
      axes.plot(steps, values, marker="o" if len(points) == 1 else None, label=label)
  for axes, name in ((returns, "episode return"), (losses, "loss")):
    axes.set_xlabel("environment steps")
    axes.set_ylabel(name)
    axes.grid(alpha=0.3)
    if axes.lines:
      axes.legend()
  figure.savefig(path, dpi=100)


def evaluate_ppo(workdir: str | pathlib.Path) -> dict[str, Any]:
  """Evaluates the latest checkpoint of a `train_ppo` workdir as the run's final evaluation does.

  Args:
    workdir: the run's directory.

  Returns:
    {"step": the checkpoint's update, "mean_episode_return", "episodes"}.

  Raises:
    FileNotFoundError: if `workdir` has no config or no checkpoint.
    ConfigError: if `workdir` holds another kind of run.
  """
  step, run, state = restore_latest(workdir, PPOConfig, _setup)
  evaluation = run.evaluate(state.train_state.params)
  return {"step": step, "mean_episode_return": evaluation["eval_mean_episode_return"],
          "episodes": evaluation["eval_episodes"]}

