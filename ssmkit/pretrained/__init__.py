"""Published checkpoints in Hugging Face format, loaded into ssmkit's models."""

from ssmkit._src.pretrained.files import CheckpointError
from ssmkit._src.pretrained.load import ARCHITECTURES, load
from ssmkit._src.pretrained.save import save
from ssmkit._src.pretrained.text import complete, tokenizer

__all__ = ["ARCHITECTURES", "CheckpointError", "complete", "load", "save", "tokenizer"]
