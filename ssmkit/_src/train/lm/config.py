"""The schema of language-model runs: a text corpus packed into rows, a model, an optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from ssmkit._src.train.core.errors import ConfigError
from ssmkit._src.train.core.model import ModelConfig
from ssmkit._src.train.core.parallel import MeshConfig
from ssmkit._src.train.supervised import config as supervised


@dataclasses.dataclass
class LMDataConfig:
  """Which text to model and how to cut it into rows."""

  # The text: a file, a folder (every file under it) or a glob; null: the Python standard
  # library's source files of the running interpreter, one document per file.
  path: str | None = None
  # A Hugging Face tokenizer.json to tokenise the text with; null: UTF-8 bytes (257 tokens with
  # the end-of-document token). Bits per byte count the bytes of text behind each token.
  tokenizer: str | None = None
  # The end-of-document token of `tokenizer`; null: the first of <|endoftext|>,
  # <|end_of_text|>, </s> and <eos> it has, else a new token after its last.
  eod_token: str | None = None
  # Steps per row: the documents, each begun by an end-of-document token that resets every
  # layer, are concatenated and cut into rows of this many tokens, without padding.
  seq_len: int = 256
  # Fraction of the documents held out for validation, chosen by a hash of each one's path.
  validation_fraction: float = 0.05
  # Rows per train and eval batch.
  batch_size: int = 32


@dataclasses.dataclass
class LMModelConfig(ModelConfig):
  """The `ssmkit.layers.SequenceModel` to train: tokens in, the next token's logits out."""

  # One prediction per step, of the next token: the only pooling of a language model.
  pooling: str = "none"
  # A Hugging Face checkpoint to fine-tune (a directory, or a hub id with the hub extra):
  # its architecture and weights replace this section's layer, width, depth, block, norm, MLP
  # and head options and the initialisation (an override of one of them is refused), and its
  # tokenizer.json tokenises the text (`data.tokenizer` stays null); dropout_rate, dtype,
  # param_dtype, mode and scan_blocks (the checkpoint's blocks under `nn.scan`, by the
  # shortest period of its layers after any distinct first ones) still apply.
  pretrained: str | None = None


@dataclasses.dataclass
class LMSamplesConfig:
  """The continuations of held-out text that a run prints after each evaluation."""

  # How many held-out documents to continue (the first whose start fills a prompt), each
  # greedily and sampled; 0: none, and no `generate` is compiled for them.
  documents: int = 2
  # Tokens of each document's start, after its end-of-document token, that prompt the model.
  prompt_tokens: int = 24
  # Tokens written after each prompt, fewer where the model ends the document first.
  new_tokens: int = 48
  # Temperature of the sampled continuations (seed 0); the greedy ones take the argmax.
  temperature: float = 0.8


@dataclasses.dataclass
class LMConfig:
  """A language-model run on text: `ssmkit train CONFIG` with `task: lm` reads this."""

  # The task kind: next-token prediction on packed documents of text.
  task: str = "lm"
  data: LMDataConfig = dataclasses.field(default_factory=LMDataConfig)
  model: LMModelConfig = dataclasses.field(default_factory=LMModelConfig)
  optimizer: supervised.OptimizerConfig = dataclasses.field(default_factory=supervised.OptimizerConfig)
  train: supervised.TrainConfig = dataclasses.field(default_factory=supervised.TrainConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  samples: LMSamplesConfig = dataclasses.field(default_factory=LMSamplesConfig)


# Each string field with the values it may take.
CHOICES: dict[str, tuple[str, ...]] = {
    **supervised.CHOICES,
    "task": ("lm",),
    "model.pooling": ("none",),
}
# Each numeric field with the smallest value it may take.
MINIMUMS: dict[str, float] = {**supervised.MINIMUMS, "data.seq_len": 2, "samples.documents": 0,
                               "samples.prompt_tokens": 1, "samples.new_tokens": 1}
# Each numeric field that must be > 0.
POSITIVE = (*supervised.POSITIVE, "samples.temperature")


# The `model` fields that still apply with `model.pretrained`, whose checkpoint replaces the
# others (but `pooling`, "none" in every lm run).
KEPT_WITH_CHECKPOINT = ("dropout_rate", "scan_blocks", "dtype", "param_dtype", "mode")


def check_overrides(config: LMConfig, keys: Sequence[str]) -> None:
  """Refuses an override of a `model` field that the checkpoint of `model.pretrained` replaces,
  which would otherwise change nothing.

  Raises:
    ConfigError: naming the first such key.
  """
  if config.model.pretrained is None:
    return
  for key in keys:
    section, _, rest = key.partition(".")
    name = rest.split(".")[0]
    if section == "model" and name not in ("", "pretrained", "pooling", *KEPT_WITH_CHECKPOINT):
      raise ConfigError(f"`{key}` cannot be set with `model.pretrained`: the checkpoint's "
                        f"architecture replaces `model.{name}`; of the `model` section, only "
                        f"{', '.join(KEPT_WITH_CHECKPOINT)} still apply.")


def validate(config: LMConfig) -> LMConfig:
  """Checks the values the schema's types do not constrain; returns `config`.

  Raises:
    ConfigError: naming the first field with a value outside its choices or range, or a layer
      keyword argument the layer does not have or of another type.
  """
  if config.model.pretrained is not None and config.data.tokenizer is not None:
    raise ConfigError("`data.tokenizer` must be null with `model.pretrained`: the checkpoint's "
                      "tokenizer.json tokenises the text.")
  if not 0 < config.data.validation_fraction < 1:
    raise ConfigError(f"`data.validation_fraction` must lie strictly between 0 and 1, got "
                      f"{config.data.validation_fraction}.")
  return supervised.check_run(config, CHOICES, MINIMUMS, POSITIVE)
