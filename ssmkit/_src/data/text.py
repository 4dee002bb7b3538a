"""Text for language models: documents from files, a split by document, packing into rows.

A corpus is a list of documents (one per file). Each is tokenised, preceded by the
end-of-document token, and the documents are concatenated and cut into rows of a fixed
length: no padding. The end-of-document token at each document's start is a `reset` for every
layer, so no document sees another: a recurrent state, a convolution window or attention
carried from one document into the next is the silent bug packing otherwise brings, and a
model's loss on packed rows equals its loss on each document alone.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import pathlib
import sysconfig

import numpy as np

from ssmkit._src.data.arguments import check_fraction, check_int
from ssmkit._src.data.dataset import SequenceDataset
from ssmkit._src.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer


@dataclasses.dataclass(frozen=True)
class Document:
  """One document of a corpus.

  Attributes:
    name: where it comes from (a path relative to the corpus root), which decides its split.
    text: its text.
  """

  name: str
  text: str


# Folders of the standard library left out of the default corpus: installed packages, and the
# test suites (some of their files are deliberately not UTF-8).
_LEFT_OUT = frozenset({"site-packages", "test", "tests", "idle_test"})


def stdlib_root() -> pathlib.Path:
  """The standard library folder (`Lib`) of the running interpreter."""
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _files(path: str | pathlib.Path | None) -> tuple[pathlib.Path, list[pathlib.Path]]:
  """The corpus root and its files, sorted; the standard library's `.py` files for None."""
  if path is None:
    root = stdlib_root()
    return root, sorted(f for f in root.rglob("*.py")
                        if not _LEFT_OUT.intersection(f.relative_to(root).parts) and f.is_file())
  text = str(path)
  candidate = pathlib.Path(text)
  if candidate.is_file():
    return candidate.parent, [candidate]
  if candidate.is_dir():
    return candidate, sorted(f for f in candidate.rglob("*") if f.is_file())
  matches = sorted(pathlib.Path(m) for m in glob.glob(text, recursive=True))
  files = [m for m in matches if m.is_file()]
  if not files:
    raise ValueError(f"`path` {text!r} is neither a file, a folder nor a glob that matches files.")
  prefix = text.split("*")[0].split("?")[0].split("[")[0]
  root = pathlib.Path(prefix) if prefix.endswith(("/", "\\")) else pathlib.Path(prefix).parent
  return root, files


def read_documents(path: str | pathlib.Path | None = None) -> list[Document]:
  """The documents of a text file, a folder (every file under it) or a glob, one per file.

  Args:
    path: a file, a folder or a glob pattern (`**` reaches into subfolders); None for the
      Python standard library's source files of the running interpreter (`Lib/**/*.py`
      without `site-packages` and the test suites: about 730 files and 12 MB of real code,
      on every machine that runs ssmkit).

  Returns:
    The non-empty documents, sorted by name (the path relative to the folder or the glob's
    fixed prefix).

  Raises:
    ValueError: naming `path` when it matches no file or no file holds text, or naming a
      file that is not UTF-8 text.

  Examples:
    >>> from ssmkit.data import read_documents
    >>> from ssmkit._src.data.text import stdlib_root
    >>> [d.name for d in read_documents(f"{stdlib_root()}/json/*.py") if d.name.startswith("d")]
    ['decoder.py']
  """
  root, files = _files(path)
  documents = []
  for file in files:
    try:
      text = file.read_bytes().decode("utf-8")
    except UnicodeDecodeError as error:
      raise ValueError(f"`path`: {str(file)!r} is not UTF-8 text ({error.reason} at byte "
                       f"{error.start}); point `path` at text files, e.g. with a glob.") from None
    if text:
      name = file.relative_to(root).as_posix() if file.is_relative_to(root) else file.as_posix()
      documents.append(Document(name, text))
  if not documents:
    raise ValueError(f"`path` {str(path)!r} holds no text: "
                     + (f"every one of its {len(files)} files is empty." if files
                        else "it is an empty folder."))
  return documents


def _name_hash(name: str) -> float:
  """The SHA-256 of `name` as a number in [0, 1)."""
  return int.from_bytes(hashlib.sha256(name.encode("utf-8")).digest()[:8], "big") / 2**64


