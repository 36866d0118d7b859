"""Building a zoo model: construction in the target dtype without init, then a seeded init.

A model is created directly in ``dtype`` (as ``from_pretrained(torch_dtype=dtype)`` would, keep-in-fp32
modules included) and filled with a fast, checkpoint-like init: N(0, 0.02) for Linear/Conv/Embedding
weights and other free parameters, zeros for biases, ones for norm weights.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from amxopt.models.spec import INIT_STD, Family, ModelSpec

_ATTN_IMPLEMENTATION = "sdpa"

# Fraction of MemAvailable a model may take before build_model refuses to build it.
_MEMORY_HEADROOM = 0.9
_MEMORY_CHECK_MIN_BYTES = 1 << 30


# A build sets what is the process's: torch's default dtype, and (amxopt.load) nn.Module's
# register_parameter. One build at a time, so that two threads' settings never interleave: each is
# undone to what it replaced.
BUILD_LOCK = threading.RLock()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    with BUILD_LOCK:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)


def _keep_fp32_names(cls: type[torch.nn.Module], dtype: torch.dtype) -> list[str]:
    """Module names ``from_pretrained(torch_dtype=dtype)`` would keep in fp32 for ``cls``."""
    if dtype == torch.float32:
        return []
    from transformers import PreTrainedModel

    names: list[str] = []
    if issubclass(cls, PreTrainedModel):
        # transformers: the non-strict list only applies to fp16, the strict one to fp16 and bf16.
        if dtype == torch.float16:
            names += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
        if dtype in (torch.float16, torch.bfloat16):
            names += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    else:
        # diffusers: `_keep_in_fp32_modules` applies to any torch_dtype.
        names += list(getattr(cls, "_keep_in_fp32_modules", None) or [])
        names += list(getattr(cls, "_keep_in_fp32_modules_strict", None) or [])
    return names


def _matches_module(param_name: str, module_names: Sequence[str]) -> bool:
    """Whether ``param_name`` lies in a module called like one of ``module_names`` (whole dotted
    components, as diffusers' ``module in name.split(".")``)."""
    for module_name in module_names:
        if re.search(rf"(^|\.){re.escape(module_name)}($|\.)", param_name):
            return True
    return False


def construct(family: Family, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """Instantiate ``family``'s class from ``config`` directly in ``dtype`` without running any weight
    init (parameters hold garbage until :func:`reinit`), then upcast the keep-in-fp32 modules."""
    return construct_class(family.model_class(), family.library, config, dtype)


def construct_class(cls: type, library: str, config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """:func:`construct` for any ``transformers`` or ``diffusers`` model class (a whole model too)."""
    if library == "diffusers":
        from diffusers.models.modeling_utils import no_init_weights

        with BUILD_LOCK, no_init_weights(), _default_dtype(dtype):  # (diffusers skips init process-wide)
            model = cls.from_config(dict(config))
    else:
        from transformers.initialization import no_init_weights

        with BUILD_LOCK, no_init_weights():  # (transformers sets the default dtype while it builds)
            model = cls._from_config(config, dtype=dtype, attn_implementation=_ATTN_IMPLEMENTATION)
        model.tie_weights()  # (init does it, which no_init_weights skips: a tied lm_head, as from_pretrained)
    keep = _keep_fp32_names(cls, dtype)
    if keep:
        for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and _matches_module(name, keep):
                tensor.data = tensor.data.to(torch.float32)
    return model


def _is_norm(module: torch.nn.Module) -> bool:
    name = type(module).__name__
    return "Norm" in name or isinstance(module, (torch.nn.LayerNorm, torch.nn.GroupNorm))


@torch.no_grad()
def reinit(model: torch.nn.Module) -> None:
    """Fill every parameter from the global RNG in a dtype-independent way.

    Values are drawn in fp32 in ``named_modules`` order and then cast, so a bf16 build holds exactly
    the bf16 rounding of the fp32 build with the same seed. As in a trained checkpoint, and so that
    a test sees what a rewrite does with them, biases are not zero and norm weights not one: biases
    N(0, 0.1), norm weights N(1, 0.1). A Linear or convolution's weight is N(0, max(0.02,
    1/sqrt(fan_in))), so that a small test model's attention logits are of order 1, not near zero
    (a wrong softmax scale then shows).
    """
    for _, module in model.named_modules():
        norm = _is_norm(module)
        projection = isinstance(module, (torch.nn.Linear, torch.nn.modules.conv._ConvNd))
        for pname, param in module.named_parameters(recurse=False):
            if pname == "bias" or pname.endswith("_bias"):
                mean, std = 0.0, 0.1
            elif norm and pname == "weight":
                mean, std = 1.0, 0.1
            elif projection and pname == "weight" and param.dim() > 1:
                mean, std = 0.0, max(INIT_STD, param[0].numel() ** -0.5)
            else:
                mean, std = 0.0, INIT_STD
            if param.dtype == torch.float32:
                param.normal_(mean, std)
            else:
                param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(mean, std))


def _available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_memory(spec: ModelSpec, family: Family, dtype: torch.dtype) -> None:
    """Raise :class:`MemoryError` up front instead of letting the OOM killer end the process."""
    with torch.device("meta"):
        model = construct(family, spec.config(), dtype)
    needed = sum(t.numel() * t.element_size() for t in model.parameters())
    available = _available_memory()
    if needed < _MEMORY_CHECK_MIN_BYTES or available is None:
        return
    if needed > _MEMORY_HEADROOM * available:
        raise MemoryError(
            f"{spec.name} in {dtype} needs ~{needed / 2**30:.1f} GiB of weights but only "
            f"{available / 2**30:.1f} GiB of memory is available"
        )
