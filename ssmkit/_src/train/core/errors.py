"""The errors a training run reports to its user rather than as a traceback."""

from __future__ import annotations


class ConfigError(ValueError):
  """A training config with an unknown key, or a value of the wrong type or out of range."""


class Interrupted(Exception):
  """Training stopped on SIGINT or SIGTERM after saving a checkpoint; the same call resumes it.

  Attributes:
    signal_name: "SIGINT" or "SIGTERM".
    step: the step of the saved checkpoint.
    workdir: the run's directory.
  """

  def __init__(self, signal_name: str, step: int, workdir: str):
    super().__init__(
        f"{signal_name} received: stopped after step {step} and saved a checkpoint in {workdir}; "
        "run the same command again to resume."
    )
    self.signal_name, self.step, self.workdir = signal_name, step, workdir
