"""amxopt ops: importing this package registers ``torch.ops.amxopt.*``."""

from amxopt.ops import library, providers, reference
from amxopt.ops.library import ACTIVATIONS, AmxOpError

__all__ = ["ACTIVATIONS", "AmxOpError", "library", "providers", "reference"]
