"""AmxConfig: every knob of amxopt.optimize, passed explicitly (never read from globals)."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib


@dataclasses.dataclass(frozen=True)
class AmxConfig:
    """Options for :func:`amxopt.optimize`.

    Args:
        provider: kernel family behind the ``amxopt`` ops: ``"auto"`` picks the best available
            one, or name one of :func:`amxopt.ops.providers.available_providers`.
        passes: names of the passes to run, in order; ``None`` runs ``DEFAULT_PASSES``.
        dynamic: capture with dynamic sequence/frame dimensions where export allows; when
            ``False`` (or when dynamic export fails) every new input signature is re-captured.
        stamp_blocks: trace the first block of each stack of identical blocks (a ``ModuleList`` of
            transformer layers) and copy its graph for the others, instead of tracing every block:
            the same graph, captured several times faster. A stack that cannot be copied is traced
            block by block, and the report says why. See ``amxopt/capture/repeated.py``.
        fuse_activation: fold a following gelu/silu into ``amxopt.linear``'s epilogue.
        fuse_residual: fold a following residual add (``h + linear(...)``, the output's shape and
            dtype) into ``amxopt.linear``'s epilogue.
        fuse_rotary: apply the rotary embedding of an attention's q and k inside the attention
            (as they are copied and packed) instead of in ``amxopt.rotary_embedding`` calls.
        release_weights: drop the unpacked originals from the graph once they are packed.
        keep_source: keep the source model's unpacked weights after packing. By default they are
            released (one copy of each weight in memory) and the original model can no longer be
            called eagerly; tests and A/B comparisons against the original set this.
        max_recaptures: bound on cached graphs per optimized model (one per input signature).
        autotune: time each distinct op shape against the ATen code it would replace and keep the
            faster (native provider only); the report lists every decision with both timings.
        autotune_cache: directory of amxopt's on-disk caches (kernel decisions, keyed by CPU, torch,
            kernels, tier and shape; rewritten graphs); ``None`` is ``$XDG_CACHE_HOME/amxopt`` or
            ``~/.cache/amxopt``.
        graph_cache: keep each rewritten graph in that directory, keyed by amxopt's code, the
            library versions, the CPU, the model's structure (not its weight values), the call's
            structure and these options: a later optimize() of the same model restores the graph
            instead of capturing and rewriting it again. Not used with tensor parallelism.
        isolate_capture: capture and rewrite in a forked child process, which sends the graph back
            (``amxopt/runtime/isolated.py``): torch.export's imports and leftovers (tens of MB) never
            enter this process. Not with tensor parallelism. A capture the child cannot finish runs
            in this process instead. Turn it off where a fork is unsafe: other threads of this
            process running torch while a capture starts could hold locks the child needs.
        tp: tensor-parallel ranks. ``1``: none. ``"env"``: this process is one rank of a
            ``torchrun`` job (torch.distributed from the environment, gloo, or oneCCL when installed).
            ``N > 1``: optimize() starts N-1 worker processes and returns a module that runs all N
            ranks behind one call. See ``amxopt/runtime/tp.py``.
        cpu_bind: each rank's cores: ``None`` splits the allowed cores evenly along the NUMA nodes;
            or one entry per rank, a list of core ids or a string such as ``"0-3"``; ``"none"`` binds nothing.
        tp_timeout_s: how long a rank waits for the others (a collective, a call) before failing.
        tp_rank, tp_group: set by the tp runner in each rank (which shard; the process group's name).

    Example::

        opt = amxopt.optimize(model, inputs, config=AmxConfig(provider="reference"))
    """

    provider: str = "auto"
    passes: tuple[str, ...] | None = None
    dynamic: bool = True
    stamp_blocks: bool = True
    fuse_activation: bool = True
    fuse_residual: bool = True
    fuse_rotary: bool = True
    release_weights: bool = True
    keep_source: bool = False
    max_recaptures: int = 8
    autotune: bool = True
    autotune_cache: str | None = None
    graph_cache: bool = True
    isolate_capture: bool = True
    tp: int | str = 1
    cpu_bind: str | tuple | None = None
    tp_timeout_s: float = 300.0
    tp_rank: int = 0
    tp_group: str | None = None

    def __post_init__(self) -> None:
        """Refuse values of the wrong kind here, by field, not deep inside a capture."""

        def bad(name: str, wants: str) -> ValueError:
            return ValueError(f"amxopt: AmxConfig.{name} must be {wants}, got {getattr(self, name)!r}")

        for f in dataclasses.fields(self):
            if f.type == "bool" and not isinstance(getattr(self, f.name), bool):
                raise bad(f.name, "True or False")
        if not isinstance(self.provider, str):
            raise bad("provider", "a provider name")
        if self.passes is not None:
            if isinstance(self.passes, str) or not all(isinstance(p, str) for p in self.passes):
                raise bad("passes", "a sequence of pass names, such as ('replace_linear',)")
            object.__setattr__(self, "passes", tuple(self.passes))
        if not isinstance(self.max_recaptures, int) or isinstance(self.max_recaptures, bool) or self.max_recaptures < 1:
            raise bad("max_recaptures", "an int >= 1")
        tp_ok = self.tp == "env" if isinstance(self.tp, str) else isinstance(self.tp, int) and self.tp >= 1
        if not tp_ok or isinstance(self.tp, bool):
            raise bad("tp", "a positive int or 'env'")
        timeout = self.tp_timeout_s
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not 0 < timeout < math.inf:
            raise bad("tp_timeout_s", "a finite number of seconds > 0")
        if self.autotune_cache is not None and not isinstance(self.autotune_cache, (str, os.PathLike)):
            raise bad("autotune_cache", "None or a directory path")
        if not (
            self.cpu_bind is None
            or isinstance(self.cpu_bind, str)
            and self.cpu_bind == "none"
            or _cores_per_rank(self.cpu_bind)
        ):
            raise bad("cpu_bind", "None, 'none' or one entry of cores per rank, such as ('0-3', '4-7')")

    def cache_dir(self) -> pathlib.Path:
        """Root of the on-disk caches (``autotune_cache``, else the XDG cache directory)."""
        if self.autotune_cache:
            return pathlib.Path(os.path.expanduser(self.autotune_cache))
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        # The XDG spec: an empty or relative XDG_CACHE_HOME is ignored (not the working directory).
        return pathlib.Path(xdg if os.path.isabs(xdg) else os.path.expanduser("~/.cache"), "amxopt")


def _cores_per_rank(cpu_bind: object) -> bool:
    """Whether ``cpu_bind`` is one entry of cores per rank, each as the tp runner reads it: a core id,
    a ``"0-3,8"`` string or an iterable of ids (a list, range, set, numpy array)."""
    from amxopt.runtime.tp import _parse_cores

    if isinstance(cpu_bind, (str, bytes)) or not hasattr(cpu_bind, "__len__"):
        return False
    try:
        for entry in cpu_bind:
            _parse_cores(entry)
    except (TypeError, ValueError):
        return False
    return True
