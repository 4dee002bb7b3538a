"""Tokenizers for text corpora: UTF-8 bytes, or a Hugging Face `tokenizer.json`.

Both give the tokens of a text and how many bytes of the text each token stands for, so a
language model's loss converts to bits per byte of text whatever the tokenizer; both have an
end-of-document token, which packing puts before every document.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Protocol

import numpy as np

# Names of an end-of-document token in published tokenizers, in the order they are looked for.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer(Protocol):
  """What packing, evaluation and generation need of a tokenizer.

  Attributes:
    vocab_size: the number of tokens, the end-of-document token included.
    eod: the end-of-document token.
  """

  vocab_size: int
  eod: int

  def encode(self, text: str) -> np.ndarray:
    """`(n,)` int32 tokens of `text`, without the end-of-document token."""

  def encode_counted(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, text_bytes)`: `encode(text)` and `(n,)` int32 bytes of `text` per token, which
    sum to `len(text.encode())`."""

  def decode(self, tokens: np.ndarray) -> str:
    """The text of `tokens`, end-of-document tokens left out."""


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  """UTF-8 bytes as tokens 0..255, and one end-of-document token, 256.

  Attributes:
    vocab_size: 257.
    eod: the end-of-document token, 256; packing puts it before every document.
  """

  vocab_size: int = 257
  eod: int = 256

  def encode(self, text: str) -> np.ndarray:
    """`(len(text.encode()),)` int32: the UTF-8 bytes of `text`."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)

  def encode_counted(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """`(encode(text), ones)`: each token is one byte of the text."""
    tokens = self.encode(text)
    return tokens, np.ones_like(tokens)

  def decode(self, tokens: np.ndarray) -> str:
    """The text of byte tokens; end-of-document tokens are left out, and bytes that do not
    form UTF-8 (a cut multi-byte character) become U+FFFD."""
    tokens = np.asarray(tokens)
    return bytes(tokens[tokens < 256].astype(np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face `tokenizer.json`, read by the `tokenizers` package, with an end-of-document token.

  The end-of-document token is `eod_token` when given; otherwise the first of "<|endoftext|>",
  "<|end_of_text|>", "</s>" and "<eos>" that the tokenizer has; otherwise a new token after the
  tokenizer's last one (`vocab_size` is then one more than the file's). Texts are encoded without
  the tokenizer's own special tokens (no BOS), as packing adds the end-of-document token.

  Attributes:
    path: the `tokenizer.json` file.
    vocab_size: the tokenizer's vocabulary, plus one when the end-of-document token is new.
    eod: the end-of-document token.

  Examples:
    >>> from tokenizers import Tokenizer, models
    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "tokenizer.json"
    >>> Tokenizer(models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="</s>")).save(str(path))
    >>> tokenizer = HFTokenizer(path)
    >>> tokenizer.vocab_size, tokenizer.eod
    (3, 2)
  """

  def __init__(self, path: str | pathlib.Path, eod_token: str | None = None):
    """Reads `path`.

    Raises:
      ImportError: when the `tokenizers` package is missing (`pip install tokenizers`).
      ValueError: naming `tokenizer` when `path` cannot be read as a `tokenizer.json`, or
        `eod_token` when the tokenizer does not have it.
    """
    import tokenizers

    self.path = pathlib.Path(path)
    try:
      self._tokenizer = tokenizers.Tokenizer.from_file(str(self.path))
    except Exception as error:  # tokenizers raises its own `Exception` for a missing or bad file.
      reason = "no such file" if not self.path.is_file() else str(error).splitlines()[0]
      raise ValueError(f"`tokenizer` {str(path)!r} cannot be read as a tokenizer.json: {reason}."
                       ) from None
    size = self._tokenizer.get_vocab_size(with_added_tokens=True)
    if eod_token is not None:
      eod = self._tokenizer.token_to_id(eod_token)
      if eod is None:
        raise ValueError(f"`eod_token` {eod_token!r} is not a token of {str(path)!r}.")
    else:
      eod = next((i for i in map(self._tokenizer.token_to_id, EOD_NAMES) if i is not None), size)
    self.eod = eod
    self.vocab_size = max(size, eod + 1)

  def __repr__(self) -> str:
    return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, eod={self.eod})"

  def encode(self, text: str) -> np.ndarray:
    """`(n,)` int32 tokens of `text`, without special tokens added."""
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_counted(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, text_bytes)`: each token stands for the bytes from the previous token's end to
    its own end (its span's end in the text); the last token also takes any bytes after it that
    the tokenizer's normaliser dropped, and a character split over several tokens counts in the
    first. The counts sum to `len(text.encode())` when the text has a token."""
    encoding = self._tokenizer.encode(text, add_special_tokens=False)
    tokens = np.asarray(encoding.ids, np.int32)
    if not tokens.size:
      return tokens, np.zeros(0, np.int32)
    code_points = np.frombuffer(text.encode("utf-32-le"), np.uint32)
    widths = 1 + (code_points >= 0x80) + (code_points >= 0x800) + (code_points >= 0x10000)
    byte_ends = np.concatenate([[0], np.cumsum(widths)])
    ends = np.maximum.accumulate(byte_ends[[end for _, end in encoding.offsets]])
    ends[-1] = byte_ends[-1]
    return tokens, np.diff(ends, prepend=0).astype(np.int32)

  def decode(self, tokens: np.ndarray) -> str:
    """The text of `tokens`; end-of-document tokens are left out."""
    tokens = np.asarray(tokens)
    return self._tokenizer.decode([int(t) for t in tokens if t != self.eod],
                                  skip_special_tokens=False)


def until_the_end(tokens: np.ndarray, eod: int) -> np.ndarray:
  """The generated `tokens` `(n,)` before the first end-of-document token `eod` (all of them
  when there is none)."""
  tokens = np.asarray(tokens)
  ends = np.flatnonzero(tokens == eod)
  return tokens[:ends[0] if ends.size else len(tokens)]


def load_tokenizer(path: str | pathlib.Path | None = None, eod_token: str | None = None
                   ) -> ByteTokenizer | HFTokenizer:
  """The tokenizer of a `tokenizer.json` file (`HFTokenizer`), or bytes (`ByteTokenizer`) for None.

  Raises:
    ValueError: naming `eod_token` when given without a `tokenizer` file, or as `HFTokenizer`.
  """
  if path is None:
    if eod_token is not None:
      raise ValueError(f"`eod_token` {eod_token!r} needs a `tokenizer` file; the byte tokenizer's "
                       "end-of-document token is 256.")
    return ByteTokenizer()
  return HFTokenizer(path, eod_token)

