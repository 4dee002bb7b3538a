"""Offline sequence datasets and synthetic long-range tasks as NumPy arrays, in train and test splits;
text corpora as documents, byte tokens and packed rows."""

from ssmkit._src.data.dataset import SequenceDataset
from ssmkit._src.data.digits import sequential_digits
from ssmkit._src.data.induction_heads import induction_heads
from ssmkit._src.data.listops import listops
from ssmkit._src.data.mnist1d import mnist1d
from ssmkit._src.data.mqar import mqar
from ssmkit._src.data.registry import load
from ssmkit._src.data.selective_copying import selective_copying
from ssmkit._src.data.text import (
    ByteTokenizer,
    Document,
    PackedTokens,
    in_validation,
    pack_documents,
    read_documents,
    split_documents,
    text,
)

__all__ = [
    "ByteTokenizer",
    "Document",
    "PackedTokens",
    "SequenceDataset",
    "in_validation",
    "induction_heads",
    "listops",
    "load",
    "mnist1d",
    "mqar",
    "pack_documents",
    "read_documents",
    "selective_copying",
    "sequential_digits",
    "split_documents",
    "text",
]
