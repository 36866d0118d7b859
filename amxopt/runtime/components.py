"""Whole models and pipelines: optimize the supported parts in place, say what is left and why.

``amxopt.optimize`` hands a transformers model that *contains* supported towers (Qwen3-VL's
``model.visual``, the Qwen3-Omni thinker's ``visual`` and ``audio_tower``) or a diffusers pipeline
(``transformer``, ``transformer_2``, ``text_encoder``) to :func:`optimize_components`. Each part is
replaced, on its parent, by an :class:`OptimizedModule` that captures at its first call, so the
caller's own code (``generate``, ``pipe(...)``) runs unchanged and reaches the rewritten graphs.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from amxopt.capture import Adapter, find_adapter
from amxopt.config import AmxConfig
from amxopt.runtime import weights
from amxopt.runtime.module import OptimizedModule
from amxopt.runtime.tp import TPModule

logger = logging.getLogger(__name__)

# Pipeline components optimized through the generic passes (plus the Wan adapter for transformers).
PIPELINE_COMPONENTS = ("transformer", "transformer_2", "text_encoder", "image_encoder")
_LANGUAGE_MODEL = "language model: decoding with a KV cache is not in amxopt's scope yet; it runs as eager PyTorch"


@dataclasses.dataclass
class ComponentsReport:
    """What ``amxopt.optimize`` did to a whole model or pipeline.

    ``optimized`` maps each replaced part's path to its :class:`OptimizedModule` (whose own
    ``report`` exists once it has been called); ``left`` maps every other part to the reason.
    """

    owner: str
    optimized: dict[str, OptimizedModule]
    left: dict[str, str]
    # The whole model or pipeline (a weak reference: the report is its attribute), to tell the parts
    # replaced since: what an optimized part's line says is then of the part optimize() left there.
    holder: weakref.ref | None = dataclasses.field(default=None, repr=False, compare=False)

    def __deepcopy__(self, memo: dict) -> ComponentsReport:
        # The copy's parts are the copy's owner's (copied with it), not the original's.
        holder = None if self.holder is None else memo.get(id(self.holder()))
        optimized = copy.deepcopy(self.optimized, memo)
        return ComponentsReport(self.owner, optimized, dict(self.left), None if holder is None else weakref.ref(holder))

    def __str__(self) -> str:
        width = max(map(len, [*self.optimized, *self.left]), default=0)
        obj = None if self.holder is None else self.holder()
        gone = [] if obj is None else [p for p, opt in self.optimized.items() if _part_at(obj, p) is not opt]
        eager = [path for path, opt in self.optimized.items() if opt.eager_reason and path not in gone]
        summary = f"{len(self.optimized) - len(eager) - len(gone)} part(s) optimized, "
        summary += f"{len(eager)} run as eager PyTorch (capture failed), " if eager else ""
        summary += f"{len(gone)} replaced by the caller since, " if gone else ""
        lines = [f"amxopt: {self.owner}: {summary}{len(self.left)} left as they are"]
        for path, opt in self.optimized.items():
            if path in gone:
                lines.append(f"  {path:<{width}} | replaced  | by the caller since optimize (below: the part it was)")
            elif path in eager:
                lines.append(f"  {path:<{width}} | eager     | capture failed (below)")
            else:
                lines.append(f"  {path:<{width}} | optimized | adapter {opt.adapter.name}, {len(opt.graphs)} graph(s)")
        for path, reason in self.left.items():
            lines.append(f"  {path:<{width}} | left      | {reason}")
        for path, opt in self.optimized.items():
            lines += ["", f"[{path}]"]
            if opt.eager_reason:
                lines.append(f"runs as eager PyTorch: {opt.eager_reason}")
            elif opt.graphs:
                lines.append(str(opt.report))
            else:
                lines.append("not called yet: captured and rewritten at its first call")
        return "\n".join(lines)


def is_pipeline(obj: Any) -> bool:
    """A diffusers pipeline: a ``components`` dict, not itself an ``nn.Module``."""
    return not isinstance(obj, nn.Module) and isinstance(getattr(obj, "components", None), dict)


def has_towers(model: nn.Module) -> bool:
    """Whether ``model`` is not itself supported but contains a module a family adapter matches
    (or one amxopt already optimized: optimizing a model twice reports the same parts)."""
    return (
        find_adapter(model) is Adapter and not isinstance(model, (OptimizedModule, TPModule)) and _contains_part(model)
    )


@dataclasses.dataclass
class _Part:
    path: str
    module: nn.Module
    fallback: bool  # eager_fallback of a new optimized module
    install: Callable[[OptimizedModule], None]  # puts the part's optimized module where ``module`` is


def optimize_components(obj: Any, config: AmxConfig, given: bool = True) -> Any:
    """Replace the supported parts of ``obj`` (a model with towers, or a pipeline) in place.

    A part optimized before (by an earlier call, or by the caller) is kept as it is, unless
    ``config`` was ``given`` and differs from the part's own: then the part is optimized again from
    its source model with ``config``. A tensor-parallel part the caller optimized is kept as it is.
    A part that cannot be optimized is refused before any part is replaced.

    Returns ``obj`` itself, with an ``amxopt_report`` attribute (:class:`ComponentsReport`).
    """
    owner = type(obj).__name__
    parts: list[_Part] = []
    left: dict[str, str] = {}
    if is_pipeline(obj):
        _pipeline_parts(obj, parts, left)
    else:
        _tower_parts(obj, "", parts, left)
    refusal = next(filter(None, (_refusal(owner, config, given, p.path, p.module) for p in parts)), None)
    if refusal is not None:
        raise ValueError(refusal)
    report = ComponentsReport(owner, {}, left, weakref.ref(obj))
    for p in parts:
        opt = _optimized(config, given, p.module, p.fallback)
        p.install(opt)
        report.optimized[p.path] = opt
    if is_pipeline(obj):
        _route_lora_calls(obj)
    obj.amxopt_report = report
    return obj


def _tower(module: nn.Module) -> bool:
    return not isinstance(module, (OptimizedModule, TPModule)) and find_adapter(module) is not Adapter


def _contains_part(module: nn.Module) -> bool:
    return any(isinstance(m, (OptimizedModule, TPModule)) or _tower(m) for m in module.modules())


def _refusal(owner: str, config: AmxConfig, given: bool, path: str, module: nn.Module) -> str | None:
    """Why the part ``module`` at ``path`` cannot be optimized with ``config``; ``None`` where it can."""
    if isinstance(module, OptimizedModule):
        old = module.amx_config
        if not given or old == config or not weights.has_released(module.__dict__["_source"]):
            return None
        differ = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(old, f.name)]
        return (
            f"amxopt: {owner}.{path} was optimized before with another config ({', '.join(differ)} differ) and its "
            "unpacked weights were released (one copy in memory), so it cannot be optimized again with this one: "
            "optimize a freshly loaded model, or optimize with AmxConfig(keep_source=True) the first time"
        )
    if module.training:
        return (
            f"amxopt: {owner}.{path} ({type(module).__name__}) is in training mode; amxopt optimizes inference, call "
            ".eval() on it"
        )
    return None


def _optimized(config: AmxConfig, given: bool, module: nn.Module, fallback: bool) -> OptimizedModule:
    """The optimized module of the part ``module`` (not refused): ``module`` itself where it is one
    that can stay, else a new one of its model with ``config``."""
    if isinstance(module, OptimizedModule):
        if not given or module.amx_config == config:
            return module
        source = module.__dict__["_source"]
        return OptimizedModule(source, module.adapter, None, config, eager_fallback=module.eager_fallback)
    return OptimizedModule(module, find_adapter(module)(module), None, config, eager_fallback=fallback)


def _kept_tensor_parallel(part: TPModule) -> str:
    model = type(part.module.__dict__["_source"]).__name__
    return (
        f"TPModule of {model} (tp={part.tp}), optimized by the caller: kept as it is (a tensor-parallel part is "
        "optimized with its example inputs, by amxopt.optimize of it alone)"
    )


def _tower_parts(module: nn.Module, prefix: str, parts: list[_Part], left: dict[str, str]) -> None:
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        inner = _compiled(child) or child  # torch.compile's wrapper: the part is the module it compiles
        if isinstance(inner, TPModule):
            left[path] = _kept_tensor_parallel(inner)
        elif isinstance(inner, OptimizedModule) or _tower(inner):
            install = functools.partial(_install_tower, module, name, child, inner)
            parts.append(_Part(path, inner, False, install))
        elif _contains_part(child):
            _tower_parts(child, f"{path}.", parts, left)
        elif any(True for _ in child.parameters()):
            left[path] = _left_reason(name, child)


def _install_tower(parent: nn.Module, name: str, was: nn.Module, part: nn.Module, opt: OptimizedModule) -> None:
    if opt is not part:
        _dropping_compile(f"{type(parent).__name__}.{name}", was)
        setattr(parent, name, opt)


def _compiled(value: Any) -> nn.Module | None:
    """The module a ``torch.compile`` wrapper compiles (``None`` if ``value`` is no such wrapper)."""
    dynamo = torch._dynamo.eval_frame.OptimizedModule if "torch._dynamo" in sys.modules else ()
    return value._orig_mod if isinstance(value, dynamo) else None


def _optimized_part(value: Any) -> OptimizedModule | None:
    """The amxopt module ``value`` is, or that its ``torch.compile`` wrapper compiles."""
    value = _compiled(value) or value
    return value if isinstance(value, OptimizedModule) else None


def _dropping_compile(path: str, was: nn.Module) -> None:
    # Its forward is the compiled module's own: the optimized module could not run under it.
    if _compiled(was) is not None:
        logger.warning(
            "amxopt: %s was compiled by torch.compile; amxopt's optimized module replaces it, compiled graph and "
            "all (torch.compile the optimized module, after amxopt.optimize, to have both)",
            path,
        )


def _part_at(obj: Any, path: str) -> Any:
    """The part at ``path`` of a whole model or pipeline now (``None`` where there is none)."""
    if is_pipeline(obj):
        part = getattr(obj, path, None)
    else:
        try:
            part = obj.get_submodule(path)
        except AttributeError:
            return None
    return _compiled(part) or part


def _left_reason(name: str, module: nn.Module, pipeline: bool = False) -> str:
    cls = type(module).__name__
    if name in ("language_model", "lm_head") or _decodes(module):
        return f"{cls}: {_LANGUAGE_MODEL}"
    if pipeline:  # (the VAE: its pipeline calls vae.decode, not forward)
        parts = ", ".join(PIPELINE_COMPONENTS)
        return f"{cls}: not a part amxopt optimizes in a pipeline ({parts}); it runs as eager PyTorch"
    return (
        f"{cls}: not a tower amxopt optimizes in a whole model; it runs as eager PyTorch "
        "(amxopt.optimize of it alone rewrites the patterns it has)"
    )


def warn_if_decoder(model: Any) -> None:
    """Say so when a text decoder with no tower amxopt supports is to be captured whole: its
    ``generate()``, read through the optimized module, calls the model's own forward as eager
    PyTorch, and nothing said so (Qwen2.5-VL's whole model generated eagerly, with no graph)."""
    if generates_text(model):
        logger.warning(
            "amxopt: %s decodes text with a KV cache, and amxopt supports no tower in it: only a call of the "
            "optimized module runs a captured graph; its generate() runs the model's own forward as eager PyTorch "
            "(%s). Optimize a supported encoder (the Qwen3-VL / Qwen3-Omni towers, Wan's transformer), or a whole "
            "model of those families",
            type(model).__name__,
            _LANGUAGE_MODEL.removeprefix("language model: "),
        )


def unrunnable(model: nn.Module, dtype: torch.dtype | None = None) -> str | None:
    """Why a module in ``model`` (``model`` itself included), in ``dtype`` (by default its own
    parameters'), cannot run on amxopt at all (a Qwen tower in float16); ``None`` where all can. Checked
    before anything is replaced: such a tower was replaced, then failed every call, and the cast its
    error advised was refused on the replaced module."""
    for path, module in model.named_modules():
        refusal = find_adapter(module).refusal(module, dtype)
        if refusal is not None:
            return f"{path}: {refusal}" if path else refusal
    return None


def generates_text(model: Any) -> bool:
    """A model whose ``generate()`` decodes text with a KV cache, calling its own forward."""
    return isinstance(model, nn.Module) and callable(getattr(model, "generate", None)) and _decodes(model)


def _decodes(module: nn.Module) -> bool:
    """A text decoder: its forward takes a KV cache (a CLIP text encoder's does not): ``past_key_values``,
    or, from transformers 5.2x, ``cache`` (a ``Cache``)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False
    cache = params.get("cache")
    return "past_key_values" in params or (cache is not None and "Cache" in str(cache.annotation))


def _pipeline_parts(pipe: Any, parts: list[_Part], left: dict[str, str]) -> None:
    for name, component in pipe.components.items():
        if not isinstance(component, nn.Module):
            continue
        inner = _compiled(component) or component  # torch.compile's wrapper: the part is the module it compiles
        if isinstance(inner, TPModule):
            left[name] = _kept_tensor_parallel(inner)
        elif isinstance(inner, OptimizedModule) or name in PIPELINE_COMPONENTS:
            install = functools.partial(_install_component, pipe, name, component, inner)
            parts.append(_Part(name, inner, True, install))
        else:
            left[name] = _left_reason(name, component, pipeline=True)


def _install_component(pipe: Any, name: str, was: nn.Module, part: nn.Module, opt: OptimizedModule) -> None:
    if isinstance(part, OptimizedModule):
        # Assigned by the caller (pipe.transformer = amxopt.optimize(...)): diffusers recorded
        # OptimizedModule as the part's class, which save_pretrained would write to
        # model_index.json and from_pretrained cannot load (or (None, None), once a save
        # skipped it: setattr then keeps that). Record the source's class instead.
        _record_source_class(pipe, name, part)
    if opt is not part:
        _dropping_compile(f"{type(pipe).__name__}.{name}", was)
    # Not setattr: diffusers would record the new class in the pipeline's config.
    pipe.__dict__[name] = was if opt is part else opt  # (a compiled optimized part stays compiled)


def _record_source_class(pipe: Any, name: str, part: OptimizedModule) -> None:
    """Record ``part``'s source model's class as the pipeline's ``name`` in its config (what
    ``model_index.json`` names); the attribute itself is left as it was."""
    value = pipe.__dict__.get(name)
    register = getattr(pipe, "register_modules", None)
    if register is not None:
        register(**{name: part.__dict__["_source"]})
    else:
        setattr(pipe, name, part.__dict__["_source"])
    pipe.__dict__[name] = value


def _route_lora_calls(pipe: Any) -> None:
    """Point diffusers' LoRA methods of ``pipe`` (``load_lora_weights``, ``set_adapters``,
    ``fuse_lora``, ``disable_lora``, ...) at the source models of its optimized parts.

    They find the parts they act on by class (``ModelMixin``), which an :class:`OptimizedModule` is
    not: a part would be skipped, or its adapters not found. During such a call each optimized part
    is its source model again; the optimized module sees what the call changed at its next call
    (new adapter layers, another scale, a merge: ``OptimizedModule._check_adapters``). The methods
    live on a subclass of the pipeline's class, under its name (what diffusers saves), so that a
    copy of the pipeline calls them on itself.
    """
    cls = type(pipe)
    if cls not in _ROUTED:
        mixins = [c for c in cls.__mro__ if c.__module__.startswith("diffusers.loaders") and "Lora" in c.__name__]
        names = {n for c in mixins for n, f in vars(c).items() if inspect.isfunction(f) and not n.startswith("_")}
        methods = {n: _with_sources(getattr(cls, n)) for n in sorted(names)}
        if hasattr(cls, "save_pretrained"):
            methods["save_pretrained"] = _saving_sources(cls.save_pretrained)
        identity = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__}
        copies = {"__reduce_ex__": _refuse_pickle, "__copy__": _copy, "__deepcopy__": _deepcopy}
        routed = type(cls.__name__, (cls,), {**identity, **copies, **methods})
        _ROUTED[cls] = _ROUTED[routed] = routed
    pipe.__class__ = _ROUTED[cls]


def _saving_sources(save: Callable) -> Callable:
    """diffusers' ``save_pretrained`` picks each part's saver by its class, which an
    :class:`OptimizedModule` is not: it would skip the optimized parts and write them as absent in
    ``model_index.json`` (and in the live pipeline's config). They are saved as their source
    models, which must still hold their weights."""

    @functools.wraps(save)
    def call(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        parts = {n: part for n, v in pipe.__dict__.items() if (part := _optimized_part(v)) is not None}
        released = [n for n, part in parts.items() if weights.has_released(part.__dict__["_source"])]
        if released:
            raise RuntimeError(
                f"amxopt: {type(pipe).__name__}.save_pretrained: amxopt.optimize packed the weights of {released} "
                "and released their unpacked copies (one copy in memory), which diffusers would save: save the "
                "pipeline before amxopt.optimize, or optimize it with AmxConfig(keep_source=True)"
            )
        for name, part in parts.items():
            # A part the caller assigned since optimize() (compiled, or optimized alone): diffusers recorded
            # its class as amxopt's, which model_index.json would name and from_pretrained cannot load.
            _record_source_class(pipe, name, part)
        return _with_sources(save)(pipe, *args, **kwargs)

    return call


def _refuse_pickle(pipe: Any, protocol: int) -> Any:
    raise TypeError(
        f"amxopt: a {type(pipe).__name__} with optimized parts cannot be pickled (their graphs would lose their "
        "output types): save the pipeline before amxopt.optimize, and optimize it again after loading"
    )


def _copy(pipe: Any) -> Any:
    new = object.__new__(type(pipe))
    new.__dict__.update(pipe.__dict__)
    return new


def _deepcopy(pipe: Any, memo: dict) -> Any:
    new = object.__new__(type(pipe))
    memo[id(pipe)] = new
    new.__dict__.update(copy.deepcopy(pipe.__dict__, memo))
    return new


# A pipeline class -> its subclass with routed LoRA methods (and that subclass -> itself); one per class.
_ROUTED: dict[type, type] = {}


def _with_sources(function: Callable) -> Callable:
    @functools.wraps(function)
    def call(pipe: Any, *args: Any, **kwargs: Any) -> Any:
        swapped = {n: v for n, v in pipe.__dict__.items() if _optimized_part(v) is not None}
        for n, value in swapped.items():  # (a compiled one as the source, as diffusers saves a compiled model)
            pipe.__dict__[n] = _optimized_part(value).__dict__["_source"]
        run = functools.partial(function, pipe)
        for value in swapped.values():  # load_lora_weights(..., hotswap=True): see hotswap_watched
            run = functools.partial(_optimized_part(value).hotswap_watched, run)
        try:
            return run(*args, **kwargs)
        finally:
            pipe.__dict__.update(swapped)

    return call
