"""The rhythm every training run keeps: log, evaluate, checkpoint, stop; and steps run on the device.

A run of `total` steps goes in spans: a span ends at the first step that logs (every
`log_every`), evaluates (every `eval_every`), saves a checkpoint (every `checkpoint_every`) or
is the last. The steps of a span run in one jitted call (`run_steps`, a loop on the device), so
the host neither feeds nor waits for single steps; metrics stay on the device until a log fetches
them. After each span `Loop.end` records what the task computed, shows progress, calls the hooks,
saves a checkpoint when one is due, and stops the run, checkpoint saved, after SIGINT or SIGTERM.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssmkit._src.train.core import metrics
from ssmkit._src.train.core.errors import Interrupted
from ssmkit._src.train.core.interrupt import stop_requests
from ssmkit._src.train.core.workdir import Workdir


@dataclasses.dataclass(frozen=True)
class Span:
  """Steps `start + 1` to `end` of a run, run in one call, and what is due after the last of them.

  Attributes:
    start: steps done before the span.
    end: steps done after it.
    log: train metrics are due.
    evaluate: an evaluation is due.
    checkpoint: a checkpoint is due.
    last: `end` is the run's last step.
  """

  start: int
  end: int
  log: bool
  evaluate: bool
  checkpoint: bool
  last: bool

  @property
  def length(self) -> int:
    """The number of steps in the span."""
    return self.end - self.start


@dataclasses.dataclass(frozen=True)
class Rhythm:
  """When a run of `total` steps logs, evaluates and saves.

  Attributes:
    total: the run's number of steps.
    log_every: log train metrics every this many steps, and after the last.
    eval_every: evaluate every this many steps, and after the last; 0: after the last only.
    checkpoint_every: save a checkpoint every this many steps, and after the last.
  """

  total: int
  log_every: int
  eval_every: int
  checkpoint_every: int

  @property
  def max_span(self) -> int:
    """The length of the longest span: a span never runs past a log."""
    return min(self.log_every, self.total)

  def span(self, start: int) -> Span:
    """The span after step `start`: up to the next step at which something is due."""
    every = [self.log_every, self.checkpoint_every] + ([self.eval_every] if self.eval_every else [])
    end = min([self.total] + [(start // n + 1) * n for n in every])
    last = end == self.total
    due = lambda n: (bool(n) and end % n == 0) or last
    return Span(start, end, log=due(self.log_every), evaluate=due(self.eval_every),
                checkpoint=due(self.checkpoint_every), last=last)


def run_steps(step: Callable[[Any, jax.Array], tuple[Any, Any]], state: Any, count: jax.Array,
              size: int) -> tuple[Any, Any]:
  """`count` steps `state, out_i = step(state, i)` in one `lax.fori_loop`, under `jax.jit`.

  Each step computes what it would as its own jitted call (the same operations in the same
  order), so a run in spans gives the results of a run step by step.

  Args:
    step: one step; `i` (int32) is the step's index in the span, e.g. to pick its batch.
    state: the state before the first step.
    count: int32 number of steps, at most `size`; traced, so one compilation serves every span.
    size: the longest span, the number of rows of the outputs.

  Returns:
    The state after `count` steps, and the outputs stacked on a leading axis of `size` rows, of
    which the first `count` are the steps' and the others zero.
  """
  # Jitted, the step is traced once, the shapes below and the loop's body sharing that trace:
  # a tiny Qwen3.5 or Kimi Linear fine-tuning run through `ssmkit train` took 0.6-0.8 s less
  # from a cold start (CPU) than with the step traced for each.
  step = jax.jit(step)
  first = jnp.zeros((), jnp.int32)  # not weakly typed, as the loop's index then is not
  shapes = jax.eval_shape(step, state, first)[1]
  outputs = jax.tree.map(lambda s: jnp.zeros((size, *s.shape), s.dtype), shapes)

  def body(i: jax.Array, carry: tuple[Any, Any]) -> tuple[Any, Any]:
    state, outputs = carry
    state, out = step(state, i)
    return state, jax.tree.map(lambda rows, row: rows.at[i].set(row), outputs, out)

  return lax.fori_loop(first, count, body, (state, outputs))


def _line(unit: str, step: int, values: dict[str, Any]) -> str:
  shown = (f"{key}={value:.4f}" for key, value in values.items() if isinstance(value, float))
  return f"{unit} {step}: " + " ".join(shown)


class Loop:
  """The run in spans from the workdir's latest checkpoint: progress, records, hooks, saves, stops.

  Use as a context manager, which shows a progress bar and turns SIGINT and SIGTERM into a
  request to stop after the current span:

      with Loop(workdir, rhythm, ...) as loop:
        for span in loop.spans():
          state, outputs = ...  # the span's steps in one call
          loop.keep(outputs, span.length)
          logged = ... if span.log else None  # from `loop.fetch()`
          evaluated = ... if span.evaluate else None
          loop.end(span, state, progress, logged, evaluated)

  Args:
    workdir: the opened workdir; the run starts at its `start` step.
    rhythm: when the run logs, evaluates and saves.
    header: a line printed first, e.g. the model and the devices.
    unit: what a step is called in printed lines ("step", "update").
    shown: the keys of logged metrics shown beside the progress bar (and printed when the
      output is not a terminal).
    hooks: functions called with the step reached after every span.
  """

  def __init__(self, workdir: Workdir, rhythm: Rhythm, *, header: str, unit: str, shown: Sequence[str],
               hooks: Sequence[Callable[[int], None]] = ()):
    self._workdir, self._rhythm = workdir, rhythm
    self._unit, self._shown, self._hooks = unit, tuple(shown), tuple(hooks)
    start = workdir.start
    self._header = header + (f", resuming from {unit} {start}" if start else "")
    self._stack = contextlib.ExitStack()
    self._clock = time.perf_counter()
    self._kept: list[tuple[dict[str, jax.Array], int]] = []

  def __enter__(self) -> Loop:
    self._stop = self._stack.enter_context(stop_requests())
    total, start = self._rhythm.total, self._workdir.start
    self._bar, self._write = metrics.console(total, start, "train", self._unit)
    self._stack.enter_context(self._bar)
    self._write(self._header)
    self._clock = time.perf_counter()
    return self

  def __exit__(self, *exc_info: object) -> None:
    self._stack.close()

  def spans(self) -> Iterator[Span]:
    """The spans from the workdir's `start` to the last step."""
    step = self._workdir.start
    while step < self._rhythm.total:
      span = self._rhythm.span(step)
      yield span
      step = span.end

  def keep(self, outputs: dict[str, jax.Array], count: int) -> None:
    """Keeps the per-step outputs of a span (`run_steps`'s, `count` rows) until `fetch`."""
    self._kept.append((outputs, count))

  def fetch(self) -> tuple[dict[str, np.ndarray], int, float]:
    """The outputs kept since the previous fetch, on the host: what a log reports.

    Returns:
      `(rows, steps, seconds)`: every output stacked over the `steps` steps since the previous
      fetch, in order, and the seconds they took (to the end of the last, evaluations excluded).
    """
    kept = jax.device_get(self._kept)  # Waits for the steps, so `now` is when they ended.
    now = time.perf_counter()
    seconds, self._clock, self._kept = now - self._clock, now, []
    rows = {key: np.concatenate([outputs[key][:count] for outputs, count in kept]) for key in kept[0][0]}
    return rows, sum(count for _, count in kept), seconds

  def end(self, span: Span, state: Any, progress: dict[str, Any], logged: dict[str, Any] | None = None,
          evaluated: dict[str, Any] | None = None) -> None:
    """Closes a span: records, progress, hooks, a checkpoint when due, a stop when asked for.

    Args:
      span: the span whose steps have run.
      state: the run's state after them, which a checkpoint saves.
      progress: the rest of the run's position (JSON), saved beside the state.
      logged: the train metrics, if the span logged.
      evaluated: the evaluation's metrics, if the span evaluated; the time it took does not
        count towards the seconds of the next `fetch`.

    Raises:
      Interrupted: after saving a checkpoint, if SIGINT or SIGTERM arrived and `span` is not
        the last.
    """
    self._bar.update(span.length)
    if logged:
      shown = {key: logged[key] for key in self._shown if logged.get(key) is not None}
      self._bar.set_postfix({key: f"{value:.4f}" for key, value in shown.items()})
      if self._bar.disable:
        self._write(_line(self._unit, span.end, shown))
    if evaluated:
      self.report(span.end, evaluated)
      self._clock = time.perf_counter()
    record = {**(logged or {}), **(evaluated or {})}
    if record:
      metrics.append(self._workdir.metrics, {"step": span.end, **record})
    for hook in self._hooks:
      hook(span.end)
    stopping = bool(self._stop) and not span.last
    if span.checkpoint or stopping:
      self._workdir.save(span.end, state, progress)
    if stopping:
      raise Interrupted(self._stop.signal_name, span.end, str(self._workdir.path))

  def write(self, line: str) -> None:
    """Prints `line` above the progress bar (on process 0)."""
    self._write(line)

  def report(self, step: int, values: dict[str, Any]) -> None:
    """Prints the float `values` reached at `step` above the progress bar (on process 0)."""
    self._write(_line(self._unit, step, values))
