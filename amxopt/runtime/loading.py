"""Weights from disk: ``from_pretrained`` packs while it reads; ``save`` / ``load`` keep the packed form.

``from_pretrained`` builds the model with its parameters on the meta device (buffers, such as rotary
tables, are built for real), then streams each tensor from the memory-mapped safetensors files. A
Linear weight or a patch-embedding kernel (Conv2d/Conv3d with kernel == stride) is packed as it is
read and only its packed copy stays: the parameter becomes a tagged meta placeholder (see
``amxopt/runtime/weights.py``), which the graph's ``pack_weights`` picks up instead of packing.
Every other tensor is loaded as its owner expects (the dtype the class keeps it in).

``save`` writes the packed and the plain tensors to one safetensors file plus ``amxopt.json`` (the
manifest: versions, provider and tier, the model class and config, every tensor's shape and dtype,
the file's size, and each rewritten graph as data, see ``amxopt/runtime/graph_store.py``); ``load``
memory-maps that file (no copy, no packing, nothing unpickled), restores the graphs at their first
use (no capture, no passes) and refuses an artifact that does not match this machine or is damaged, naming the problem.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import math
import mmap
import pathlib
import re
import threading
import uuid
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from amxopt.capture.base import _first_line
from amxopt.config import AmxConfig
from amxopt.files import os_error, replacing, save_tensors
from amxopt.ops import DTYPES, native, packed
from amxopt.ops.providers import resolve
from amxopt.runtime import graph_store
from amxopt.runtime.weights import guard, pack, packable, placeholder

logger = logging.getLogger(__name__)

LAYOUT_VERSION = 2  # of the packed weights (VNNI [N/32][K/2][32][2] + padding, csrc/common.h); bump when it changes
MANIFEST = "amxopt.json"
WEIGHTS = "weights.safetensors"
_PACKED_PREFIX = "packed::"
_BUFFER_PREFIX = "buffer::"  # a buffer left out of the state dict, stored as it differs from the class's own
_SAVE_ID = "amxopt_save_id"  # in the weights file's metadata and the manifest: one save wrote both
_GRAPH_PREFIX = "graph"  # graph{i}::{target}: a tensor only a saved graph reads (a lifted constant)
_GRAPH_TENSOR = re.compile(rf"{_GRAPH_PREFIX}\d+::")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
           "I32": torch.int32, "BOOL": torch.bool, "F64": torch.float64, "U8": torch.uint8, "I8": torch.int8}  # fmt: skip
_NAMES = {v: k for k, v in _DTYPES.items()}


class CheckpointError(ValueError):
    """A checkpoint or saved artifact that cannot be loaded as it is; the message names the tensor or file."""


# --------------------------------------------------------------------------------------------------
# Reading safetensors without copies
# --------------------------------------------------------------------------------------------------


def _read_header(path: pathlib.Path) -> tuple[dict, int, dict]:
    """A safetensors file's tensor entries (each checked: a known dtype, a shape, and a span of the file
    exactly that many bytes), where its data starts, and its ``__metadata__``."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            size = path.stat().st_size
            if n <= 0 or 8 + n > size:
                raise CheckpointError(f"amxopt: {path} is truncated or not a safetensors file (header of {n} bytes)")
            header = json.loads(f.read(n))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"amxopt: cannot read {path}: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"amxopt: {path} is not a safetensors file (its header holds no object)")
    metadata = header.pop("__metadata__", None) or {}
    for name, info in header.items():
        _check_span(path, name, info)
    end = max((info["data_offsets"][1] for info in header.values()), default=0)
    if 8 + n + end > size:
        raise CheckpointError(f"amxopt: {path} is truncated: its header needs {8 + n + end} bytes, the file has {size}")
    return header, 8 + n, metadata if isinstance(metadata, dict) else {}