def in_validation(name: str, fraction: float) -> bool:
  """Whether the document called `name` belongs to the validation split of `fraction`.

  Decided by a hash of the name alone (its SHA-256 as a number in [0, 1)), so a document keeps
  its split whatever the other documents, their order, the batch size or the device count.
  """
  return _name_hash(name) < fraction


def split_documents(documents: list[Document], validation_fraction: float = 0.05
                    ) -> tuple[list[Document], list[Document]]:
  """`(train, validation)`: each document in one of them, by `in_validation` of its name.

  A corpus too small for the fraction to hold out any document (or to leave any to train on)
  still gets both splits: the document whose name hashes lowest is held out (or the one that
  hashes highest trained on), so a few documents train with the default fraction.

  Raises:
    ValueError: naming `validation_fraction` outside (0, 1), or `path` when it holds a single
      document, which cannot be split.
  """
  check_fraction(validation_fraction, "validation_fraction")
  if len(documents) < 2:
    raise ValueError(f"`path` holds {len(documents)} document, which cannot be split into train "
                     "and validation documents: give it two or more files.")
  train, validation = [], []
  for document in documents:
    (validation if in_validation(document.name, validation_fraction) else train).append(document)
  order = lambda d: _name_hash(d.name)
  if not validation:
    validation.append(train.pop(train.index(min(train, key=order))))
  if not train:
    train.append(validation.pop(validation.index(max(validation, key=order))))
  return train, validation


@dataclasses.dataclass(frozen=True, eq=False)
class PackedTokens:
  """Rows of next-token prediction cut from documents concatenated without padding.

  Attributes:
    inputs: `(N, L)` int32 tokens.
    targets: `(N, L)` int32: the token after each input (`inputs` shifted by one step in the
      concatenated stream).
    reset: `(N, L)` bool: True at each document's first step (its end-of-document token).
    target_bytes: `(N, L)` int32: the bytes of text each target stands for (0 for the
      end-of-document token), the denominator of bits per byte.
  """

  inputs: np.ndarray
  targets: np.ndarray
  reset: np.ndarray
  target_bytes: np.ndarray


def pack_documents(documents: list[np.ndarray], seq_len: int, eod: int,
                   text_bytes: list[np.ndarray] | None = None) -> PackedTokens:
  """Concatenates `[eod, *document]` for each tokenised document and cuts rows of `seq_len`.

  Row i reads the stream's steps `[i L, (i + 1) L)` and predicts steps `[i L + 1, (i + 1) L]`;
  the steps left over at the end (fewer than a row) are dropped. A document's first input is
  `eod`, with `reset` True: from it the model predicts the document's first token with no
  context, and at the document's last token it predicts the next `eod`, the end of the
  document. A row may start inside a document; it then starts from the zero state there.

  Args:
    documents: `(n_i,)` integer token arrays.
    seq_len: steps per row L, at least 2.
    eod: the end-of-document token.
    text_bytes: `(n_i,)` bytes of text per token of each document (a tokenizer's
      `encode_counted`); None: one byte per token.

  Returns:
    The `PackedTokens` of every whole row.

  Raises:
    ValueError: naming `seq_len` below 2 or longer than the whole stream, or `text_bytes`
      whose shapes differ from the documents'.
  """
  check_int(seq_len, "seq_len", minimum=2)
  if text_bytes is None:
    text_bytes = [np.ones(np.shape(d), np.int32) for d in documents]
  elif [np.shape(b) for b in text_bytes] != [np.shape(d) for d in documents]:
    raise ValueError("`text_bytes` must hold one count per token of each document.")
  stream = _concatenate([np.concatenate([[eod], d]) for d in documents])
  weights = _concatenate([np.concatenate([[0], b]) for b in text_bytes])
  rows = (len(stream) - 1) // seq_len
  if rows < 1:
    raise ValueError(f"`seq_len`={seq_len} is longer than the {len(stream)} tokens of the "
                     f"{len(documents)} document(s) less one: not one whole row.")
  cut = lambda values, start: values[start:start + rows * seq_len].reshape(rows, seq_len)
  starts = np.zeros(len(stream), bool)
  starts[np.cumsum([0, *(len(d) + 1 for d in documents[:-1])])] = True
  return PackedTokens(inputs=cut(stream, 0), targets=cut(stream, 1), reset=cut(starts, 0),
                      target_bytes=cut(weights, 1))


