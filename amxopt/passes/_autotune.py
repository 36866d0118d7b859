"""Never slower than eager: time amxopt's kernel against the ATen code it would replace.

A replace pass calls :func:`compare` for each node it could rewrite (when ``AmxConfig.autotune``
is on and the provider is ``native``): both sides run on random inputs of the node's shapes (the
example sizes behind symbolic dims), a warm-up call each (two where the first two took under 1 s
together; the last decides alone when a side takes over 0.2 s and is 3x behind, or 1.5x where the
two calls took longer than the rounds' budget),
then interleaved rounds (short ops repeated to 2 ms a sample) until
one side is clearly faster (1.5x after two rounds), five rounds are done or 5 s have passed; the
best sample of each side decides (noise on a shared machine only adds time).

ATen must win clearly, and twice: it is kept only where it is more than ``_MARGIN`` (10%) faster,
in the first timing and again in a second, independent one (the less favourable of the two to ATen
is reported; a lead of 3x needs no second). Nearer than that, amxopt's op stays. Isolated best-of
timings favoured ATen's kernels: measured on a 2-core AMX Xeon VM, in one process each, Wan2.1-1.3B
with every rewrite kept (autotune off) ran 1.71x eager bf16 against 1.54x as autotuned by the
plain best-of rule (212 nodes left to ATen), and Qwen3-Omni's audio encoder 1.36x against 1.21x
(67 left); the decisions lost were within a few % (Wan's FFN-down linear 0.95x, Qwen3-VL's 0.97x)
or a burst of noise (an Omni linear once timed at 0.66x, then at 0.91-0.96x in 7 of 8 repeats).
With this rule: Wan 1.61x tuned (1 node left) against 1.60x, Omni 1.37x against 1.38x. In a
model, amxopt's kernels also see the other core slowed by a neighbour and take over its work
(common.h, ``WorkShares``), which a best sample does not show: over 200 interleaved calls, Omni's
FFN-down linear ran at 0.99x ATen by the best samples, 1.22x by the means. The pass keeps the ATen
node, with the timings as its reason, when ATen wins.

On the amx tier a Linear's GEMM may run in either of two schedules (``native.AMX_SCHEDULES``,
gemm.cpp): where its shape makes them differ, :func:`amx_schedule` first times the two against each
other and the faster becomes the node's ``amx_schedule`` (then amxopt's side of the ATen comparison
runs in it). A process that pins a schedule (``AMXOPT_AMX_SCHEDULE``) is not asked.

Decisions are cached on disk (``AmxConfig.autotune_cache``, default ``~/.cache/amxopt``), keyed by
the CPU model, torch version, the kernels' build fingerprint (and whether AMX tiles are emulated), the
AMX GEMM schedule where the process pins Rows, this rule, the active tier and the op's shapes, so a
second ``optimize()`` of the same model times nothing.

Under tensor parallelism every rank runs the passes, and rank 0 decides for all of them (it times
or reads its cache, the others receive its decisions): ranks that decided a node differently would
shard different graphs, and their collectives would no longer pair up.
"""

from __future__ import annotations

import dataclasses
import fcntl
import functools
import json
import logging
import os
import pathlib
import time
from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist
from torch.fx.experimental.symbolic_shapes import optimization_hint

from amxopt.config import AmxConfig
from amxopt.files import os_error, replacing
from amxopt.ops import build, native

logger = logging.getLogger(__name__)
T = TypeVar("T")

_ROUNDS = 5
_DECISIVE = 1.5  # a ratio this far from 1 after two rounds settles it
_SAMPLE_S = 2e-3  # short ops are repeated within a sample up to this long
_SLOW_S, _FAR = 0.2, 3.0  # a warm-up call this slow, and this far behind the other side, settles it
_BUDGET_S = 5.0  # rounds stop after this long (after the first)
_FIRST_CALLS_S = 1.0  # a first pair of calls shorter than this is called again before the warm-up decides
_MARGIN = 0.1  # ATen is kept only where it is faster by more than this, twice (module docstring)
_POLICY = f"ATen by {_MARGIN:.0%}, twice"  # in the cache key: decisions taken by another rule are timed again
_SCHEDULE_MARGIN = 0.03  # the Rows schedule replaces the default only where faster by more than this


