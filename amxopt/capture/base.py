"""Plain capture: torch.export (non-strict) of a model as it is, with dynamic dims where possible.

An adapter subclasses :class:`Adapter` to move a model family's data-dependent pre-processing out
of the graph (``graph_inputs``), to swap in the module that is exported (``export_module``) and to
patch the model while it is traced (``tracing``). Everything else is shared.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from amxopt.capture import repeated
from amxopt.capture.repeated import user_hooks

logger = logging.getLogger(__name__)

_OUTPUT_OPTIONS = ("return_dict",)


def _library_model(model: nn.Module) -> bool:
    """A transformers or diffusers model (by its bases' names: neither library is imported here)."""
    return any(
        (c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel")
        or (c.__module__.startswith("diffusers.") and c.__name__ == "ModelMixin")
        for c in type(model).__mro__
    )


class CaptureError(RuntimeError):
    """torch.export could not capture the model as one graph."""


class Adapter:
    """Plain capture of any module; subclasses add per-family knowledge.

    Args:
        model: the module to capture (not modified, except inside ``tracing``).
    """

    name = "plain"
    # The caller's argument a graph input is computed from, where their names differ (messages name
    # what the caller passed: the Omni audio tower's padded_feature comes from input_features).
    arguments: dict[str, str] = {}

    def __init__(self, model: nn.Module) -> None:
        self.model_name = type(model).__name__
        self._signature = inspect.signature(model.forward)
        self._config = getattr(model, "config", None)
        self._library_output = _library_model(model)

    @classmethod
    def matches(cls, model: nn.Module) -> bool:
        return True

    @classmethod
    def refusal(cls, model: nn.Module, dtype: torch.dtype | None = None) -> str | None:
        """Why ``model`` (in ``dtype``, by default its parameters') cannot run on amxopt at all, checked
        before anything is replaced or read; ``None`` where it can."""
        return None

    def bind(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        """Name every argument of a call the way ``model.forward`` would receive it. An argument
        given as ``None`` where that is its default is the call without it (a pipeline passes
        ``attention_kwargs=None``: the graph of a call that left it out serves)."""
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.model_name}.forward: {e}") from None
        params = self._signature.parameters
        out = {k: v for k, v in bound.arguments.items() if not (v is None and params[k].default is None)}
        for name, p in self._signature.parameters.items():
            if p.kind is inspect.Parameter.VAR_KEYWORD and name in out:
                # by name: the same keywords in another order are the same call (one graph)
                out.update(sorted(out.pop(name).items()))
            elif p.kind is inspect.Parameter.VAR_POSITIONAL and name in out:
                if out[name]:
                    raise TypeError(f"{self.model_name}.forward: extra positional args are not supported")
                del out[name]
        return out

    def output_options(self, call: dict[str, Any]) -> dict[str, Any]:
        """Take the arguments that only shape the output (``return_dict``) out of ``call``.

        One graph then serves every caller: transformers' ``get_image_features`` passes
        ``return_dict=True``, diffusers pipelines ``return_dict=False``. Only a transformers or
        diffusers model's: their output class is the tuple's other form (``to_tuple``). Any other
        model's ``return_dict`` may decide anything, so it stays an argument of the call.
        """
        if not self._library_output:
            return {}
        options = {k: call.pop(k) for k in _OUTPUT_OPTIONS if k in call}
        if (
            options.get("return_dict")
            and type(self).graph_inputs is Adapter.graph_inputs
            and getattr(self._config, "return_dict", True) is False
        ):
            # The config makes the model return a tuple, which cannot be made its output class
            # again: a call asking for that class is traced with the flag (a graph of its own).
            call["return_dict"] = True
        return options

    def format_output(self, out: Any, options: dict[str, Any]) -> Any:
        """The graph's output as the original would return it under ``options``."""
        if options.get("return_dict") is False and hasattr(out, "to_tuple"):
            return out.to_tuple()  # transformers ModelOutput and diffusers BaseOutput alike
        return out

    def split(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        """The call as independent calls whose outputs :meth:`join` makes its output: one graph
        then serves inputs of any size where the model's own code would unroll a loop over them."""
        return [call]

    def join(self, outputs: list[Any]) -> Any:
        """The output of a call :meth:`split` cut, from its parts' outputs."""
        (out,) = outputs
        return out

    def graph_inputs(self, call: dict[str, Any]) -> dict[str, Any]:
        """The eager part of a call: returns the keyword inputs of the exported graph."""
        return call

    def export_module(self, model: nn.Module) -> nn.Module:
        return model

    @contextlib.contextmanager
    def tracing(self, model: nn.Module):
        yield

    def dynamic_shapes(self, graph_inputs: dict[str, Any]) -> dict[str, Any]:
        """Let export decide (Dim.AUTO) for every dim of every tensor input."""
        auto = torch.export.Dim.AUTO

        def spec(x):
            return {i: auto for i in range(x.dim())} if isinstance(x, torch.Tensor) else None

        return {k: pytree.tree_map(spec, v) for k, v in graph_inputs.items()}


@dataclasses.dataclass
class Captured:
    """One exported graph and how to feed it.

    ``guards`` is export's input check, taken out of the graph so that passes never see it: it
    raises when a call's shapes fall outside what the graph was captured for. ``guard_code`` is the
    same check as expressions over the flat inputs (``args[0].size()[0] >= 8``), which a stored graph
    keeps (amxopt/runtime/graph_store.py); ``None`` when export's guards could not be read.
    """

    gm: fx.GraphModule
    dynamic: bool
    guards: Any
    note: str = ""
    guard_code: list[str] | None = None

    def check(self, graph_inputs: dict[str, Any]) -> None:
        if self.guards is not None:
            self.guards(*pytree.tree_leaves(graph_inputs))


def refuse_inference_tensors(module: nn.Module, model_name: str) -> None:
    """Refuse a module with a parameter or buffer made under ``torch.inference_mode``: export cannot
    trace it, and a graph restored for it (the graph cache) would not see writes to it (an inference
    tensor counts no versions)."""
    inference = next((n for n, t in (*module.named_parameters(), *module.named_buffers()) if t.is_inference()), None)
    if inference is not None:
        raise CaptureError(
            f"amxopt: {model_name}'s {inference} was created under torch.inference_mode, and torch.export "
            "cannot trace inference tensors: build or load the model outside inference_mode (calling it inside "
            "is fine)"
        )


def export(
    model: nn.Module, adapter: Adapter, graph_inputs: dict[str, Any], dynamic: bool, stamp_blocks: bool = True
) -> Captured:
    """Export ``adapter.export_module(model)`` on ``graph_inputs``; dynamic first, then static.

    With ``stamp_blocks``, each stack of identical blocks is traced once and copied
    (amxopt/capture/repeated.py); a stack that cannot be is traced block by block, with a note.
    """
    module = adapter.export_module(model)
    refuse_inference_tensors(module, adapter.model_name)
    attempts = [True, False] if dynamic else [False]
    errors = []
    members = _member_names(module)
    for dyn in attempts:
        shapes = adapter.dynamic_shapes(graph_inputs) if dyn else None
        try:
            with _EXPORTING:
                ep, gm, stamp_note = _export(module, model, adapter, graph_inputs, shapes, stamp_blocks)
        except Exception as e:  # noqa: BLE001 - export raises many types; all mean "not captured"
            errors.append(f"{'dynamic' if dyn else 'static'}: {type(e).__name__}: {_first_line(e)}")
            logger.info("amxopt: %s export of %s failed: %s", "dynamic" if dyn else "static", adapter.model_name, e)
            continue
        finally:
            added = _take_added_members(members)
        if added:
            # What the trace registered holds its fake tensors: the model kept them (a FakeTensor
            # buffer), and the graph read a constant made while tracing.
            raise CaptureError(
                f"amxopt: {adapter.model_name} registers {', '.join(added[:4])}{', ...' if len(added) > 4 else ''} "
                "while it runs, which torch.export traces with fake tensors: register it in __init__, or call the "
                "model once before amxopt.optimize"
            )
        _drop_dtype_asserts(gm)
        notes = [stamp_note] if stamp_note else []
        if not dyn and dynamic:
            notes.append(f"dynamic export failed ({errors[0]}); shapes are static")
        guards = _take_guards(gm)
        gm.recompile()  # once, after stamping and both edits
        return Captured(gm=gm, dynamic=dyn, guards=guards, note="; ".join(notes), guard_code=_guard_code(ep, gm))
    hint = ""
    if any("data-dependent" in e or "DataDependent" in e for e in errors):
        # Hooks and replaced forwards are traced too: a cache hook (diffusers' enable_cache) that
        # decides from tensor values is the likelier cause where the model has one.
        altered = [p or "the model" for p in repeated.hooked(model, recorders=False)] + [
            p or "the model" for p, m in model.named_modules() if "forward" in vars(m)
        ]
        if altered:
            hint = (
                f". Forward hooks or replaced forwards on {', '.join(altered[:4])}{', ...' if len(altered) > 4 else ''}"
                " are traced with the model, and one computes Python control flow from tensor values (a cache "
                "hook such as diffusers' enable_cache decides per call): remove them before amxopt runs it"
            )
        else:
            hint = (
                ". The model computes shapes or Python control flow from tensor values (e.g. grid_thw.tolist() "
                "in a vision tower's metadata): an amxopt adapter must compute those eagerly before the graph, "
                "as amxopt/capture/qwen.py does for the Qwen3 towers"
            )
    elif user_hooks(model._forward_pre_hooks):
        hint = (
            f". {adapter.model_name} has a forward pre-hook of its own, which runs in the trace: amxopt passes "
            "the model its inputs by name, so the hook gets them in kwargs (with_kwargs=True), not in args"
        )
    if len(errors) == 2 and errors[0].removeprefix("dynamic: ") == errors[1].removeprefix("static: "):
        errors = ["dynamic and static: " + errors[1].removeprefix("static: ")]  # one cause, said once
    raise CaptureError(
        f"amxopt: torch.export could not capture {adapter.model_name} as one graph "
        f"(adapter {adapter.name!r}): " + "; ".join(errors) + hint
    )


def _member_names(module: nn.Module) -> list[tuple[str, dict, set]]:
    return [(path, d, set(d)) for path, d in repeated.member_dicts(module)]


def _take_added_members(before: list[tuple[str, dict, set]]) -> list[str]:
    """Remove the parameters, buffers and submodules added to the dicts of ``before`` since (by a
    trace of a forward); their paths."""
    added = []
    for path, d, names in before:
        for name in [n for n in d if n not in names]:
            del d[name]
            added.append(f"{path}.{name}" if path else name)
    return added


def _export(module, model, adapter, graph_inputs, shapes, stamp_blocks) -> tuple[Any, fx.GraphModule, str]:
    """One torch.export of ``module``: blocks stamped where they can be, else traced one by one."""
    stacks = repeated.find_stacks(module) if stamp_blocks else []
    note = ""
    if stacks:
        try:
            with (
                adapter.tracing(model),
                repeated.tracing(module, stacks),
                torch.no_grad(),
                _one_shot_trace(),
                _keywords_named(module, graph_inputs),
            ):
                ep = torch.export.export(module, (), dict(graph_inputs), dynamic_shapes=shapes, strict=False)
            gm = ep.module()
            repeated.stamp(gm, stacks)
            return ep, gm, ""
        except Exception as e:  # noqa: BLE001 - whatever stopped stamping, a full trace may still work
            note = f"blocks traced one by one: {_first_line(e)}"
            logger.info("amxopt: stamping the blocks of %s failed (%s); tracing every block", adapter.model_name, e)
    with adapter.tracing(model), torch.no_grad(), _one_shot_trace(), _keywords_named(module, graph_inputs):
        ep = torch.export.export(module, (), dict(graph_inputs), dynamic_shapes=shapes, strict=False)
    return ep, ep.module(), note


@contextlib.contextmanager
def _keywords_named(module: nn.Module, graph_inputs: dict[str, Any]) -> Iterator[None]:
    """While exporting: ``module.forward`` with the inputs its ``**kwargs`` takes as parameters of
    their own. torch.export keys dynamic_shapes by the signature's parameters, and then matches them
    against the inputs with the extra keywords at the top (torch 2.13): the dynamic export of every
    call with an extra keyword failed (CLIP's ``output_hidden_states=True``), so each batch size got
    a static graph of its own. The graph is the same: the inputs are passed as they were.

    Positional-only parameters (``forward(self, x, /)``) are taken by name too, and passed on by
    position: export passes every input by name."""
    forward = module.forward
    params = inspect.signature(forward).parameters
    keyword, only = inspect.Parameter.VAR_KEYWORD, inspect.Parameter.POSITIONAL_ONLY
    extra = [k for k in graph_inputs if k not in params or params[k].kind is keyword]
    if not any(p.kind is keyword for p in params.values()):
        extra = []
    positional = [p for p in params.values() if p.kind is only]
    if not extra and not positional:
        yield
        return

    def named(*args: Any, **kwargs: Any) -> Any:
        head = [kwargs.pop(p.name, p.default) for p in positional[len(args) :]]
        return forward(*args, *head, **kwargs)

    named.__signature__ = inspect.Signature(
        [
            p.replace(kind=inspect.Parameter.POSITIONAL_OR_KEYWORD) if p.kind is only else p
            for p in params.values()
            if p.kind is not keyword or not extra
        ]
        + [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in extra]
    )
    own = module.__dict__.get("forward")  # a forward replaced on the instance, which ``forward`` calls
    module.forward = named
    try:
        yield
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


@contextlib.contextmanager
def _one_shot_trace():
    """torch settings for a trace that runs once: no fake-tensor dispatch cache (an entry is built,
    and checked against symbolic sizes, per distinct op call, and hardly any repeats once blocks are
    stamped) and no Python stack per node (nothing of amxopt reads ``stack_trace``). Qwen3-VL-2B
    vision's export: 2.07 s of CPU against 2.88 s with both on (medians of 6 alternating exports in
    one process, AMD Zen 3); the graph is the same, node for node."""
    stack_traces = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        with torch._dynamo.config.patch(fake_tensor_cache_enabled=False), _without_partial_graphs():
            yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = stack_traces


# One export at a time in a process: torch.export's state (its patcher, module hierarchy, fx
# settings) and amxopt's stamping (repeated._TRACING) are process-wide. Two threads exporting two
# models at once (captures in process) failed with torch's errors, which named the model.
_EXPORTING = threading.RLock()
_HOLDING = threading.Lock()  # one trace at a time holds stderr


def _fresh_locks() -> None:
    """In a forked child (amxopt's capture process): a lock another thread of the parent held at the
    fork would be held for good."""
    global _EXPORTING, _HOLDING
    _EXPORTING, _HOLDING = threading.RLock(), threading.Lock()


os.register_at_fork(after_in_child=_fresh_locks)


class _HeldStderr:
    """``sys.stderr`` while a trace runs: what is written is held, then written to the stream it
    replaced, and from then on passed through (a thread that saved it meanwhile and puts it back
    later still reaches stderr). Anything else (``fileno``, ``isatty``) is the stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._parts, self._order = stream, [], threading.Lock()

    def write(self, text: str) -> int:
        with self._order:  # (a write racing release() is held and written by it, or comes after it)
            if self._parts is not None:
                self._parts.append(text)
                return len(text)
        return self._stream.write(text)

    def flush(self) -> None:
        if self._parts is None:
            self._stream.flush()

    def release(self, drop: str | None) -> None:
        with self._order:
            text, self._parts = "".join(self._parts), None
            self._stream.write(text.replace(drop, "") if drop else text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _without_partial_graphs():
    """What a trace writes to stderr, without the partial graph torch.export prints there when it
    fails (twice: its wrappers nest). A failed capture tries up to four exports (dynamic and static,
    blocks stamped and not): 8 copies of a 50-line graph came before amxopt's error. The graph is
    logged at debug level; anything else written to stderr is written as it was, once the trace ends.
    Without a stderr (``2>&-``), or while another thread's trace holds it, stderr is left alone."""
    stream = sys.stderr
    if stream is None or not _HOLDING.acquire(blocking=False):
        yield
        return
    held, drop = _HeldStderr(stream), None
    sys.stderr = held
    try:
        yield
    except Exception as e:
        partial = getattr(e, "partial_fx_graph", None)
        if partial is not None:
            logger.debug("amxopt: torch.export's partial graph:\n%s", partial)
            drop = f"{partial}\n"
        raise
    finally:
        held.release(drop)  # before stderr is the stream again: what was held comes first
        if sys.stderr is held:  # (not where another thread put its own meanwhile)
            sys.stderr = stream
        _HOLDING.release()


def _drop_dtype_asserts(gm: fx.GraphModule) -> None:
    # export records one dtype assert per .to() call; the graph inputs' dtypes are checked once per
    # call by OptimizedModule instead, and the asserts would otherwise pin the casts that passes fold.
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target == torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)


def _guard_code(ep: torch.export.ExportedProgram, gm: fx.GraphModule) -> list[str] | None:
    """The expressions ``ep.module()`` compiles into its ``_guards_fn``, over ``args[i]`` (flat inputs).

    torch keeps them only as generated code; this repeats the few steps of
    ``torch.export._unlift._unlift_exported_program_lifted_states`` that produce them (pinned torch).
    """
    from torch.export import _unlift

    try:
        placeholders = gm.graph.find_nodes(op="placeholder")
        signature = inspect.signature(gm.forward)
        paths = _unlift._get_input_paths(ep.example_inputs, signature)
        code = _unlift._get_input_guards_for_graph(placeholders, ep.range_constraints, paths)
        from_ep = _unlift._force_ep_signature_match(ep._guards_code, paths)
        code += _unlift._force_gm_signature_match(from_ep, signature)
    except Exception as e:  # noqa: BLE001 - private API of the pinned torch: without it, graphs are not stored
        logger.info("amxopt: export's guards of %s could not be read (%s); its graph will not be stored", gm, e)
        return None
    flat = []
    for c in code:
        for i, path in enumerate(paths):
            c = c.replace("L" + pytree.keystr(path), f"args[{i}]")
        flat.append(c)
    return flat


def _take_guards(gm: fx.GraphModule) -> nn.Module | None:
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn":
            gm.graph.erase_node(node)
            return gm.get_submodule("_guards_fn")
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