def _check_span(path: pathlib.Path, name: str, info: Any) -> None:
    def whole(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    entry = info if isinstance(info, dict) else {}
    shape, span, dtype = entry.get("shape"), entry.get("data_offsets"), entry.get("dtype")
    if not (isinstance(shape, list) and all(map(whole, shape)) and isinstance(span, list) and len(span) == 2):
        raise CheckpointError(f"amxopt: {path}: the header's entry for tensor {name} is damaged: {info!r}")
    if dtype not in _DTYPES:
        raise CheckpointError(f"amxopt: {path}: tensor {name} has dtype {dtype}, which amxopt cannot load")
    need = math.prod(shape) * _DTYPES[dtype].itemsize
    if not (all(map(whole, span)) and span[1] - span[0] == need):
        raise CheckpointError(
            f"amxopt: {path}: tensor {name} ({dtype} {shape}) needs {need} bytes, but the header gives it bytes "
            f"{span} of the data: the file is damaged"
        )


class MappedFile:
    """Every tensor of a safetensors file as a view of one private (copy-on-write) memory map.

    ``drop(name)`` tells the kernel a tensor's pages are no longer needed (``MADV_DONTNEED``), so a
    loader that reads each tensor once keeps at most one tensor's pages resident, not the file's.
    """

    def __init__(self, path: pathlib.Path) -> None:
        header, start, self.metadata = _read_header(path)
        self._map = None
        self._spans: dict[str, tuple[int, int]] = {}
        self.tensors: dict[str, torch.Tensor] = {}
        if header:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        for name, info in header.items():
            dtype = _DTYPES[info["dtype"]]
            lo, hi = (start + o for o in info["data_offsets"])
            flat = torch.frombuffer(self._map, dtype=torch.uint8, count=hi - lo, offset=lo) if hi > lo else None
            self.tensors[name] = (flat.view(dtype) if flat is not None else torch.empty(0, dtype=dtype)).reshape(
                info["shape"]
            )
            self._spans[name] = (lo, hi)

    def drop(self, name: str) -> None:
        lo, hi = self._spans[name]
        page = mmap.PAGESIZE
        lo, hi = -(-lo // page) * page, hi // page * page  # whole pages only: neighbours may share the edges
        if self._map is not None and hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)


def mmap_safetensors(path: pathlib.Path) -> dict[str, torch.Tensor]:
    return MappedFile(path).tensors


def _checkpoint(path: pathlib.Path, stem: str) -> dict[str, MappedFile]:
    """Tensor name -> the mapped file holding it, for a ``save_pretrained`` directory (one file, or
    shards with an index)."""
    index, single = path / f"{stem}.safetensors.index.json", path / f"{stem}.safetensors"
    # The order each library reads them in: transformers the single file first (a sharded save
    # overwritten by a single-file one leaves the old index behind), diffusers the index first.
    if index.exists() and not (single.exists() and stem == "model"):
        weight_map = json.loads(index.read_text())["weight_map"]
        files: dict[str, MappedFile] = {}
        for shard in sorted(set(weight_map.values())):
            if not (path / shard).exists():
                names = sorted(k for k, v in weight_map.items() if v == shard)
                raise CheckpointError(
                    f"amxopt: shard {shard} of {path} is missing ({len(names)} tensors, e.g. {names[:3]})"
                )
            mapped = MappedFile(path / shard)
            files.update(dict.fromkeys(mapped.tensors, mapped))
        return files
    if not single.exists():
        pickled = sorted(p.name for p in path.glob("*.bin"))
        also = (
            f" ({', '.join(pickled)}: amxopt reads safetensors only; save_pretrained writes them by default)"
            if pickled
            else ""
        )
        raise CheckpointError(f"amxopt: {path} has neither {single.name} nor {index.name}{also}")
    mapped = MappedFile(single)
    return dict.fromkeys(mapped.tensors, mapped)


# --------------------------------------------------------------------------------------------------
# Building without weights
# --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _parameters_on_meta():
    """Parameters this thread registers inside go to the meta device; buffers (rotary tables, ...)
    stay real, and so do the modules other threads build meanwhile."""
    from amxopt.models.build import BUILD_LOCK

    with BUILD_LOCK:
        register, builder = nn.Module.register_parameter, threading.get_ident()

        def on_meta(module, name, param):
            register(module, name, param)
            if param is not None and threading.get_ident() == builder:
                p = module._parameters[name]
                module._parameters[name] = type(p)(p.to("meta"), requires_grad=False)

        nn.Module.register_parameter = on_meta
        try:
            yield
        finally:
            nn.Module.register_parameter = register


def _is_transformers(cls: type) -> bool:
    from transformers import PreTrainedModel

    return issubclass(cls, PreTrainedModel)


def _build_empty(cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    from amxopt import models

    with _parameters_on_meta():
        if _is_transformers(cls):
            from transformers.initialization import no_init_weights

            with no_init_weights():
                model = cls._from_config(config, dtype=dtype, attn_implementation="sdpa")
        else:
            from diffusers.models.modeling_utils import no_init_weights

            with no_init_weights(), models._default_dtype(dtype):
                model = cls.from_config(config)
    if hasattr(model, "tie_weights"):  # transformers ties (e.g. UMT5's shared embedding) when it loads
        model.tie_weights()
    keep = models._keep_fp32_names(cls, dtype)
    for name, p in model.named_parameters():
        if p.is_floating_point():
            want = torch.float32 if keep and models._matches_module(name, keep) else dtype
            if p.dtype != want:
                _set(model, name, nn.Parameter(torch.empty(p.shape, dtype=want, device="meta"), requires_grad=False))
    return model.eval()


def _config_of(cls: type, path: pathlib.Path) -> Any:
    if _is_transformers(cls):
        return cls.config_class.from_pretrained(path)
    return cls.load_config(path)


def _config_dict(model: nn.Module) -> dict:
    config = getattr(model, "config", None)
    if config is None:
        raise RuntimeError(
            f"amxopt: save covers transformers and diffusers models, which load rebuilds from their config; "
            f"{type(model).__name__} has none: save its state_dict before optimizing it (or optimize with "
            "AmxConfig(keep_source=True) and save opt.state_dict())"
        )
    return config.to_dict() if hasattr(config, "to_dict") and _is_transformers(type(model)) else dict(config)


def _config_from_dict(cls: type, values: dict) -> Any:
    return cls.config_class.from_dict(values) if _is_transformers(cls) else values


# --------------------------------------------------------------------------------------------------
# Assigning tensors
# --------------------------------------------------------------------------------------------------


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner, _, attr = name.rpartition(".")
    return (model.get_submodule(owner) if owner else model), attr


def _set(model: nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Put ``tensor`` under ``name`` (wrapped as a Parameter where the slot is one); returns what was
    put, which the other names of a tied tensor must then get (one object, as the model had)."""
    module, attr = _owner(model, name)
    if attr in module._parameters:
        if not isinstance(tensor, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=False)
        module._parameters[attr] = tensor
    else:
        module._buffers[attr] = tensor
    return tensor


def _expected(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a checkpoint must hold: parameters and persistent buffers by name (tied names share a tensor)."""
    return dict(model.state_dict(keep_vars=True))


def _unsaved_buffers(model: nn.Module, expected: dict) -> set[str]:
    """The buffers the model leaves out of its state dict (rotary tables): a checkpoint may hold them
    all the same, and the libraries skip them with a warning (the model computes its own)."""
    return {n for n, _ in model.named_buffers()} - set(expected)


def _check_keys(
    expected: dict, found, where: str, hint: Callable[[list[str]], str] | None = None, ignore: tuple = ()
) -> dict[str, str]:
    """For each expected name, the stored name to read it from (a tied group needs only one stored name).
    ``hint(unexpected names)`` may add to the error what would explain them. Stored names that match a
    pattern of ``ignore`` (the class's ``_keys_to_ignore_on_load_unexpected``, as its library reads
    them with ``re.search``) are not unexpected."""
    by_tensor: dict[int, list[str]] = {}
    for name, t in expected.items():
        by_tensor.setdefault(id(t), []).append(name)
    source, missing = {}, []
    for names in by_tensor.values():
        stored = next((n for n in names if n in found), None)
        if stored is None:
            missing += names
        source.update(dict.fromkeys(names, stored))
    unexpected = sorted(k for k in set(found) - set(expected) if not any(re.search(p, k) for p in ignore))
    if missing or unexpected:
        raise CheckpointError(
            f"amxopt: {where} does not match the model: missing {len(missing)} tensor(s) {sorted(missing)[:5]}, "
            f"unexpected {len(unexpected)} {unexpected[:5]}{hint(unexpected) if hint else ''}"
        )
    return source


def _converted(model: nn.Module, unexpected: list[str]) -> list[str]:
    """The stored names (of ``unexpected``) that transformers 5 converts as it loads ``model``: it
    renames or merges some models' tensors (Qwen3-Omni's MoE experts, stored one by one, become one
    tensor per layer) and writes them back in the original layout, so such a checkpoint does not
    match the module names. Every model has some generic renames (``LayerNorm.gamma``), so only
    names present in the checkpoint count."""
    if not unexpected or not _is_transformers(type(model)):
        return []
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = get_model_conversion_mapping(model)
        return [k for k in unexpected if any(c.compiled_sources.search(k) for c in conversions)]
    except Exception:  # noqa: BLE001 - an API of transformers' that may move: then nothing is converted
        return []


def _convert(name: str, tensor: torch.Tensor, like: torch.Tensor, where: str) -> torch.Tensor:
    """``tensor`` in ``like``'s dtype (a view when it already is), after checking its shape and kind."""
    if tuple(tensor.shape) != tuple(like.shape):
        raise CheckpointError(
            f"amxopt: {where}: tensor {name} has shape {tuple(tensor.shape)}, the model expects {tuple(like.shape)}"
        )
    if tensor.is_floating_point() != like.is_floating_point():
        raise CheckpointError(f"amxopt: {where}: tensor {name} is {tensor.dtype}, the model expects {like.dtype}")
    return tensor.to(like.dtype)


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def from_pretrained(
    cls: type,
    path: str | pathlib.Path,
    torch_dtype: torch.dtype | dict[str, torch.dtype] = torch.bfloat16,
    config: AmxConfig | None = None,
) -> Any:
    """Build ``cls`` from a local ``save_pretrained`` directory, packing weights as they are read.

    Args:
        cls: a transformers or diffusers model class (e.g. ``Qwen3VLVisionModel``, ``WanTransformer3DModel``),
            or a diffusers pipeline class (``WanPipeline``, or ``DiffusionPipeline`` for the class the
            directory names): then ``transformer``, ``transformer_2`` and the text/image encoders are
            loaded packed and every other part by its own class.
        path: a directory with ``config.json`` and safetensors weights (one file or shards + index), or a
            pipeline directory with ``model_index.json``.
        torch_dtype: the dtype to run in; modules the class keeps in fp32 stay fp32. For a pipeline,
            as diffusers takes it: one dtype for every part, or a dict by part name with a
            ``"default"`` (fp32 without one), e.g. ``{"default": torch.bfloat16, "vae": torch.float32}``.
        config: amxopt options, as for :func:`amxopt.optimize`.

    Returns:
        What :func:`amxopt.optimize` returns for the model (captured at its first call): its packed
        weights are the only copy in memory.

    Raises:
        CheckpointError: a missing shard, a missing or unexpected tensor, a wrong shape or dtype,
            each named; nothing half-loaded is returned.

    Example::

        opt = amxopt.from_pretrained(WanTransformer3DModel, "ckpt/transformer", torch.bfloat16)
    """
    import amxopt

    path = pathlib.Path(path)
    config = config or AmxConfig()
    _refuse_options("amxopt.from_pretrained", config)
    _check_directory(cls, path)
    dtypes = torch_dtype.values() if isinstance(torch_dtype, dict) else [torch_dtype]
    if not dtypes or any(not (isinstance(d, torch.dtype) and d.is_floating_point) for d in dtypes):
        raise ValueError(
            f"amxopt.from_pretrained: torch_dtype must be a floating torch.dtype (torch.bfloat16, torch.float32), or "
            f"for a pipeline a dict of them by part, got {torch_dtype!r}: the weights are packed for the dtype "
            "they run in, so it is named rather than read from the checkpoint ('auto')"
        )
    if isinstance(torch_dtype, dict) and issubclass(cls, nn.Module):
        raise ValueError(
            f"amxopt.from_pretrained: a dict of dtypes names a pipeline's parts; {cls.__name__} is one model: "
            "pass one torch.dtype"
        )
    config = dataclasses.replace(config, provider=resolve(config.provider))
    if (path / "model_index.json").exists():
        return amxopt.optimize(_load_pipeline(cls, path, torch_dtype, config.provider), config=config)
    return amxopt.optimize(_load_model(cls, path, torch_dtype, config.provider), config=config)


def _check_directory(cls: type, path: pathlib.Path) -> None:
    """Before anything is read: a directory of the kind ``cls`` loads (a pipeline's or a model's, of
    this model type), so that a wrong one fails at once, by name, not after packing gigabytes."""
    if not path.is_dir():
        raise CheckpointError(f"amxopt: {path} is not a directory (from_pretrained reads local save_pretrained output)")
    pipeline = (path / "model_index.json").exists()
    if pipeline != (not issubclass(cls, nn.Module)):
        kind = "a pipeline directory (model_index.json)" if pipeline else "a model directory"
        wanted = "a pipeline class" if pipeline else "a model class"
        raise CheckpointError(f"amxopt: {path} is {kind}, and {cls.__name__} is not {wanted}")
    if pipeline:
        return
    if not (path / "config.json").exists():
        saved = " (amxopt.json: an artifact of opt.save, which amxopt.load reads)" if (path / MANIFEST).exists() else ""
        raise CheckpointError(f"amxopt: {path} has no config.json{saved}")
    stored = json.loads((path / "config.json").read_text())
    library, other = ("transformers", "diffusers") if _is_transformers(cls) else ("diffusers", "transformers")
    if not stored.get(_TYPE_KEY[library]) and stored.get(_TYPE_KEY[other]):
        raise CheckpointError(f"amxopt: {path} holds a {other} model, and {cls.__name__} is a {library} class")
    found = _other_type(cls, stored)
    if library == "diffusers" and found:  # transformers warns itself
        logger.warning("amxopt: %s holds a %s, read as %s", path, found, cls.__name__)


# Where a saved config names its model: transformers' model type, diffusers' class.
_TYPE_KEY = {"transformers": "model_type", "diffusers": "_class_name"}


def _other_type(cls: type, stored: dict) -> str | None:
    """The model type (transformers) or class (diffusers) a saved config (``stored``) names, where ``cls`` is
    not of it. Read as the library reads it: another type of the same library may load (Qwen3-VL's
    vision config once said qwen3_vl; a user's diffusers subclass), and where it does not, the
    build or the tensor names fail before anything is packed, saying this."""
    if _is_transformers(cls):
        found, expected = stored.get("model_type"), {getattr(cls.config_class, "model_type", None)} - {None, ""}
    else:
        found, expected = stored.get("_class_name"), {c.__name__ for c in cls.__mro__}
    return found if found and expected and found not in expected else None


def _load_pipeline(cls: type, path: pathlib.Path, dtype: torch.dtype | dict, provider: str) -> Any:
    """A diffusers pipeline directory: the parts amxopt optimizes are loaded packed, the rest by their own class.

    As ``DiffusionPipeline.from_pretrained`` does: the directory's own pipeline class where ``cls`` is
    a base of it, and each part in ``dtype`` (a dict: by part name, else its ``"default"``, else fp32).
    """
    from amxopt.runtime.components import PIPELINE_COMPONENTS

    index = json.loads((path / "model_index.json").read_text())
    named = getattr(importlib.import_module("diffusers"), str(index.get("_class_name")), None)
    if isinstance(named, type) and issubclass(named, cls):
        cls = named
    parts, options = {}, {}
    for name, value in index.items():
        if name.startswith("_"):
            continue
        if not (isinstance(value, list) and len(value) == 2):
            options[name] = value
        elif value[0] is None:
            parts[name] = None
        else:
            part_cls = getattr(importlib.import_module(value[0]), value[1])
            part_dtype = dtype.get(name, dtype.get("default", torch.float32)) if isinstance(dtype, dict) else dtype
            if not issubclass(part_cls, nn.Module):
                parts[name] = part_cls.from_pretrained(path / name)
            elif name in PIPELINE_COMPONENTS:
                parts[name] = _load_model(part_cls, path / name, part_dtype, provider)
            else:
                parts[name] = part_cls.from_pretrained(path / name, dtype=part_dtype)
    return cls(**parts, **options)


def _load_model(cls: type, path: pathlib.Path, torch_dtype: torch.dtype, provider: str) -> nn.Module:
    """``cls`` with its packable weights packed for ``provider`` (meta placeholders), the rest loaded."""
    from tqdm.auto import tqdm

    other = _other_type(cls, json.loads((path / "config.json").read_text()))
    note = f"; {path} holds a {other} model, read as {cls.__name__}" if other else ""
    try:
        model = _build_empty(cls, _config_of(cls, path), torch_dtype)
    except Exception as e:
        if not other:
            raise
        raise CheckpointError(f"amxopt: {cls.__name__} cannot be built from {path}'s config ({e}){note}") from e
    _refuse_unrunnable(model, torch_dtype)
    files = _checkpoint(path, "model" if _is_transformers(cls) else "diffusion_pytorch_model")
    expected = _expected(model)
    if _converted(model, sorted(set(files) - set(expected))) or _prefixed(cls, expected, files):
        del files, model, expected
        return _load_converted(cls, path, torch_dtype, provider)
    ignore = (
        *(getattr(cls, "_keys_to_ignore_on_load_unexpected", None) or ()),  # (Wan I2V's norm_added_q)
        *(f"^{re.escape(n)}$" for n in _unsaved_buffers(model, expected)),
    )
    stored = _check_keys(expected, files, str(path), lambda unexpected: note, ignore)
    parts = _packed_parts(model)
    packs = _packed_tensors(model, expected, parts)
    done: dict[int, torch.Tensor] = {}  # tied names share one tensor: loaded (and packed) once
    for name in tqdm(sorted(expected), desc=f"amxopt: loading {cls.__name__}", unit="tensor", leave=False):
        like = expected[name]
        if id(like) not in done:
            key = stored[name]
            value = _convert(key, files[key].tensors.pop(key), like, str(path))
            if id(like) in packs:
                done[id(like)] = _set(model, name, placeholder(like, {provider: pack(value, provider)}))
            else:
                # A copy: the model must not keep the checkpoint's memory map (or its file) alive.
                done[id(like)] = _set(model, name, value.clone() if value.dtype == like.dtype else value)
            del value
            files[key].drop(key)
        _set(model, name, done[id(like)])
    del files
    _guard_parts(model, parts)
    return model


def _load_converted(cls: type, path: pathlib.Path, torch_dtype: torch.dtype, provider: str) -> nn.Module:
    """A checkpoint whose tensor names transformers converts as it loads them: read by the class's
    own ``from_pretrained``, which applies the conversions, and checked as strictly as the streamed
    path (anything missing, unexpected, of another shape or failing to convert is a CheckpointError).
    Then the weights the streamed path would pack are packed and released: unlike that path, they
    are in memory unpacked for a moment (a whole model's towers: a few percent of its weights)."""
    logger.info("amxopt: %s: transformers converts its tensor names; read by %s.from_pretrained", path, cls.__name__)
    try:  # shapes that do not match are reported in ``info``, like the rest, rather than raised
        model, info = cls.from_pretrained(
            path,
            dtype=torch_dtype,
            attn_implementation="sdpa",
            local_files_only=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"amxopt: {path}: {cls.__name__}.from_pretrained cannot read it: {e}") from e
    kinds = ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs", "conversion_errors")
    buffers = _unsaved_buffers(model, _expected(model))
    prefix = f"{getattr(cls, 'base_model_prefix', '')}."
    info["unexpected_keys"] = [
        k for k in info.get("unexpected_keys", ()) if not {k, k.removeprefix(prefix), prefix + k} & buffers
    ]
    info["mismatched_keys"] = [
        f"{name}: {tuple(stored)} stored, {tuple(wanted)} in the model"
        for name, stored, wanted in info.get("mismatched_keys", ())
    ]
    problems = [f"{kind.replace('_', ' ')} {sorted(map(str, info[kind]))[:5]}" for kind in kinds if info.get(kind)]
    if problems:
        raise CheckpointError(
            f"amxopt: {path} does not match {cls.__name__} (read by transformers): {'; '.join(problems)}"
        )
    model.requires_grad_(False).eval()
    parts = _packed_parts(model)
    expected = _expected(model)
    packs = _packed_tensors(model, expected, parts)
    done: dict[int, nn.Parameter | None] = {}  # tied names share one tensor: packed once, as when streamed
    for name, like in sorted(expected.items()):
        if id(like) not in done:
            done[id(like)] = placeholder(like, {provider: pack(like, provider)}) if id(like) in packs else None
        if done[id(like)] is not None:
            _set(model, name, done[id(like)])
    _guard_parts(model, parts)
    return model


def _packed_tensors(model: nn.Module, expected: dict[str, torch.Tensor], parts: list[str]) -> set[int]:
    """The ids of the tensors packed and released as they are read: packable weights of a part
    optimize() rewrites (:func:`_packed_parts`), in a dtype the kernels take. A tensor held under
    several names (a tied embedding and LM head) only where every name is such a weight: the
    embedding reads it unpacked."""
    verdicts: dict[int, bool] = {}
    for name, like in expected.items():
        module, attr = _owner(model, name)
        ok = any(name.startswith(p) for p in parts) and packable(module, attr) and like.dtype in DTYPES
        verdicts[id(like)] = verdicts.get(id(like), True) and ok
    return {i for i, ok in verdicts.items() if ok}


def _prefixed(cls: type, expected: dict, found) -> bool:
    """Whether the stored names are the model's with its ``base_model_prefix`` added or removed
    (a ``Qwen3VLModel`` saved, read as ``Qwen3VLForConditionalGeneration``, or the reverse), which
    transformers' loader maps: then it reads the checkpoint."""
    prefix = getattr(cls, "base_model_prefix", "") if _is_transformers(cls) else ""
    if not prefix:
        return False
    names, stored = set(expected), set(found)
    matched = len(names & stored)
    added = {f"{prefix}.{k}" for k in stored}
    removed = {k.removeprefix(f"{prefix}.") for k in stored}
    return max(len(names & added), len(names & removed)) > matched


def _refuse_unrunnable(model: nn.Module, dtype: torch.dtype) -> None:
    """Before anything is read: a model that would be loaded only to fail at its first call."""
    from amxopt.runtime.components import generates_text, has_towers, unrunnable

    refusal = unrunnable(model, dtype)
    if refusal is not None:
        raise ValueError(f"amxopt.from_pretrained: {refusal} (torch_dtype={dtype}): load it with torch.bfloat16")
    if generates_text(model) and not has_towers(model):
        raise ValueError(
            f"amxopt.from_pretrained: {type(model).__name__} decodes text with a KV cache, and amxopt supports no "
            "tower in it: its generate() runs the model's own forward as eager PyTorch, on the weights "
            f"from_pretrained would release. Load it with {type(model).__name__}.from_pretrained"
        )


def _guard_parts(model: nn.Module, parts: list[str]) -> None:
    for prefix in parts:
        guard(model.get_submodule(prefix.rstrip(".")) if prefix else model)


def _packed_parts(model: nn.Module) -> list[str]:
    """Name prefixes of the modules whose weights are packed as they are read: the whole model, or,
    for one that optimize() does not rewrite itself but whose towers it replaces (Qwen3-VL's
    ``visual`` in ``Qwen3VLForConditionalGeneration``), those towers: the language model runs as
    eager PyTorch on its weights."""
    from amxopt.runtime.components import _tower, has_towers

    if not has_towers(model):
        return [""]
    parts: list[str] = []
    for name, module in model.named_modules():
        if _tower(module) and not any(f"{name}.".startswith(p) for p in parts):
            parts.append(f"{name}.")
    return parts


def save(opt: Any, directory: str | pathlib.Path) -> pathlib.Path:
    """Write ``opt``'s packed and plain weights and the manifest to ``directory``; see :func:`load`."""
    source = opt.__dict__["_source"]
    provider = opt.amx_config.provider
    if not opt.graphs and not any(packed.packed_for(t, provider) is not None for t in source.parameters()):
        raise RuntimeError(
            f"amxopt: {type(source).__name__} has no graph and no packed weights yet (optimize() had no example "
            "inputs, or load_state_dict replaced the weights since): call it once before save(), so that its "
            "weights are packed"
        )
    cls = type(source)
    config_values = _config_dict(source)
    rebuilt = _build_empty(cls, _config_from_dict(cls, config_values), _model_dtype(source))
    _check_rebuilt(source, rebuilt)
    directory = pathlib.Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if (said := os_error(e)) != str(e):  # a file where a directory is needed
            raise type(e)(e.errno, f"amxopt: save: {said}") from None
        raise type(e)(e.errno, f"amxopt: save: {e.strerror}", e.filename) from None
    # Weights some graph reads unpacked (a node autotune kept on ATen) are stored plain too, even
    # where another graph reads their packing.
    read_plain = {id(t) for gm in opt.graphs for t in (*gm.parameters(), *gm.buffers())}
    tensors, entries, first = {}, {}, {}
    for name, t in _expected(source).items():
        if id(t) in first:  # a tied name: stored once, under the first name
            entries[name] = {"tied_to": first[id(t)], "shape": list(t.shape), "dtype": _NAMES[t.dtype]}
            continue
        first[id(t)] = name
        done = packed.packed_for(t, provider)
        if done is not None:
            tensors[_PACKED_PREFIX + name] = done.contiguous()
            entries[name] = {"packed": True, "shape": list(t.shape), "dtype": _NAMES[t.dtype]}
            if id(t) in read_plain and t.device.type != "meta":
                tensors[name] = t.detach().contiguous()
                entries[name]["plain"] = True
        elif t.device.type == "meta":
            raise RuntimeError(f"amxopt: save: {name} was released but has no packing for provider {provider!r}")
        else:
            tensors[name] = t.detach().contiguous()
            entries[name] = {"packed": False, "shape": list(t.shape), "dtype": _NAMES[t.dtype]}
    # Buffers left out of the state dict (rotary tables) are rebuilt by load() from the config: those
    # that differ from what the class builds (a table rescaled by hand) are stored with their values.
    built_buffers = dict(rebuilt.named_buffers(remove_duplicate=False))
    groups: dict[int, list[str]] = {}  # a buffer's names (one tensor the class registers twice)
    for name, b in source.named_buffers(remove_duplicate=False):
        built = built_buffers[name]
        if name not in entries and (built.device.type == "meta" or not torch.equal(built.to(b.dtype), b)):
            if id(b) not in groups:
                tensors[_BUFFER_PREFIX + name] = b.detach().contiguous()
            groups.setdefault(id(b), []).append(name)
    stored_buffers = list(groups.values())
    graphs, skipped = [], _not_rebuilt(source, rebuilt)
    module = opt.adapter.export_module(source)
    try:
        if skipped is not None:
            raise graph_store.GraphStoreError(skipped)
        for i, graph in enumerate(opt._graphs):
            entry, extra = graph_store.dump(graph, module, for_cache=False, live=False)
            entry["attrs"] = {
                t: {**a, "stored": f"{_GRAPH_PREFIX}{i}::{a['stored']}"} if "stored" in a else a
                for t, a in entry["attrs"].items()
            }
            tensors.update({f"{_GRAPH_PREFIX}{i}::{k}": v for k, v in extra.items()})
            graphs.append(entry)
    except graph_store.GraphStoreError as e:
        graphs, skipped = [], str(e)
        tensors = {k: v for k, v in tensors.items() if not _GRAPH_TENSOR.match(k)}
        logger.warning(
            "amxopt: save: the rewritten graph of %s is not saved (%s); load() captures again", type(source).__name__, e
        )
    config_hash = _digest(config_values)
    for entry in graphs:  # the model each graph was captured from: a graph is restored only onto it
        entry["config_hash"] = config_hash
    manifest = {
        "amxopt_version": _version(),
        "layout_version": LAYOUT_VERSION,
        "provider": provider,
        "tier": native.active_tier() if provider == "native" else provider,
        "torch_version": torch.__version__,
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "config": config_values,
        "config_hash": config_hash,
        "dtype": _NAMES[_model_dtype(source)],
        "file_bytes": None,  # below, once written
        "tensors": entries,
        # Buffers that are not stored (rotary tables, built by the class) in the dtype the graphs read.
        "buffer_dtypes": {
            n: _NAMES[b.dtype] for n, b in source.named_buffers(remove_duplicate=False) if n not in entries
        },
        # of those, the ones whose values are in the file: each tensor's names, under its first (_BUFFER_PREFIX)
        "buffers_stored": stored_buffers,
        "adapter": opt.adapter.name,
        "graph_origin": _graph_origin(opt.amx_config),
        "graphs": graphs,
        "graphs_not_saved": skipped,
    }
    # Written aside and renamed into place, the manifest last: a process that has this artifact loaded
    # maps the old file (replacing it in place would pull its pages away). Both carry this save's id,
    # so a save interrupted between the two renames leaves files load() refuses, never a mix of two.
    manifest["save_id"] = uuid.uuid4().hex
    with replacing(directory / WEIGHTS) as staged:
        save_tensors(tensors, staged, metadata={_SAVE_ID: manifest["save_id"]})
        manifest["file_bytes"] = staged.stat().st_size
    with replacing(directory / MANIFEST) as staged:
        staged.write_text(json.dumps(manifest, indent=1, default=str))
    return directory


def _check_rebuilt(source: nn.Module, rebuilt: nn.Module) -> None:
    """Refuse to save what :func:`load` could not read back: the tensors of ``source`` against those
    its class builds from its config (``rebuilt``), by name and shape, both ways."""
    name = type(source).__name__
    ours, built = _expected(source), _expected(rebuilt)
    ours.update((n, b) for n, b in source.named_buffers(remove_duplicate=False) if n not in ours)
    built.update((n, b) for n, b in rebuilt.named_buffers(remove_duplicate=False) if n not in built)
    if unbuilt := sorted(set(ours) - set(built)):
        raise RuntimeError(
            f"amxopt: save: {name} holds {', '.join(unbuilt[:5])}, which it does not build from its config: "
            f"load() could not read the artifact back ({_added(unbuilt)})"
        )
    if gone := sorted(set(built) - set(ours)):
        raise RuntimeError(
            f"amxopt: save: {name} built from its config has {', '.join(gone[:5])}, which this model no longer "
            "holds: load() could not read the artifact back (a parameter removed or set to None after the model "
            "was built)"
        )
    if reshaped := [n for n in ours if ours[n].shape != built[n].shape]:
        shapes = ", ".join(f"{n} {tuple(ours[n].shape)} (built: {tuple(built[n].shape)})" for n in reshaped[:3])
        raise RuntimeError(
            f"amxopt: save: {name} holds {shapes}, not the shape its config builds: load() could not read the "
            "artifact back (a module replaced after the model was built)"
        )


def _added(names: list[str]) -> str:
    if any(".lora_" in n or ".base_layer." in n for n in names):
        return (
            "a LoRA adapter's layers: fuse the adapter into the weights and remove it (fuse_lora(), then "
            "unload_lora()) before amxopt.optimize, and the model saves as its class builds it"
        )
    return "a parameter or buffer added after the model was built"


def _not_rebuilt(source: nn.Module, rebuilt: nn.Module) -> str | None:
    """What the source's graphs traced that :func:`load`'s rebuild from its class and config
    (``rebuilt``) lacks: forward hooks, forwards replaced on an instance, modules of another class,
    training mode or attention processor (a layer replaced, ``set_attn_processor``). A graph restored
    there would compute it and one captured there again would not: one loaded model, two functions.
    (Plain attributes are not compared: a pipeline call leaves diffusers' empty hook registry on the
    model, and a model cast after it was built keeps another ``config.dtype``.)"""
    from amxopt.runtime.module import _hooked_and_replaced, _some

    hooked, replaced = _hooked_and_replaced(source, "the model")
    if hooked:
        return f"forward hooks on {_some(hooked)}, which load() does not rebuild"
    if replaced:
        return f"forwards replaced on {_some(replaced)}, which load() does not rebuild"
    ours, built = _structure(source), _structure(rebuilt)
    differ = [path or "the model" for path in dict.fromkeys([*ours, *built]) if ours.get(path) != built.get(path)]
    if differ:
        return (
            f"{_some(differ)}: another module class, training mode or attention processor than "
            f"{type(source).__name__} builds from its config (as load() does)"
        )
    return None


def _structure(model: nn.Module) -> dict[str, tuple]:
    """Each module's class, training flag and attention processor's class, by path."""
    return {
        path: (_class_name(m), m.training, _class_name(vars(m).get("processor"))) for path, m in model.named_modules()
    }


def _class_name(obj: Any) -> str | None:
    return None if obj is None else f"{type(obj).__module__}.{type(obj).__qualname__}"


def _tie_as_saved(model: nn.Module, entries: dict) -> None:
    """Tie the rebuilt model's parameters as the saved model's were: a tie the user's code made
    (``m.b.weight = m.a.weight``) is not made by the class (the artifact could not be loaded: b
    missing), and one the class makes may have been undone (UMT5's embeddings untied by hand were
    tied again, to the first one's values)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        entry = entries.get(name)
        if entry is None:
            continue
        target = entry.get("tied_to")
        if target is not None and target in entries:
            if model.get_parameter(target) is not p:
                _set(model, name, model.get_parameter(target))
        elif id(p) in first:  # stored apart from the name it shares a tensor with here
            _set(model, name, nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=False))
        else:
            first[id(p)] = name


def _refuse_options(what: str, config: AmxConfig) -> None:
    """Before anything is read: tensor parallelism slices the source weights, which these pack whole,
    and they keep no unpacked copy for ``keep_source``."""
    if config.tp != 1:
        raise ValueError(
            f"{what}: tensor parallelism (tp={config.tp!r}) slices the source weights, and this packs them whole "
            "as it reads them: load the model with its own from_pretrained and pass it to amxopt.optimize with tp"
        )
    if config.keep_source:
        raise ValueError(
            f"{what} reads the weights packed and keeps no unpacked copy, so AmxConfig(keep_source=True) cannot "
            "hold: load the model with its own from_pretrained and pass it to amxopt.optimize with that config"
        )


def load(directory: str | pathlib.Path, config: AmxConfig | None = None) -> Any:
    """Load what :func:`save` wrote: memory-mapped, no packing. Refuses a mismatched or damaged artifact."""
    import amxopt

    directory = pathlib.Path(directory)
    config = config or AmxConfig()
    _refuse_options("amxopt.load", config)
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        pretrained = (
            " (a save_pretrained directory, which amxopt.from_pretrained(cls, directory) reads)"
            if (directory / "config.json").exists() or (directory / "model_index.json").exists()
            else ""
        )
        raise CheckpointError(f"amxopt: {directory} is not an amxopt artifact ({MANIFEST}: {e}){pretrained}") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"amxopt: {directory} is not an amxopt artifact ({MANIFEST} holds no object)")
    config = dataclasses.replace(config, provider=resolve(config.provider))
    _check_manifest(manifest, config, directory)
    weights = directory / WEIGHTS
    if not weights.exists() or weights.stat().st_size != manifest["file_bytes"]:
        got = weights.stat().st_size if weights.exists() else "no file"
        raise CheckpointError(
            f"amxopt: {weights} is truncated or replaced: the manifest says {manifest['file_bytes']} bytes, found {got}"
        )
    module_name, _, cls_name = manifest["class"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError, ValueError) as e:
        raise CheckpointError(
            f"amxopt: {directory}: the manifest's class {manifest['class']!r} is not found: {e}"
        ) from None
    from diffusers.models.modeling_utils import ModelMixin  # (not diffusers' lazy attribute: it races threads)
    from transformers import PreTrainedModel

    if not (isinstance(cls, type) and issubclass(cls, (PreTrainedModel, ModelMixin))):
        raise CheckpointError(
            f"amxopt: {directory}: the manifest's class {manifest['class']!r} is not a transformers or diffusers "
            "model class"
        )
    try:
        model = _build_empty(cls, _config_from_dict(cls, manifest["config"]), _DTYPES[manifest["dtype"]])
    except Exception as e:  # noqa: BLE001 - whatever the library raises for a config it cannot take
        raise CheckpointError(
            f"amxopt: {directory}: {cls_name} cannot be built from the manifest's config ({type(e).__name__}: "
            f"{_first_line(e)})"
        ) from None
    for name, dtype in manifest.get("buffer_dtypes", {}).items():
        try:
            buffer = model.get_buffer(name)
        except AttributeError:
            raise CheckpointError(
                f"amxopt: {directory}: the manifest gives a dtype for buffer {name!r}, which {cls_name} built from "
                "its config does not have (saved with another version of its library?)"
            ) from None
        if buffer.dtype != _DTYPES[dtype]:
            _set(model, name, buffer.to(_DTYPES[dtype]))
    mapped = MappedFile(weights)
    if mapped.metadata.get(_SAVE_ID) != manifest.get("save_id"):
        raise CheckpointError(
            f"amxopt: {directory}: {WEIGHTS} and {MANIFEST} were written by two different saves (a save "
            "interrupted between its two renames?); save the model again"
        )
    tensors = mapped.tensors
    for names in manifest.get("buffers_stored", []):
        stored = tensors.get(_BUFFER_PREFIX + names[0])
        built = model.get_buffer(names[0])  # (buffer_dtypes above named one the class does not build)
        want = (tuple(built.shape), _DTYPES[manifest["buffer_dtypes"][names[0]]])
        if stored is None or (tuple(stored.shape), stored.dtype) != want:
            got = "not in the file" if stored is None else f"{_NAMES[stored.dtype]} {tuple(stored.shape)}"
            raise CheckpointError(
                f"amxopt: {weights}: buffer {names[0]} is {got}, {cls_name} needs {_NAMES[want[1]]} {want[0]}"
            )
        for name in names:
            _set(model, name, stored)
    _tie_as_saved(model, manifest["tensors"])
    expected = _expected(model)
    names = {
        n.removeprefix(_PACKED_PREFIX)
        for n in tensors
        if not _GRAPH_TENSOR.match(n) and not n.startswith(_BUFFER_PREFIX)
    }
    stored = _check_keys(expected, names, str(weights))
    done: dict[int, torch.Tensor] = {}
    for name, like in expected.items():
        key = stored[name]
        entry = manifest["tensors"].get(key)
        dtype = entry.get("dtype") if isinstance(entry, dict) else None
        packs = entry.get("packed") if isinstance(entry, dict) else None
        if (
            entry is None
            or entry.get("shape") != list(like.shape)
            or not (isinstance(dtype, str) and dtype in _DTYPES)
            or not isinstance(packs, bool)
        ):
            raise CheckpointError(
                f"amxopt: {weights}: manifest entry for {key} is {entry}, model has {tuple(like.shape)}"
            )
        kept = [_PACKED_PREFIX + key] if packs else []
        kept += [key] if not packs or entry.get("plain") else []
        if missing := [k for k in kept if k not in tensors]:
            raise CheckpointError(
                f"amxopt: {weights}: the manifest stores {key} as {' and '.join(kept)}; {missing[0]} is not in the file"
            )
        if id(like) not in done:
            # In the dtype it was saved in: the model may have been cast whole (``.to(bf16)``), modules
            # the class keeps in fp32 included, and its graphs read them so.
            like = torch.empty(like.shape, dtype=_DTYPES[entry["dtype"]], device="meta")
            if packs:
                _check_packing(tensors[_PACKED_PREFIX + key], like, key, config.provider, weights)
            if not packs:
                done[id(expected[name])] = _set(model, name, _convert(key, tensors[key], like, str(weights)))
            elif entry.get("plain"):  # also read unpacked by a graph: the plain tensor, carrying its packing
                done[id(expected[name])] = _set(model, name, _convert(key, tensors[key], like, str(weights)))
                packed.remember(done[id(expected[name])], config.provider, tensors[_PACKED_PREFIX + key])
            else:
                done[id(expected[name])] = placeholder(like, {config.provider: tensors[_PACKED_PREFIX + key]})
        _set(model, name, done[id(expected[name])])
    guard(model)
    opt = amxopt.optimize(model, config=config)
    if manifest.get("graphs") and manifest.get("adapter") != opt.adapter.name:
        raise CheckpointError(
            f"amxopt: {directory}: its graphs were captured through adapter {manifest.get('adapter')!r}, "
            f"this amxopt picks {opt.adapter.name!r} for {cls_name}; re-create the artifact"
        )
    module = opt.adapter.export_module(model)
    graphs = manifest.get("graphs", [])
    if graphs and manifest.get("graph_origin") != _graph_origin(config):
        # Made by other amxopt code or under other options: the weights serve, the graphs are captured again.
        logger.warning(
            "amxopt: %s: its graphs were rewritten by other amxopt code or options, or autotuned on another CPU; "
            "they are captured again",
            directory,
        )
        graphs = []
    config_hash = _digest(manifest["config"])
    if any(entry.get("config_hash") != config_hash for entry in graphs):
        logger.warning(
            "amxopt: %s: its graphs were captured from a model of another config than the one it holds now (the "
            "manifest was edited, or graphs copied in from another artifact); they are captured again",
            directory,
        )
        graphs = []
    for i, entry in enumerate(graphs):
        try:
            graph_store.check(entry)
        except _DAMAGED as e:
            raise CheckpointError(f"amxopt: {directory}: saved graph {i} cannot be restored: {_why(e)}") from None
        opt.defer(functools.partial(_restore, entry, module, config.provider, tensors, directory, i))
    return opt


def _check_packing(got: torch.Tensor, like: torch.Tensor, key: str, provider: str, weights: pathlib.Path) -> None:
    want = pack(like, provider)  # on meta: the packing's shape and dtype only
    if got.shape != want.shape or got.dtype != want.dtype:
        raise CheckpointError(
            f"amxopt: {weights}: the packing of {key} is {_NAMES.get(got.dtype, got.dtype)} {tuple(got.shape)}, but "
            f"a {_NAMES[like.dtype]} {tuple(like.shape)} weight packs to {_NAMES[want.dtype]} {tuple(want.shape)}"
        )


# The options that change what the passes make of a model (the provider is checked on its own).
_GRAPH_OPTIONS = ("passes", "dynamic", "stamp_blocks", "fuse_activation", "fuse_residual", "fuse_rotary", "autotune")


def _graph_origin(config: AmxConfig) -> dict:
    """What a saved graph was rewritten by: amxopt's code, the options that shape graphs, and the
    CPU that autotune's decisions (kept ATen, an AMX schedule) were timed on."""
    options = {k: getattr(config, k) for k in _GRAPH_OPTIONS}
    cpu = native.cpu_model() if config.autotune and config.provider == "native" else None
    return json.loads(json.dumps({"code": graph_store.code_hash(), "options": options, "cpu": cpu}, default=str))


def _restore(entry: dict, module: nn.Module, provider: str, tensors: dict, directory: pathlib.Path, i: int) -> Any:
    try:
        return graph_store.restore(entry, module, provider, tensors, f"the artifact {directory}")
    except _DAMAGED as e:
        raise CheckpointError(f"amxopt: {directory}: saved graph {i} cannot be restored: {_why(e)}") from None


# What reading a damaged graph entry raises: graph_store's own errors, and the plain ones of an entry
# edited by hand (a node or field missing, a value of the wrong kind).
_DAMAGED = (graph_store.GraphStoreError, KeyError, TypeError, ValueError, IndexError, AttributeError)


def _why(e: Exception) -> str:
    return str(e) if isinstance(e, graph_store.GraphStoreError) else f"damaged entry ({type(e).__name__}: {e})"


def _digest(values: dict) -> str:
    # Of the values as the manifest reads back: JSON makes int keys strings (id2label), which sort otherwise.
    read_back = json.loads(json.dumps(values, default=str))
    return hashlib.sha256(json.dumps(read_back, sort_keys=True).encode()).hexdigest()


def _check_manifest(manifest: dict, config: AmxConfig, directory: pathlib.Path) -> None:
    here = native.active_tier() if config.provider == "native" else config.provider
    problems = []
    if manifest.get("layout_version") != LAYOUT_VERSION:
        problems.append(f"packed layout version {manifest.get('layout_version')} (this amxopt reads {LAYOUT_VERSION})")
    if manifest.get("provider") != config.provider:
        problems.append(f"provider {manifest.get('provider')!r} (this run uses {config.provider!r})")
    elif manifest.get("tier") != here:
        capped = config.provider == "native" and native.capped()
        problems.append(
            f"tier {manifest.get('tier')!r} ({'max_tier holds this run at' if capped else 'this CPU runs'} {here!r})"
        )
    if problems:
        raise CheckpointError(f"amxopt: {directory} was saved for " + ", ".join(problems) + "; re-create it here")
    # (after those: an artifact of another layout is told as such, not as damaged)
    fields = {"class": str, "config": dict, "dtype": str, "file_bytes": int, "tensors": dict, "graphs": list}
    fields.update(buffer_dtypes=dict, buffers_stored=list)  # (absent: none)
    optional = {"graphs": [], "buffer_dtypes": {}, "buffers_stored": []}
    for field, kind in fields.items():
        if not isinstance(manifest.get(field, optional.get(field)), kind):
            raise CheckpointError(
                f"amxopt: {directory}/{MANIFEST} is damaged: its field {field!r} is {manifest.get(field)!r}, "
                f"not a {kind.__name__}"
            )
    entries = [*manifest["tensors"].values(), *manifest.get("graphs", [])]
    buffers = manifest.get("buffer_dtypes", {})
    if (
        manifest["dtype"] not in _DTYPES
        or not all(isinstance(e, dict) for e in entries)
        or not all(isinstance(d, str) and d in _DTYPES for d in buffers.values())
        or not all(_names_of(group, buffers) for group in manifest.get("buffers_stored", []))
    ):
        raise CheckpointError(
            f"amxopt: {directory}/{MANIFEST} is damaged: its dtype, tensor, graph or buffer entries are not amxopt's"
        )
    if manifest.get("torch_version") != torch.__version__:
        logger.warning(
            "amxopt: %s was saved with torch %s, this is %s",
            directory,
            manifest.get("torch_version"),
            torch.__version__,
        )


def _names_of(group: Any, buffers: dict) -> bool:
    """Whether ``group`` (an entry of ``buffers_stored``) is names of buffers ``buffer_dtypes`` gives."""
    return isinstance(group, list) and bool(group) and all(isinstance(n, str) and n in buffers for n in group)


def _model_dtype(model: nn.Module) -> torch.dtype:
    counts: dict[torch.dtype, int] = {}
    for p in model.parameters():
        if p.is_floating_point():
            counts[p.dtype] = counts.get(p.dtype, 0) + p.numel()
    return max(counts, key=counts.get) if counts else torch.float32


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("amxopt")
    except PackageNotFoundError:
        return "unknown"
