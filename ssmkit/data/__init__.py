"""Offline sequence datasets and synthetic long-range tasks as NumPy arrays, in train and test splits;
text corpora as documents, tokens (bytes or a tokenizer.json) and packed rows."""

from ssmkit._src.data.dataset import SequenceDataset
from ssmkit._src.data.digits import sequential_digits
from ssmkit._src.data.induction_heads import induction_heads
from ssmkit._src.data.listops import listops
from ssmkit._src.data.mnist1d import mnist1d
from ssmkit._src.data.mqar import mqar
from ssmkit._src.data.registry import load
from ssmkit._src.data.selective_copying import selective_copying
from ssmkit._src.data.text import (
    Document,
    PackedTokens,
    TextDataset,
    in_validation,
    pack_documents,
    read_documents,
    split_documents,
    text,
)
from ssmkit._src.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "Document",
    "HFTokenizer",
    "PackedTokens",
    "SequenceDataset",
    "TextDataset",
    "Tokenizer",
    "in_validation",
    "induction_heads",
    "listops",
    "load",
    "load_tokenizer",
    "mnist1d",
    "mqar",
    "pack_documents",
    "read_documents",
    "selective_copying",
    "sequential_digits",
    "split_documents",
    "text",
]
