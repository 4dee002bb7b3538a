"""Published checkpoints in Hugging Face format, loaded into ssmkit's models."""

from ssmkit._src.pretrained.files import CheckpointError
from ssmkit._src.pretrained.load import ARCHITECTURES, load
from ssmkit._src.pretrained.save import save

__all__ = ["ARCHITECTURES", "CheckpointError", "load", "save"]
