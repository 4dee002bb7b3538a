"""Language-model runs: the supervised trainer on a text corpus packed into rows, in bits per byte.

The data are `ssmkit.data.text`'s: byte tokens of the corpus's documents, each begun by an
end-of-document token that resets every layer, packed into rows without padding; the split is
by document. The trainer, its checkpoints and resumption are the supervised ones; the results
add perplexity and bits per byte, the headline.
"""

from __future__ import annotations

import math
import pathlib
import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ssmkit import data, layers
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.lm.config import LMConfig, validate
from ssmkit._src.train.supervised import train as supervised


def dataset(config: LMConfig) -> data.SequenceDataset:
  """The packed byte tokens of the corpus of `config.data`.

  Raises:
    ConfigError: naming `data.path`, `data.seq_len` or `data.validation_fraction`.
  """
  section = config.data
  try:
    return data.text(path=section.path, seq_len=section.seq_len,
                     validation_fraction=section.validation_fraction)
  except ValueError as error:
    message = re.sub(r"`(path|seq_len|validation_fraction)`", r"`data.\1`", str(error))
    raise ConfigError(f"cannot make the text data: {message}") from None


def results(dataset: data.SequenceDataset, result: dict[str, float]) -> dict[str, float]:
  """The validation results: loss (nats per token), accuracy, perplexity, bits per byte.

  Bits per byte count the summed loss of every target, end-of-document tokens included, over
  the bytes of text among the targets.
  """
  tokens = dataset.y_test.size
  text_bytes = int(np.sum(dataset.y_test < data.ByteTokenizer().eod))
  bits = result["loss"] * tokens / math.log(2)
  return {"test_loss": result["loss"], "test_accuracy": result["accuracy"],
          "test_perplexity": math.exp(result["loss"]), "test_bits_per_byte": bits / max(text_bytes, 1)}


# Language-model runs, as the supervised trainer takes them.
TASK = supervised.Task(schema=LMConfig, validate=validate, dataset=dataset, results=results)


def train_and_evaluate(config: LMConfig, workdir: str | pathlib.Path, *,
                       hooks: Sequence[Callable[[int], None]] = ()) -> dict[str, Any]:
  """Trains the language model of `config` in `workdir` and evaluates it on the validation split.

  As `ssmkit.train.supervised.train_and_evaluate` (the same workdir, logs, checkpoints and
  resumption), with "tokens_per_second" in the train logs.

  Returns:
    The summary: "test_loss" (nats per token), "test_accuracy" (next-token), "test_perplexity",
    "test_bits_per_byte", "steps", "wall_seconds", "params" and "config".
  """
  return supervised.train_and_evaluate(config, workdir, hooks=hooks, task=TASK)


def evaluate(workdir: str | pathlib.Path, step: int | None = None) -> dict[str, Any]:
  """A checkpoint's results on the validation split, as `train_and_evaluate`'s final ones."""
  return supervised.evaluate(workdir, step, task=TASK)


def load(workdir: str | pathlib.Path, step: int | None = None
         ) -> tuple[layers.SequenceModel, dict[str, Any], LMConfig]:
  """`(model, variables, config)` of a checkpoint: `layers.generate(model, variables, prompt, n)`
  continues byte tokens (`ssmkit.data.ByteTokenizer().encode(text)`)."""
  return supervised.load(workdir, step, task=TASK)


def complete(model: layers.SequenceModel, variables: dict[str, Any], prompt: str, max_bytes: int, *,
             rng: Any = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None) -> str:
  """The text a byte-level language model writes after `prompt`, as the start of a document.

  The prompt follows an end-of-document token (every document of a run starts with one); the
  model continues it with `ssmkit.layers.generate` until it writes the end-of-document token
  or `max_bytes` tokens. Bytes that do not end a UTF-8 character become U+FFFD.

  Args:
    model, variables: a language model of a `task: lm` run, e.g. from `load`.
    prompt: the start of the document.
    max_bytes: at most this many tokens are generated.
    rng, temperature, top_k, top_p: as `ssmkit.layers.generate` takes them; temperature 0
      (the default) is greedy.

  Returns:
    The continuation, without the prompt.
  """
  tokenizer = data.ByteTokenizer()
  tokens = np.array([[tokenizer.eod, *tokenizer.encode(prompt)]], np.int32)
  written = np.asarray(layers.generate(model, variables, tokens, max_bytes, rng=rng,
                                       temperature=temperature, top_k=top_k, top_p=top_p,
                                       eos_token=tokenizer.eod))[0]
  ends = np.flatnonzero(written == tokenizer.eod)
  return tokenizer.decode(written[:ends[0] if ends.size else len(written)])

