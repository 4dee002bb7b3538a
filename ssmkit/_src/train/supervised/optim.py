"""The optimizer: clipping, then AdamW with warmup and a per-group learning rate and weight decay."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import optax

from ssmkit._src.train.core.model import parameter_labels

if TYPE_CHECKING:
  from ssmkit._src.train.supervised.config import OptimizerConfig


def learning_rate_schedule(config: OptimizerConfig, peak: float, total_steps: int) -> optax.Schedule:
  """Linear warmup from 0 to `peak` over `config.warmup_steps`, then cosine decay to 0 or constant.

  Args:
    config: the `optimizer` section of a training config.
    peak: the learning rate after warmup.
    total_steps: the length of the run; the cosine reaches 0 there.

  Returns:
    The learning rate as a function of the step.
  """
  warmup = config.warmup_steps
  if config.schedule == "cosine":
    main = optax.cosine_decay_schedule(peak, max(total_steps - warmup, 1))
  else:
    main = optax.constant_schedule(peak)
  if warmup == 0:
    return main
  return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), main], [warmup])


def make_optimizer(config: OptimizerConfig, layer: str | tuple[str, ...],
                   total_steps: int, head_blocks: int = 0) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW on three parameter groups.

  "decay" (weight matrices): `learning_rate` with `weight_decay`; "no_decay" (biases, norm
  scales, embeddings, and the parameters the layer's `parameter_groups.no_decay` names):
  `learning_rate`, no decay; "ssm" (the layer's `parameter_groups.recurrence`):
  `ssm_learning_rate`, no decay.

  Args:
    config: the `optimizer` section of a training config.
    layer: the registry names of the config's layers (`layer_names`), whose declared parameter
      groups decide the labels.
    total_steps: the length of the run, for the schedule.
    head_blocks: the model's `head_blocks` (see `parameter_labels`).

  Returns:
    The optax transformation.

  References:
    Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    Smith et al., "Simplified State Space Layers for Sequence Modeling", ICLR 2023 (SSM learning rate).
  """
  schedule = functools.partial(learning_rate_schedule, config, total_steps=total_steps)
  groups = optax.multi_transform(
      {
          "decay": optax.adamw(schedule(config.learning_rate), weight_decay=config.weight_decay),
          "no_decay": optax.adam(schedule(config.learning_rate)),
          "ssm": optax.adam(schedule(config.ssm_learning_rate)),
      },
      functools.partial(parameter_labels, layer=layer, head_blocks=head_blocks),
  )
  if config.grad_clip is None:
    return groups
  return optax.chain(optax.clip_by_global_norm(config.grad_clip), groups)
