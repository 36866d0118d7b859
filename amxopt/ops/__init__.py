"""amxopt ops: importing this package registers ``torch.ops.amxopt.*`` (and loads the C++ kernels)."""

from amxopt.ops import library, native, providers, reference
from amxopt.ops.library import ACTIVATIONS, DTYPES, AmxOpError

__all__ = ["ACTIVATIONS", "DTYPES", "AmxOpError", "library", "native", "providers", "reference"]
