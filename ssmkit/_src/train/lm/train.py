"""Language-model runs: the supervised trainer on a text corpus packed into rows, in bits per byte.

The data are `ssmkit.data.text`'s: the tokens (bytes, or a tokenizer.json's) of the corpus's
documents, each begun by an
end-of-document token that resets every layer, packed into rows without padding; the split is
by document. The trainer, its checkpoints and resumption are the supervised ones; the results
add perplexity and bits per byte, the headline, and each evaluation prints continuations of
held-out text.
"""

from __future__ import annotations

import contextlib
import math
import pathlib
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ssmkit import data, layers, pretrained
from ssmkit._src.data.tokenizer import until_the_end
from ssmkit._src.layers.model import layer_pattern
from ssmkit._src.layers.registry import registry_name
from ssmkit._src.pretrained.text import tokenizer_file
from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.model import (
    TrainState,
    float_dtype,
    variables,
)
from ssmkit._src.train.lm.config import LMConfig, validate
from ssmkit._src.train.supervised import train as supervised


def dataset(config: LMConfig) -> data.TextDataset:
  """The packed tokens of the corpus of `config.data`.

  Raises:
    ConfigError: naming `data.path`, `data.seq_len`, `data.validation_fraction`,
      `data.tokenizer` or `data.eod_token`.
  """
  section = config.data
  path = _tokenizer_path(config)
  with _data_errors("cannot make the text data"):
    return data.text(path=section.path, seq_len=section.seq_len,
                     validation_fraction=section.validation_fraction, tokenizer=path,
                     eod_token=section.eod_token)


def tokenizer(config: LMConfig) -> data.Tokenizer:
  """The tokenizer of a run: `data.tokenizer`'s (bytes when null), or the `tokenizer.json` of
  `model.pretrained`.

  Raises:
    ConfigError: naming `data.tokenizer`, `data.eod_token` or `model.pretrained`.
  """
  path = _tokenizer_path(config)
  with _data_errors("cannot read the tokenizer"):
    return data.load_tokenizer(path, config.data.eod_token)


def _tokenizer_path(config: LMConfig) -> str | None:
  """`data.tokenizer`, or the tokenizer.json of `model.pretrained`."""
  if config.model.pretrained is None:
    return config.data.tokenizer
  with _checkpoint_errors():
    return str(tokenizer_file(config.model.pretrained))


def model(config: LMConfig, dataset: data.TextDataset, abstract: bool = False) -> supervised.Built:
  """The model of a run: `model.pretrained`'s checkpoint with its weights (their shapes alone
  with `abstract`: none is read), or the `model` section's (`supervised.Task.model`).

  Raises:
    ConfigError: naming `model.pretrained` when the checkpoint cannot be loaded or its
      vocabulary is smaller than its tokenizer's.
  """
  section = config.model
  if section.pretrained is None:
    return supervised.configured_model(config, dataset)
  with _checkpoint_errors():
    network, variables, _ = pretrained.load(section.pretrained, abstract=abstract,
                                            scan_blocks=section.scan_blocks)
  if network.vocab_size < dataset.vocab_size:
    raise ConfigError(f"`model.pretrained`: the checkpoint reads {network.vocab_size} tokens, fewer "
                      f"than its tokenizer's {dataset.vocab_size}.")
  network = network.clone(dropout_rate=section.dropout_rate, param_dtype=float_dtype(
      section.param_dtype, "model.param_dtype"), dtype=None if section.dtype is None else
      float_dtype(section.dtype, "model.dtype"))
  kinds = tuple(registry_name(make) for make in layer_pattern(network.layer))
  return network, kinds, variables["params"]


@contextlib.contextmanager
def _checkpoint_errors() -> Iterator[None]:
  """Turns a `CheckpointError` into a `ConfigError` naming `model.pretrained`."""
  try:
    yield
  except pretrained.CheckpointError as error:
    raise ConfigError(f"`model.pretrained`: {error}") from None


@contextlib.contextmanager
def _data_errors(what: str) -> Iterator[None]:
  """Turns a `ValueError` naming an argument of `ssmkit.data.text` into a `ConfigError` naming
  its `data.` key."""
  try:
    yield
  except ValueError as error:
    message = re.sub(r"`(path|seq_len|validation_fraction|tokenizer|eod_token)`", r"`data.\1`",
                     str(error))
    raise ConfigError(f"{what}: {message}") from None


