"""PPO in a workdir: `train_and_evaluate`, `evaluate` and `load` for configs of `task: ppo`.

A workdir holds what a supervised run's does: `config.yaml`, `checkpoints/`, `metrics.jsonl`
(one record per logged update), `summary.json` and `curves.png` (episode return and losses
against environment steps). A checkpoint holds the whole `PPOState` (parameters, optimizer state,
the environments' states, the recurrent state and the PRNG key), so a resumed run continues the
same trajectory as an uninterrupted one.
"""

from __future__ import annotations

import functools
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from ssmkit import layers
from ssmkit._src.train.core import metrics, parallel, schema
from ssmkit._src.train.core import workdir as workdirs
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.loop import Loop, Rhythm
from ssmkit._src.train.core.model import count_parameters, layer_names
from ssmkit._src.train.ppo.agent import Agent, make_agent
from ssmkit._src.train.ppo.config import PPOConfig, validate
from ssmkit._src.train.ppo.env import VecEnv, make_env
from ssmkit._src.train.ppo.rollout import evaluate_policy
from ssmkit._src.train.ppo.update import PPOState, create_ppo_state, make_optimizer, ppo_updates

# Metrics of `ppo_update` averaged over the updates of a log interval.
_LOSS_METRICS = ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction")
# What `curves.png` shows.
_PANELS = (
    metrics.Panel("episode return", (("mean_episode_return", "train (sampled actions)"),
                                     ("eval_mean_episode_return", "evaluation"))),
    metrics.Panel("loss", (("policy_loss", "policy loss"), ("value_loss", "value loss"),
                           ("entropy", "entropy"))),
)


class Setup(NamedTuple):
  """What a config builds before the first update.

  Attributes:
    env: the environments.
    mesh: the devices; the environments are split over them.
    agent: the policy.
    state: the initial `PPOState`, placed on `mesh` (or its shapes, dtypes and shardings, built
      `abstract`).
    shardings: the shardings of `state`'s parts.
    schedule: the learning rate as a function of the optimizer step.
  """

  env: VecEnv
  mesh: Mesh
  agent: Agent
  state: PPOState
  shardings: PPOState
  schedule: optax.Schedule


def setup(config: PPOConfig, *, abstract: bool = False) -> Setup:
  """Builds the run of `config` up to its first update; writes nothing.

  Args:
    config: the run's config.
    abstract: make `state` of `jax.ShapeDtypeStruct`s with their shardings (nothing computed or
      placed on the devices), the template of a checkpoint to restore.

  Raises:
    ConfigError: for any value out of range or that does not fit the environment or devices.
  """
  validate(config)
  if config.mesh.seq != 1:
    raise ConfigError(f"`mesh.seq` splits sequences over time, which PPO's rollouts, stepped one "
                      f"step at a time, do not: it must be 1, got {config.mesh.seq}.")
  env = make_env(config.env)
  agent = make_agent(config.model, env)
  tx, schedule = make_optimizer(config.ppo, config.train.updates)
  mesh = parallel.make_mesh(config.mesh, config.env.num_envs, "env.num_envs")
  replicated, split = parallel.replicated(mesh), parallel.split(mesh)
  build = lambda: create_ppo_state(agent, env, tx, jax.random.key(config.train.seed))
  initial = jax.eval_shape(build) if abstract else build()
  # The environments, and all that goes with them, are split over the devices; the policy's
  # parameters and optimizer state are sharded over "fsdp".
  shardings = PPOState(train_state=parallel.state_shardings(mesh, initial.train_state), actor=split,
                       key=replicated, update=replicated)
  place = parallel.shapes if abstract else parallel.place
  state = jax.tree.map(lambda sharding, part: place(part, sharding), shardings, initial)
  return Setup(env, mesh, agent, state, shardings, schedule)


def _mean(total: float, count: float) -> float | None:
  return float(total) / float(count) if count else None