@dataclasses.dataclass(frozen=True)
class ScheduleTiming:
    """Best-of milliseconds of one GEMM in each of the amx tier's schedules (native.AMX_SCHEDULES)."""

    groups_ms: float
    rows_ms: float
    cached: bool = False

    @property
    def choice(self) -> str:
        return "rows" if self.rows_ms * (1 + _SCHEDULE_MARGIN) < self.groups_ms else "groups"

    def __str__(self) -> str:
        cached = ", cached" if self.cached else ""
        return f"AMX {self.choice} schedule (groups {self.groups_ms:.3g} ms, rows {self.rows_ms:.3g} ms{cached})"


@dataclasses.dataclass(frozen=True)
class Timing:
    """Medians of one comparison; ``op`` describes the op and shapes that were timed."""

    op: str
    amxopt_ms: float
    aten_ms: float
    cached: bool = False
    schedule: ScheduleTiming | None = None  # a GEMM's AMX schedule, where autotune chose one first

    @property
    def amxopt_wins(self) -> bool:
        return self.amxopt_ms <= self.aten_ms * (1 + _MARGIN)

    @property
    def options(self) -> dict:
        """What the replacement takes from this timing: the Rows schedule where it was faster."""
        return {"amx_schedule": "rows"} if self.schedule and self.schedule.choice == "rows" else {}

    def __str__(self) -> str:
        tie = f" [within {_MARGIN:.0%}: amxopt kept]" if self.aten_ms < self.amxopt_ms and self.amxopt_wins else ""
        order = f"; {self.schedule}" if self.schedule else ""
        return (
            f"{self.op}: amxopt {self.amxopt_ms:.3g} ms, ATen {self.aten_ms:.3g} ms "
            f"({self.aten_ms / max(self.amxopt_ms, 1e-9):.2f}x){tie}{order}{' [cached]' if self.cached else ''}"
        )


def enabled(config: AmxConfig) -> bool:
    return config.autotune and config.provider == "native"


def concrete(shape) -> tuple[int, ...]:
    """A fake tensor's shape with every symbolic dim replaced by the example size behind it."""
    return tuple(optimization_hint(s) for s in shape)


def randn(shape, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape) * scale).to(dtype)


def _layout(value: torch.Tensor) -> str:
    """``""`` for a contiguous tensor, else ``:strides AxBxC``: a transposed view (attention's q, k, v
    in Wan) or a channels-last activation (after the direct conv2d) takes other kernels than a
    contiguous one, so the cache keys them apart."""
    shape, strides = concrete(value.shape), concrete(value.stride())
    expected, step = [], 1
    for size in reversed(shape):
        expected.append(step)
        step *= size
    dense = all(n == 1 or s == e for n, s, e in zip(shape, strides, reversed(expected)))
    return "" if dense else ":strides " + "x".join(map(str, strides))


def meta(value):
    """What :func:`materialize` gives for ``value``, without data: the description that keys a
    decision. A cached decision then costs no random inputs (they took 4 of the 14 s of capturing
    Qwen3-VL-2B's vision tower on a Zen 3, 104 Linears of 6 shapes)."""
    return _like(value, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))


def materialize(value, scale: float = 1.0):
    """A random real tensor like ``value`` (a node's fake tensor), with its shape and strides (the
    kernels on both sides of a timing see the layout the graph gives them), or ``value`` itself if
    not a tensor."""
    return _like(value, lambda shape, dtype: randn(shape, dtype, scale))


