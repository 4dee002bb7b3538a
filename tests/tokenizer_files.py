"""`tokenizer.json` files made by the `tokenizers` package itself, for tests of text with a tokenizer."""

from __future__ import annotations

import pathlib

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers


def byte_level_bpe(path: pathlib.Path, texts: list[str], vocab_size: int = 300,
                   special: tuple[str, ...] = ("<|endoftext|>",)) -> pathlib.Path:
  """A GPT-2 style byte-level BPE trained on `texts`, saved at `path`."""
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=list(special), show_progress=False,
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tokenizer.save(str(path))
  return path


def stripping_words(path: pathlib.Path, words: list[str]) -> pathlib.Path:
  """A word-level tokenizer that strips the text and splits it at whitespace, which no token
  keeps: bytes of text that belong to no token."""
  tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["[UNK]", *words])},
                                         unk_token="[UNK]"))
  tokenizer.normalizer = normalizers.Strip()
  tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
  tokenizer.save(str(path))
  return path
