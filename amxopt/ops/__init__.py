"""amxopt ops: importing this package registers ``torch.ops.amxopt.*`` (and loads the C++ kernels)."""

from amxopt.ops import library, native, providers, reference
from amxopt.ops.library import ACTIVATIONS, AmxOpError

__all__ = ["ACTIVATIONS", "AmxOpError", "library", "native", "providers", "reference"]
