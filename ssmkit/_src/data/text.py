"""Text for language models: documents from files, a byte tokenizer, a split by document, packing.

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
    >>> documents = read_documents()
    >>> any(d.name == "json/decoder.py" for d in documents)
    True
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
    raise ValueError(f"`path` {str(path)!r} holds no text: its {len(files)} file(s) are empty.")
  return documents


def in_validation(name: str, fraction: float) -> bool:
  """Whether the document called `name` belongs to the validation split of `fraction`.

  Decided by a hash of the name alone (its SHA-256 as a number in [0, 1)), so a document keeps
  its split whatever the other documents, their order, the batch size or the device count.
  """
  digest = hashlib.sha256(name.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_documents(documents: list[Document], validation_fraction: float = 0.05
                    ) -> tuple[list[Document], list[Document]]:
  """`(train, validation)`: each document in one of them, by `in_validation` of its name.

  Raises:
    ValueError: naming `validation_fraction` outside (0, 1), or when a split would be empty.
  """
  check_fraction(validation_fraction, "validation_fraction")
  train, validation = [], []
  for document in documents:
    (validation if in_validation(document.name, validation_fraction) else train).append(document)
  if not train or not validation:
    raise ValueError(f"`validation_fraction`={validation_fraction} leaves the "
                     f"{'train' if not train else 'validation'} split of {len(documents)} "
                     "document(s) empty: give more documents or another fraction.")
  return train, validation


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

  def decode(self, tokens: np.ndarray) -> str:
    """The text of byte tokens; end-of-document tokens are left out, and bytes that do not
    form UTF-8 (a cut multi-byte character) become U+FFFD."""
    tokens = np.asarray(tokens)
    return bytes(tokens[tokens < 256].astype(np.uint8)).decode("utf-8", errors="replace")


@dataclasses.dataclass(frozen=True, eq=False)
class PackedTokens:
  """Rows of next-token prediction cut from documents concatenated without padding.

  Attributes:
    inputs: `(N, L)` int32 tokens.
    targets: `(N, L)` int32: the token after each input (`inputs` shifted by one step in the
      concatenated stream).
    reset: `(N, L)` bool: True at each document's first step (its end-of-document token).
  """

  inputs: np.ndarray
  targets: np.ndarray
  reset: np.ndarray


def pack_documents(documents: list[np.ndarray], seq_len: int, eod: int) -> PackedTokens:
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

  Returns:
    The `PackedTokens` of every whole row.

  Raises:
    ValueError: naming `seq_len` below 2 or longer than the whole stream.
  """
  check_int(seq_len, "seq_len", minimum=2)
  pieces = [np.concatenate([[eod], np.asarray(d, np.int32)]) for d in documents]
  stream = np.concatenate(pieces).astype(np.int32) if pieces else np.zeros(0, np.int32)
  rows = (len(stream) - 1) // seq_len
  if rows < 1:
    raise ValueError(f"`seq_len`={seq_len} is longer than the {len(stream)} tokens of the "
                     f"{len(documents)} document(s) less one: not one whole row.")
  cut = lambda start: stream[start:start + rows * seq_len].reshape(rows, seq_len)
  starts = np.zeros(len(stream), bool)
  starts[np.cumsum([0, *map(len, pieces[:-1])])] = True
  return PackedTokens(inputs=cut(0), targets=cut(1),
                      reset=starts[:rows * seq_len].reshape(rows, seq_len))


def text(*, path: str | None = None, seq_len: int = 256, validation_fraction: float = 0.05
         ) -> SequenceDataset:
  """Next-byte prediction on a text corpus: packed rows of bytes, documents kept apart by resets.

  The documents of `path` (`read_documents`; by default the Python standard library's code)
  are split by name (`split_documents`), tokenised as bytes (`ByteTokenizer`, 257 tokens) and
  packed into rows of `seq_len` (`pack_documents`). Each target is the next token; each
  document's first step is a reset (`reset_train`, `reset_test`), which `ssmkit train` passes
  to the model. Test accuracy is next-token accuracy, and the test loss in nats per token
  over ln 2 is bits per token (per byte but for the end-of-document tokens).

  Args:
    path: a text file, a folder or a glob; None for the standard library's source files.
    seq_len: steps per row, at least 2.
    validation_fraction: the fraction of documents held out, by a hash of each name.

  Returns:
    A `SequenceDataset` of `(N, seq_len)` int32 tokens and targets with `vocab_size` and
    `num_classes` 257.

  Raises:
    ValueError: naming `path`, `seq_len` or `validation_fraction` (see the functions above).
  """
  tokenizer = ByteTokenizer()
  train, test = (pack_documents([tokenizer.encode(d.text) for d in split], seq_len, tokenizer.eod)
                 for split in split_documents(read_documents(path), validation_fraction))
  return SequenceDataset(x_train=train.inputs, y_train=train.targets, x_test=test.inputs,
                         y_test=test.targets, num_classes=tokenizer.vocab_size,
                         vocab_size=tokenizer.vocab_size, reset_train=train.reset,
                         reset_test=test.reset)