def _concatenate(pieces: list[np.ndarray]) -> np.ndarray:
  """The int32 concatenation of `pieces`, empty for none."""
  return np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)


# `eq=False`, as for `SequenceDataset`: datasets compare by identity.
@dataclasses.dataclass(frozen=True, eq=False)
class TextDataset(SequenceDataset):
  """A `SequenceDataset` of packed text, with its tokenizer and the bytes behind the test targets.

  Attributes:
    tokenizer: the tokenizer of the tokens (`ByteTokenizer` or `HFTokenizer`).
    target_bytes_test: `(M, L)` int32 bytes of text per test target (`PackedTokens.target_bytes`):
      bits per byte are the summed loss in bits over their sum.
  """

  tokenizer: Tokenizer = dataclasses.field(default_factory=ByteTokenizer)
  target_bytes_test: np.ndarray | None = None

  def __post_init__(self) -> None:
    super().__post_init__()
    if self.target_bytes_test is None or self.target_bytes_test.shape != self.y_test.shape:
      raise ValueError(f"`target_bytes_test` must be an array of the shape of `y_test`, "
                       f"{self.y_test.shape}.")


def text(*, path: str | None = None, seq_len: int = 256, validation_fraction: float = 0.05,
         tokenizer: str | None = None, eod_token: str | None = None) -> TextDataset:
  """Next-token prediction on a text corpus: packed rows of tokens, documents kept apart by resets.

  The documents of `path` (`read_documents`; by default the Python standard library's code)
  are split by name (`split_documents`), tokenised (UTF-8 bytes, `ByteTokenizer`, or the
  `tokenizer.json` of `tokenizer`, `HFTokenizer`) and packed into rows of `seq_len`
  (`pack_documents`). Each target is the next token; each document's first step is a reset
  (`reset_train`, `reset_test`), which `ssmkit train` passes to the model. Test accuracy is
  next-token accuracy; the bytes of text behind each test target give bits per byte.

  Args:
    path: a text file, a folder or a glob; None for the standard library's source files.
    seq_len: steps per row, at least 2.
    validation_fraction: the fraction of documents held out, by a hash of each name.
    tokenizer: a `tokenizer.json` file; None for bytes.
    eod_token: the end-of-document token's name in `tokenizer` (see `HFTokenizer`).

  Returns:
    A `TextDataset` of `(N, seq_len)` int32 tokens and targets with `vocab_size` and
    `num_classes` the tokenizer's.

  Raises:
    ValueError: naming `path`, `seq_len`, `validation_fraction`, `tokenizer` or `eod_token`.
  """
  coder = load_tokenizer(tokenizer, eod_token)
  train, test = (_pack([coder.encode_counted(d.text) for d in split], seq_len, coder.eod, name)
                 for split, name in zip(split_documents(read_documents(path), validation_fraction),
                                        ("train", "validation"), strict=True))
  return TextDataset(x_train=train.inputs, y_train=train.targets, x_test=test.inputs,
                     y_test=test.targets, num_classes=coder.vocab_size, vocab_size=coder.vocab_size,
                     reset_train=train.reset, reset_test=test.reset, tokenizer=coder,
                     target_bytes_test=test.target_bytes)


def _pack(encoded: list[tuple[np.ndarray, np.ndarray]], seq_len: int, eod: int,
          split: str) -> PackedTokens:
  """`pack_documents` of the `(tokens, text_bytes)` pairs of the `split` split.

  Raises:
    ValueError: naming the split and the arguments to change when it holds no whole row.
  """
  check_int(seq_len, "seq_len", minimum=2)
  tokens = sum(len(t) + 1 for t, _ in encoded)
  if tokens - 1 < seq_len:
    raise ValueError(f"the {split} split holds {tokens} tokens in {len(encoded)} document(s), "
                     f"fewer than one row of `seq_len`={seq_len} and its next token: lower "
                     "`seq_len`, give `path` more text, or move the split with "
                     "`validation_fraction`.")
  return pack_documents([t for t, _ in encoded], seq_len, eod, [b for _, b in encoded])