def _evaluator(config: PPOConfig, run: Setup) -> Callable[[Any], dict[str, Any]]:
  """The evaluation of a run's parameters: `train.eval_steps` steps of fresh environments."""
  replicated = parallel.replicated(run.mesh)
  evaluate_fn = jax.jit(functools.partial(
      evaluate_policy, run.agent, run.env, num_steps=config.train.eval_steps,
      greedy=config.train.eval_greedy), out_shardings=replicated)
  # Every evaluation plays the same episodes, so evaluations of a run compare like with like.
  eval_key = parallel.place(jax.random.fold_in(jax.random.key(config.train.seed), 1), replicated)

  def evaluate(params: Any) -> dict[str, Any]:
    return_sum, episodes = jax.device_get(evaluate_fn(params, eval_key))
    return {"eval_mean_episode_return": _mean(return_sum, episodes), "eval_episodes": int(episodes)}

  return evaluate


def _schedule_length(config: PPOConfig) -> int:
  return config.train.updates * config.ppo.epochs * config.ppo.minibatches


def train_and_evaluate(config: PPOConfig, workdir: str | pathlib.Path, *,
                       hooks: Sequence[Callable[[int], None]] = ()) -> dict[str, Any]:
  """Trains the policy of `config` with PPO in `workdir`, then evaluates it.

  Logs metrics every `train.log_every` updates and evaluates every `train.eval_every` updates and
  after the last one (to `metrics.jsonl`); saves a checkpoint every `train.checkpoint_every`
  updates, after the last one and on SIGINT/SIGTERM (then raises `Interrupted`). The updates
  between two of these run in one jitted call. A workdir with checkpoints resumes from the latest
  one, dropping the metrics logged after it. At the end writes `summary.json` and `curves.png`.

  The records of `metrics.jsonl` have "step" (the update), "env_steps", the train metrics
  ("mean_episode_return" of the episodes that ended since the previous record, "episodes",
  "policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "learning_rate",
  "env_steps_per_second") and, at evaluations, "eval_mean_episode_return" and "eval_episodes".

  Args:
    config: the run's config, e.g. from `load_config` of a file with `task: ppo`.
    workdir: the run's directory; created if needed.
    hooks: functions called with the update reached after every jitted call of updates.

  Returns:
    The summary: "mean_episode_return" (of the final evaluation), "eval_episodes",
    "train_mean_episode_return" (over the last log interval), "steps" (environment steps),
    "updates", "wall_seconds" (over all sessions of the run), "params" and "config".

  Raises:
    ConfigError: for a config with values out of range or that does not fit the environment,
      or a workdir holding another run, or this run with another length of its annealed
      learning rate; raised before anything is written.
    Interrupted: after saving a checkpoint on SIGINT or SIGTERM.
  """
  started = time.perf_counter()
  previous = workdirs.previous_run(workdir, PPOConfig)
  # As a supervised run: a resumed run's state is restored into its shapes, not built first.
  run = setup(config, abstract=previous is not None)
  if previous is not None:
    workdirs.check_same_run(workdir, previous, config, ("env", "model"))
    if config.ppo.anneal:
      workdirs.check_same_schedule(
          workdir, "annealed learning rate", _schedule_length(previous), _schedule_length(config),
          "optimizer steps", "`train.updates`, `ppo.epochs` and `ppo.minibatches`")
  evaluate_params = _evaluator(config, run)
  rhythm = Rhythm(config.train.updates, config.train.log_every, config.train.eval_every,
                  config.train.checkpoint_every)
  update_fn = jax.jit(
      functools.partial(ppo_updates, run.agent, run.env, config.ppo, size=rhythm.max_span),
      out_shardings=(run.shardings, parallel.replicated(run.mesh)))
  steps_per_update = config.env.num_envs * config.ppo.rollout_steps
  optimizer_steps = config.ppo.epochs * config.ppo.minibatches

  with workdirs.Workdir(workdir, config, started) as files:
    state, _ = files.restore(run.state)
    num_params = count_parameters(state.train_state.params)
    kind = "recurrent" if run.agent.recurrent else "feed-forward"
    header = (
        f"{kind} {'/'.join(layer_names(config.model))} policy with {num_params:,} parameters on "
        f"{config.env.name}, {rhythm.total} updates of "
        f"{config.env.num_envs} x {config.ppo.rollout_steps} steps on {parallel.describe(run.mesh)}"
    )
    evaluation, train_return = None, None
    shown = ("mean_episode_return", *_LOSS_METRICS[:3])
    with Loop(files, rhythm, header=header, unit="update", shown=shown, hooks=hooks) as loop:
      for span in loop.spans():
        state, update_metrics = update_fn(state, np.int32(span.length))
        loop.keep(update_metrics, span.length)
        logged = None
        if span.log:
          rows, count, seconds = loop.fetch()
          episodes = sum(float(x) for x in rows["episodes"])
          train_return = _mean(sum(float(x) for x in rows["episode_return_sum"]), episodes)
          logged = {
              "env_steps": span.end * steps_per_update,
              "mean_episode_return": train_return,
              "episodes": int(episodes),
              **{key: float(np.mean(rows[key])) for key in _LOSS_METRICS},
              "learning_rate": float(run.schedule(span.end * optimizer_steps - 1)),
              "env_steps_per_second": count * steps_per_update / seconds,
          }
        evaluated = None
        if span.evaluate:
          evaluated = {**evaluate_params(state.train_state.params),
                       "env_steps": span.end * steps_per_update}
        evaluation = evaluated or evaluation
        loop.end(span, state, {}, logged, evaluated)
      if evaluation is None:  # The run had already reached its last update.
        evaluation = evaluate_params(state.train_state.params)
        loop.report(files.start, evaluation)
        train_return = next((r["mean_episode_return"] for r in reversed(metrics.read(files.metrics))
                             if "mean_episode_return" in r), None)
    updates = int(state.update)
    summary = {
        "mean_episode_return": evaluation["eval_mean_episode_return"],
        "eval_episodes": evaluation["eval_episodes"],
        "train_mean_episode_return": train_return,
        "steps": updates * steps_per_update,
        "updates": updates,
        "wall_seconds": files.wall_seconds(),
        "params": num_params,
        "config": schema.to_dict(config),
    }
    files.finish(summary, _PANELS, x="env_steps", xlabel="environment steps")
  return summary