def results(dataset: data.TextDataset, result: dict[str, float]) -> dict[str, float]:
  """The validation results: loss (nats per token), accuracy, perplexity, bits per byte.

  Bits per byte count the summed loss of every target, end-of-document tokens included, over
  the bytes of text behind the targets (`dataset.target_bytes_test`), whatever the tokenizer.
  """
  tokens = dataset.y_test.size
  text_bytes = int(np.sum(dataset.target_bytes_test))
  bits = result["loss"] * tokens / math.log(2)
  return {"test_loss": result["loss"], "test_accuracy": result["accuracy"],
          "test_perplexity": math.exp(result["loss"]), "test_bits_per_byte": bits / max(text_bytes, 1)}


def samples(config: LMConfig, run: supervised.Setup, state: TrainState) -> list[str]:
  """Continuations of the starts of the first held-out documents (`config.samples`): greedy,
  and sampled (seed 0), each up to `samples.new_tokens` tokens or the end of the document.

  The prompts are the same at every evaluation, and one compiled `generate` serves both kinds.
  """
  section = config.samples
  coder = run.dataset.tokenizer
  stream = run.dataset.x_test.reshape(-1)
  reset = run.dataset.reset_test.reshape(-1)
  length = 1 + section.prompt_tokens
  prompts = [stream[start:start + length] for start in np.flatnonzero(reset)
             if start + length <= stream.size
             and not reset[start + 1:start + length].any()][:section.documents]
  if not prompts:
    return []
  lines = []
  for kind, temperature in (("greedy", 0.0), ("sampled", section.temperature)):
    written = np.asarray(layers.generate(
        run.model, variables(state), np.stack(prompts), section.new_tokens,
        rng=jax.random.key(0), temperature=jnp.float32(temperature), eos_token=coder.eod))
    for prompt, tokens in zip(prompts, written, strict=True):
      lines.append(f"{kind}: {coder.decode(prompt)!r} -> {_until_the_end(tokens, coder)!r}")
  return lines


def _until_the_end(tokens: np.ndarray, coder: data.Tokenizer) -> str:
  """The text of generated tokens up to the first end-of-document token."""
  return coder.decode(until_the_end(tokens, coder.eod))


# Language-model runs, as the supervised trainer takes them.
TASK = supervised.Task(schema=LMConfig, validate=validate, dataset=dataset, results=results,
                       samples=samples, model=model)


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
  """`(model, variables, config)` of a checkpoint: `complete(model, variables, prompt, n,
  tokenizer=tokenizer(config))` continues text, and `layers.generate` continues tokens."""
  return supervised.load(workdir, step, task=TASK)


def complete(model: layers.SequenceModel, variables: dict[str, Any], prompt: str, max_tokens: int, *,
             tokenizer: data.Tokenizer | None = None, rng: Any = None, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None) -> str:
  """The prompt and the text a language model writes after it, as the start of a document.

  The prompt follows an end-of-document token (every document of a run starts with one); the
  model continues it with `ssmkit.layers.generate` until it writes the end-of-document token
  or `max_tokens` tokens, and the prompt's tokens and the new ones are decoded as one sequence
  (so a word-level tokenizer puts its separator between them, and bytes split across the
  prompt's end join).

  Args:
    model, variables: a language model of a `task: lm` run, e.g. from `load`.
    prompt: the start of the document.
    max_tokens: at most this many tokens are generated.
    tokenizer: the run's tokenizer (`tokenizer(config)`); None for bytes (`ByteTokenizer`),
      where bytes that do not end a UTF-8 character become U+FFFD.
    rng, temperature, top_k, top_p: as `ssmkit.layers.generate` takes them; temperature 0
      (the default) is greedy.

  Returns:
    The prompt and its continuation, decoded together.

  Raises:
    ValueError: naming `tokenizer` when its vocabulary is not the model's, and as
      `ssmkit.layers.generate` (a prompt longer than an attention cache, say).
  """
  coder = data.ByteTokenizer() if tokenizer is None else tokenizer
  if coder.vocab_size != model.vocab_size:
    raise ValueError(f"`tokenizer` has {coder.vocab_size} tokens, but the model reads "
                     f"{model.vocab_size}: give the tokenizer of the model's run.")
  prompt_tokens = np.asarray(coder.encode(prompt), np.int32)
  tokens = np.concatenate([[coder.eod], prompt_tokens]).astype(np.int32)[None]
  written = layers.generate(model, variables, tokens, max_tokens, rng=rng, temperature=temperature,
                            top_k=top_k, top_p=top_p, eos_token=coder.eod)
  return coder.decode(np.concatenate([prompt_tokens,
                                      until_the_end(np.asarray(written)[0], coder.eod)]))