def _like(value, fill: Callable[[list[int], torch.dtype], torch.Tensor]):
    """A tensor of ``fill``'s values with ``value``'s shape and strides; a broadcast (expanded) view
    is ``fill``'s values along its other dims, expanded."""
    if not isinstance(value, torch.Tensor):
        return value
    shape, strides = concrete(value.shape), concrete(value.stride())
    if 0 in strides:
        return fill([1 if st == 0 else n for n, st in zip(shape, strides)], value.dtype).expand(shape)
    values = fill(list(shape), value.dtype)
    return torch.empty_strided(shape, strides, dtype=value.dtype, device=values.device).copy_(values)


def describe(*tensors) -> str:
    """``1x784x1024:bf16, 4096x1024:bf16`` for the cache key and the report (plus the strides of a
    tensor that is not contiguous): of each tensor as :func:`materialize` makes it (a node's fake
    value is described as it is timed)."""
    return ", ".join(
        "x".join(map(str, concrete(t.shape))) + ":" + str(t.dtype).removeprefix("torch.") + _layout(t)
        if t is not None
        else "-"
        for t in map(meta, tensors)
    )


# Settings read once per process that change which code either side runs: the ISA of amxopt's
# epilogues and ATen's kernels, and oneDNN's (under ATen's GEMMs and amxopt's brgemm).
_ISA_SETTINGS = ("AMXOPT_VEC_ISA", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")


@functools.cache
def _build_context() -> str:
    path = build.library_path()
    tiles = "|software AMX tiles" if native.amx_emulated() else ""  # their timings say nothing of AMX's
    settings = "".join(f"|{name}={os.environ[name]}" for name in _ISA_SETTINGS if os.environ.get(name))
    return f"{native.cpu_model()}|torch {torch.__version__}|kernels {path.parent.name}{tiles}{settings}"


def context() -> str:
    """What a decision holds for: the CPU, the code of both sides, and the thread count."""
    # Both sides split their work between the threads: a lead at 2 threads says little of 56. Read
    # per lookup: the process may change it between two optimize() calls.
    return f"{_build_context()}|{torch.get_num_threads()} threads"


def _cache_file(config: AmxConfig) -> pathlib.Path:
    return config.cache_dir() / "kernel_choices.json"


@functools.cache
def _load(path: pathlib.Path) -> dict:
    return _read(path)


def _read(path: pathlib.Path) -> dict:
    """The decisions in ``path``: each a pair of positive timings; anything else is dropped."""
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(table, dict):
        return {}
    return {
        k: v
        for k, v in table.items()
        if isinstance(v, list) and len(v) == 2 and all(isinstance(t, (int, float)) and t > 0 for t in v)
    }


def reload() -> None:
    """Read the decisions from disk again at the next lookup (another process may have added some)."""
    _load.cache_clear()


def _store(path: pathlib.Path, key: str, value: list[float]) -> None:
    """Add one decision to ``path``, merged under a lock with what other processes stored since
    this one read it."""
    _load(path)[key] = value
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_name(f".{path.name}.lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            table = _read(path)
            table[key] = value
            with replacing(path) as staged:
                staged.write_text(json.dumps(table, indent=0, sort_keys=True))
    except OSError as e:  # a read-only home is no reason to fail optimize()
        if path not in _UNWRITABLE:  # once per file: every later decision fails alike
            _UNWRITABLE.add(path)
            logger.warning(
                "amxopt: could not save kernel choices to %s: %s (they are timed again in the next process; "
                "AmxConfig(autotune_cache=...) names a writable directory)",
                path,
                os_error(e),
            )


_UNWRITABLE: set[pathlib.Path] = set()


# Run once before this process's first timing, then dropped: the capture child's, which asks the
# parent to stop packing weights (a timing beside it would share the cores).
before_timing: Callable[[], None] | None = None


def _quiet() -> None:
    global before_timing
    hook, before_timing = before_timing, None
    if hook is not None:
        hook()


def _sample(fn: Callable[[], object], repeat: int) -> float:
    t = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t) / repeat


def _time(run_amxopt: Callable[[], object], run_aten: Callable[[], object]) -> tuple[float, float]:
    """Best-of-rounds milliseconds of each side (noise on a shared machine only ever adds time)."""
    with torch.no_grad():
        # Warm-up: first-call costs (kernel JIT, allocator) are not the steady state. Where one side
        # is slow and far behind already, more rounds would only cost time (an emulated bf16 conv
        # takes a minute on a CPU without bf16): the warm-up decides.
        # Where the warm-up pair alone outlasts the rounds' budget (at most one round would follow:
        # Wan2.1's attention at 480p, 17 s against eager's 45 s a call, took 62 s a round), a clear
        # lead decides too; first-call costs are a small part of such calls.
        amx, aten = [_sample(run_amxopt, 1)], [_sample(run_aten, 1)]
        if amx[0] + aten[0] < _FIRST_CALLS_S:
            # A first call pays one-off costs (oneDNN creates its primitive: under load a tiny Qwen
            # Conv3d once took 540 ms, then 0.2 ms, and the report read 1500x): where they are cheap
            # to pay again, the second calls are the warm-up that decides.
            amx, aten = [_sample(run_amxopt, 1)], [_sample(run_aten, 1)]
        far = _DECISIVE if amx[0] + aten[0] > _BUDGET_S else _FAR
        if max(amx[0], aten[0]) > _SLOW_S and not 1 / far < aten[0] / amx[0] < far:
            return amx[0] * 1e3, aten[0] * 1e3
        repeat = max(1, min(1000, int(_SAMPLE_S / max(min(amx[0], aten[0]), 1e-7))))
        amx, aten = [], []
        start = time.perf_counter()
        for round_ in range(_ROUNDS):
            # In turn first: neither side always runs in the caches (and clock) the other leaves.
            sides = ((amx, run_amxopt), (aten, run_aten))
            for samples, run in sides if round_ % 2 == 0 else reversed(sides):
                samples.append(_sample(run, repeat))
            ratio = min(aten) / max(min(amx), 1e-12)
            decisive = round_ >= 1 and not 1 / _DECISIVE < ratio < _DECISIVE
            if decisive or time.perf_counter() - start > _BUDGET_S:
                break
    return min(amx) * 1e3, min(aten) * 1e3


def _agreed(config: AmxConfig, decide: Callable[[], T]) -> T:
    """``decide()``; in a tensor-parallel rank, rank 0's result, sent to every rank.

    Each rank runs the passes on its own cores and would time there: ranks that decided a node
    differently would shard different graphs, whose collectives then pair up wrongly (a hang, or
    sums of unrelated tensors). So rank 0 times (or reads its cache) and the others wait for its
    decision, each within ``AmxConfig.tp_timeout_s``. A graph written for one rank without a
    process group (``amxopt dump --tp``) decides alone.
    """
    if not isinstance(config.tp, int) or config.tp == 1 or config.tp_group is None or not dist.is_initialized():
        return decide()
    group = dist.distributed_c10d._resolve_process_group(config.tp_group)
    box = [decide() if dist.get_rank(group) == 0 else None]
    try:
        dist.broadcast_object_list(box, group=group, group_src=0)
    except RuntimeError as e:  # gloo's own words name neither the wait nor the setting
        raise RuntimeError(
            f"amxopt: tp rank {dist.get_rank(group)}: rank 0's autotune decision did not reach every rank within "
            f"tp_timeout_s ({config.tp_timeout_s:g} s; the ranks' captures took longer than that apart): raise "
            f"tp_timeout_s, or optimize with AmxConfig(autotune=False) ({e})"
        ) from e
    return box[0]


Runs = Callable[[], tuple[Callable[[], object], Callable[[], object]]]


def compare(op: str, config: AmxConfig, setup: Runs, schedule: ScheduleTiming | None = None) -> Timing:
    """Time both sides of one rewrite (or read the cached result); ``op`` names kind and shapes (and
    the AMX schedule amxopt's side runs in where :func:`amx_schedule` chose Rows, which ``schedule``
    says). ``setup()`` makes the random inputs and gives the two sides' runs (amxopt's, ATen's): it is
    called only where there is something to time. In a tensor-parallel rank: rank 0's decision
    (:func:`_agreed`)."""
    return _agreed(config, lambda: _compare(op, config, setup, schedule))


def _compare(op: str, config: AmxConfig, setup: Runs, schedule: ScheduleTiming | None) -> Timing:
    path = _cache_file(config)
    table = _load(path)
    process = native.amx_schedule()  # where a call does not choose; settable: read per lookup
    order = "" if process == "groups" else f"|AMX {process} schedule"  # the default keeps its keys
    key = f"{context()}{order}|{_POLICY}|{native.active_tier()}|{op}"
    if key in table:
        amx_ms, aten_ms = table[key]
        return Timing(op, amx_ms, aten_ms, cached=True, schedule=schedule)
    runs = setup()
    _quiet()
    amx_ms, aten_ms = _time(*runs)
    if not Timing(op, amx_ms, aten_ms).amxopt_wins and amx_ms < _FAR * aten_ms:  # confirm ATen's lead
        amx_ms, aten_ms = max((amx_ms, aten_ms), _time(*runs), key=lambda t: t[1] / t[0])
    _store(path, key, [amx_ms, aten_ms])
    timing = Timing(op, amx_ms, aten_ms, schedule=schedule)
    logger.info("amxopt: timed %s", timing)
    return timing


def amx_schedule(
    op: str, config: AmxConfig, rows: int, k: int, run: Callable[[str], Callable[[], object]]
) -> ScheduleTiming | None:
    """The faster of the amx tier's GEMM schedules for one GEMM of ``rows`` x ``k`` (``run(schedule)``
    gives a run in one, its inputs made only where a timing is not cached), or the cached decision;
    None where there is no choice to make: another tier, a shape both schedules run alike, a process
    that pins a schedule (then it runs everywhere), or software tiles (their timings say nothing of
    AMX).

    The two are amxopt's own kernels with the same result bit for bit (the same fp32 sums in the
    same order), so a near tie costs little either way: Rows, measured on fewer CPUs, must be
    faster by ``_SCHEDULE_MARGIN``, and again in a second timing that runs the two in the other
    order (the less favourable to Rows is kept). The thread count is in the key (``_context``):
    Rows splits the rows between them. In a tensor-parallel rank: rank 0's decision (:func:`_agreed`)."""
    if native.amx_schedule_pinned() or native.amx_emulated():
        return None
    # Whether the schedules differ depends on the thread count, which tp ranks may not share: agreed too.
    return _agreed(config, lambda: _amx_schedule(op, config, run) if native.amx_schedule_matters(rows, k) else None)


def _amx_schedule(op: str, config: AmxConfig, run: Callable[[str], Callable[[], object]]) -> ScheduleTiming | None:
    path = _cache_file(config)
    table = _load(path)
    key = f"{context()}|AMX schedules|{op}"
    if key in table:
        return ScheduleTiming(*table[key], cached=True)
    _quiet()
    groups_ms, rows_ms = _time(run("groups"), run("rows"))
    if ScheduleTiming(groups_ms, rows_ms).choice == "rows":  # confirm, rows first
        again_rows, again_groups = _time(run("rows"), run("groups"))
        if again_groups / again_rows < groups_ms / rows_ms:
            groups_ms, rows_ms = again_groups, again_rows
    _store(path, key, [groups_ms, rows_ms])
    timing = ScheduleTiming(groups_ms, rows_ms)
    logger.info("amxopt: timed %s: %s", op, timing)
    return timing