def _restore(workdir: str | pathlib.Path, step: int | None) -> tuple[PPOConfig, Setup, int, PPOState]:
  config = workdirs.saved_config(workdir, PPOConfig)
  run = setup(config, abstract=True)
  # The policy's parameters alone: the optimizer's moments and the actors are neither read nor
  # given memory.
  step, state = workdirs.restore(workdir, run.state, step, parts=[("train_state", "params")])
  return config, run, step, state


def evaluate(workdir: str | pathlib.Path, step: int | None = None) -> dict[str, Any]:
  """Evaluates a checkpoint of a PPO workdir as the run's final evaluation does.

  Args:
    workdir: the run's directory.
    step: the checkpoint's update; default the latest.

  Returns:
    {"step": the checkpoint's update, "episodes", "mean_episode_return"}.

  Raises:
    FileNotFoundError: if `workdir` has no config, or no checkpoint (of `step`).
    ConfigError: if `workdir` holds a run of another task kind.
  """
  config, run, step, state = _restore(workdir, step)
  evaluation = _evaluator(config, run)(state.train_state.params)
  return {"step": step, "episodes": evaluation["eval_episodes"],
          "mean_episode_return": evaluation["eval_mean_episode_return"]}


def load(workdir: str | pathlib.Path,
         step: int | None = None) -> tuple[layers.SequenceModel, dict[str, Any], PPOConfig]:
  """The trained policy network of a PPO workdir, its variables at a checkpoint, its config.

  Args:
    workdir: the run's directory.
    step: the checkpoint's update; default the latest.

  Returns:
    `(model, variables, config)`: `model` is the policy's `SequenceModel`, whose outputs
    `[..., :A]` are action logits and `[..., A]` the value (see `Agent`).

  Raises:
    FileNotFoundError: if `workdir` has no config, or no checkpoint (of `step`).
    ConfigError: if `workdir` holds a run of another task kind.
  """
  config, run, _, state = _restore(workdir, step)
  return run.agent.model, {"params": state.train_state.params}, config
