"""Text in and out of a published checkpoint: its `tokenizer.json`, and continuing a prompt."""

from __future__ import annotations

import pathlib
from typing import Any

import numpy as np

from ssmkit._src.data.tokenizer import HFTokenizer, until_the_end
from ssmkit._src.layers.model import generate
from ssmkit._src.pretrained.files import CheckpointError
from ssmkit._src.pretrained.load import checkpoint_directory

TOKENIZER = "tokenizer.json"


def tokenizer_file(path_or_repo_id: str | pathlib.Path) -> pathlib.Path:
  """The path of a checkpoint's `tokenizer.json` (a directory or a hub id, as `load` takes them).

  Raises:
    CheckpointError: naming the file when the checkpoint has none.
  """
  path = checkpoint_directory(path_or_repo_id) / TOKENIZER
  if not path.is_file():
    raise CheckpointError(f"{path} does not exist: the checkpoint has no tokenizer.json to turn "
                          "text into its tokens.")
  return path


def tokenizer(path_or_repo_id: str | pathlib.Path) -> HFTokenizer:
  """The `tokenizer.json` of a checkpoint, read (`tokenizer_file`).

  Raises:
    CheckpointError: naming the file when the checkpoint has none or it cannot be read.
  """
  path = tokenizer_file(path_or_repo_id)
  try:
    return HFTokenizer(path)
  except ValueError as error:
    raise CheckpointError(str(error)) from None


def complete(model: Any, variables: Any, coder: HFTokenizer, prompt: str, max_tokens: int, *,
             rng: Any = None, temperature: float = 0.0, top_k: int | None = None,
             top_p: float | None = None) -> str:
  """The prompt and its continuation by a loaded checkpoint, as text.

  The prompt is encoded as the tokenizer encodes it, without special tokens added; the model
  continues it with `ssmkit.layers.generate` for `max_tokens` tokens or until the tokenizer's
  end-of-text token, and the whole sequence is decoded (so words split across the prompt's
  end join as the tokenizer joins them).

  Args:
    model, variables: a linen model and its variables from `ssmkit.pretrained.load`.
    coder: the checkpoint's tokenizer (`tokenizer(...)`).
    prompt: the text to continue; not empty.
    max_tokens: at most this many new tokens.
    rng, temperature, top_k, top_p: as `ssmkit.layers.generate` takes them; temperature 0
      (the default) is greedy.

  Raises:
    ValueError: naming `prompt` when it encodes to no token, or `tokenizer` when its
      vocabulary is larger than the model's.
  """
  if coder.vocab_size > model.vocab_size:
    raise ValueError(f"`tokenizer` has {coder.vocab_size} tokens, more than the model's "
                     f"{model.vocab_size}.")
  tokens = coder.encode(prompt)
  if not tokens.size:
    raise ValueError(f"`prompt` {prompt!r} encodes to no token; give text to continue.")
  written = np.asarray(generate(model, variables, tokens[None], max_tokens, rng=rng,
                                temperature=temperature, top_k=top_k, top_p=top_p,
                                eos_token=coder.eod))[0]
  return coder.decode(np.concatenate([tokens, until_the_end(written, coder.eod)]))
