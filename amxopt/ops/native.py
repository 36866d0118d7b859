"""The ``native`` provider: amxopt's C++ kernels (``csrc/``), loaded on every x86-64 CPU.

The library is compiled from the project's sources by :mod:`amxopt.ops.build` the first time it is
needed (the Makefile's install step does that by running ``amxopt info``) and found up to date later.
``AMXOPT_NATIVE=0`` in the environment keeps it unloaded (every op then runs the reference).
It registers the CPU kernels of every ``amxopt`` op and picks, per op call, the best tier the CPU
runs: ``amx`` (oneDNN brgemm on AMX tiles), ``avx512_bf16``, or ``fp32`` (bf16 models computed in
fp32: on CPUs without bf16 dot products eager bf16 is emulated and several times slower than fp32).
:func:`max_tier` caps the tier, so one machine can test every tier below its best.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import NamedTuple

import torch

from amxopt.ops import build

logger = logging.getLogger(__name__)

TIERS = ("amx", "avx512_bf16", "fp32")  # best first
# What each tier needs from the CPU, by /proc/cpuinfo flag (the C++ side reads CPUID itself).
TIER_FLAGS = {
    "amx": ("amx_tile", "amx_bf16", "avx512_bf16"),
    "avx512_bf16": ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
    "fp32": (),
}


@functools.cache
def _cpuinfo(field: str) -> str | None:
    """The first ``field: value`` of /proc/cpuinfo (None where the file or the field is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(field)), None)
    except OSError:
        return None


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    return frozenset((_cpuinfo("flags") or "").split())


def cpu_model() -> str:
    return _cpuinfo("model name") or "unknown"


def tier_supported(tier: str) -> tuple[bool, str]:
    """Whether this CPU runs ``tier`` (the amx tier also on software tiles, see :func:`amx_emulated`), and if
    not, which flags it lacks."""
    if tier == "amx" and _software_tiles():
        return True, ""
    missing = [f for f in TIER_FLAGS[tier] if f not in cpu_flags()]
    if missing:
        return False, f"CPU lacks {', '.join(missing)}"
    if available()[0] and TIERS.index(tier) < TIERS.index(cpu_tier()):
        # The instructions are there, oneDNN's kernels of the tier are not (the C++ side asks it).
        capped = {k: os.environ[k] for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA") if os.environ.get(k)}
        return False, f"oneDNN does not run its {tier} kernels here ({capped or 'not capped'})"
    return True, ""


@functools.cache
def load() -> tuple[bool, str]:
    """Build (if needed) and load the C++ library; (loaded?, why)."""
    if sys.platform != "linux" or os.uname().machine != "x86_64":
        return False, "amxopt's kernels are for Linux on x86-64"
    if os.environ.get("AMXOPT_NATIVE") == "0":
        return False, "disabled by AMXOPT_NATIVE=0"
    try:
        torch.ops.load_library(str(build.build()))
    except Exception as e:  # noqa: BLE001 - any build/load failure means "run the reference"
        logger.warning("amxopt: native kernels unavailable, every op runs the reference: %s", e)
        return False, f"C++ kernels did not build/load: {str(e).strip().splitlines()[-1][:200]}"
    amx_schedule()  # read once, like the tier: a bad AMXOPT_AMX_SCHEDULE fails here, on every CPU
    return True, f"amxopt C++ kernels, best tier here: {cpu_tier()}"


def available() -> tuple[bool, str]:
    return load()


def _ops():
    return torch.ops.amxopt_native


def cpu_tier() -> str:
    """The best bf16 tier this CPU runs: ``amx``, ``avx512_bf16`` or ``fp32``."""
    return _ops().cpu_tier()


def active_tier() -> str:
    return _ops().active_tier()


def vec_isa() -> str:
    """The vector ISA of the drivers' epilogues, norms and softmax: ``avx512_bf16`` (AVX-512 with one-instruction
    bf16 rounding), ``avx512``, ``avx2`` or ``default``."""
    return _ops().vec_isa()


def amx_emulated() -> bool:
    """Whether the amx tier runs its tile kernel on software tiles: ``AMXOPT_EMULATE_AMX=1`` on a CPU with
    AVX-512-BF16 and without AMX (read once per process). For tests: the amx tier's drivers and tile
    kernel checked on CPUs without AMX, many times slower than on AMX tiles. An error on a CPU without
    AVX-512-BF16, which the amx tier's other kernels need."""
    return _ops().amx_emulated()


def _software_tiles() -> bool:
    """:func:`amx_emulated`, without loading the library where the environment does not ask for it."""
    return os.environ.get("AMXOPT_EMULATE_AMX") == "1" and load()[0] and amx_emulated()


def refuse_software_tiles(tool: str) -> None:
    """Raise where the amx tier runs on software tiles: a benchmark's times would say nothing of AMX."""
    if _software_tiles():
        raise RuntimeError(f"{tool}: AMXOPT_EMULATE_AMX=1 runs the amx tier on software tiles (for tests); unset it")


def amx_emulated_blocks() -> int:
    """How many 32-column blocks the software tiles have multiplied in this process."""
    return _ops().amx_emulated_blocks()


AMX_SCHEDULES = ("groups", "rows")


def amx_schedule() -> str:
    """The order of the amx tier's tile GEMM where a linear does not choose one: ``groups`` (the
    default) or ``rows`` (each thread its own rows, A packed in K chunks that stay in L1). Autotune
    times the two per linear shape on AMX and gives the faster to the node (``amxopt.linear``'s
    ``amx_schedule``), unless the process pins one (:func:`amx_schedule_pinned`), which then runs
    everywhere."""
    name = _ops().amx_schedule()
    return AMX_SCHEDULES[0] if name == "default" else name


def amx_schedule_pinned() -> bool:
    """Whether the process fixes the schedule for every GEMM (``AMXOPT_AMX_SCHEDULE``, or inside
    :func:`use_amx_schedule`): linears' own choices are then ignored, and autotune makes none."""
    return _ops().amx_schedule() != "default"


def amx_schedule_matters(rows: int, k: int) -> bool:
    """Whether the two schedules run different engines for a GEMM of ``rows`` x ``k`` here (the
    active tier is amx, and the shape is one the Rows schedule takes, at this thread count)."""
    return _ops().amx_schedule_matters(rows, k)


class Setting:
    """A process-wide setting, applied when it is called, as ``torch.set_grad_enabled`` is: a bare
    call keeps it for the rest of the process; ``with`` keeps it for the block and then puts the
    earlier value back."""

    def __init__(self, restore: Callable[[], None]):
        self._restore = restore  # puts the earlier value back

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self._restore()


def use_amx_schedule(schedule: str) -> Setting:
    """Pin the amx tier's tile GEMM to ``schedule`` (process-wide, over every linear's own choice),
    e.g. to compare the two in one process; ``with`` pins it for a block (:class:`Setting`)."""
    if schedule not in AMX_SCHEDULES:
        raise ValueError(f"amxopt: unknown AMX GEMM schedule {schedule!r}; known: {AMX_SCHEDULES}")
    previous = _ops().amx_schedule()  # "default" where nothing was pinned
    _ops().set_amx_schedule(schedule)
    return Setting(lambda: _ops().set_amx_schedule(previous))


def gemm_engine(tier: str, rows: int) -> str:
    return _ops().gemm_engine(tier, rows)


def attention_engine(tier: str, bf16: bool) -> str:
    return _ops().attention_engine(tier, bf16)


def release_output_pool() -> None:
    """Give the native ops' pool of freed large outputs (32 MB or more, kept so that a model's next
    call reuses them instead of faulting in fresh pages) back to the system. The pool holds at most
    ``AMXOPT_OUTPUT_POOL_MB``, read once, at the pool's first use (default: an eighth of the memory the
    process may use, its cgroup's limit counted, at most 2 GB; 0 turns it off); past that, the
    oldest freed outputs go back first."""
    if load()[0]:
        _ops().release_output_pool()


def output_pool_bytes() -> int:
    """Bytes of freed outputs the native ops' pool holds now."""
    return _ops().output_pool_bytes() if load()[0] else 0


def output_pool_enabled() -> bool:
    """Whether the native ops' large outputs come from the pool (not switched off, nor capped to 0
    by ``AMXOPT_OUTPUT_POOL_MB``)."""
    return bool(load()[0] and _ops().output_pool_enabled())


def use_output_pool(enabled: bool) -> Setting:
    """Switch the native ops' output pool on or off (process-wide; ``with``: for a block, see
    :class:`Setting`), e.g. to time a model with and without it in one process. Switched off, new
    large outputs come from ATen's allocator (fresh pages); the pool keeps what it holds for later
    and still takes back the outputs it gave (``release_output_pool()`` gives its memory back).
    ``AMXOPT_OUTPUT_POOL_MB=0`` keeps it off."""
    if not load()[0]:
        return Setting(lambda: None)
    previous = _ops().set_output_pool_enabled(enabled)
    return Setting(lambda: _ops().set_output_pool_enabled(previous))


class WorkSplit(NamedTuple):
    """How a kernel cuts its work for a thread count: ``items`` of ``rows`` x ``cols`` outputs
    (attention: ``rows`` query rows of one segment and head; ``cols`` 0)."""

    rows: int
    cols: int
    items: int

    def balance(self, threads: int) -> float:
        """How fully the items keep ``threads`` (>= 1) threads busy (1: evenly shared)."""
        most = -(-self.items // max(threads, 1))  # items on the busiest thread
        return self.items / (max(threads, 1) * most) if self.items else 1.0


def linear_work_split(rows: int, n: int, k: int, threads: int) -> WorkSplit:
    """The work items of a bf16 amxopt.linear of ``rows`` x ``k`` (even) -> ``n`` with a packed
    weight on the active tier at ``threads`` threads, in the pinned AMX schedule if any, else the
    default one: the tuned ones where they keep every thread busy, else smaller. ``rows`` of the
    K-blocked and Rows engines are the rows of a chunk."""
    m, blocks, items = _ops().linear_work_split(rows, n, k, threads)
    return WorkSplit(m, blocks * 32, items)


def attention_work_split(q_lens: list[int], heads: int, bf16: bool, threads: int) -> WorkSplit:
    """The work items (segment x head x query block) of an amxopt.varlen_attention with segments of
    ``q_lens`` queries on the active tier at ``threads`` threads."""
    rows, items = _ops().attention_work_split(q_lens, heads, bf16, threads)
    return WorkSplit(rows, 0, items)


_cap = TIERS[0]  # the cap set by max_tier (the C++ side holds the same value)


def max_tier(tier: str) -> Setting:
    """Run the kernels at ``tier`` at most (process-wide; ``with``: for a block, see :class:`Setting`),
    e.g. the fp32 tier on an AMX machine."""
    if tier not in TIERS:
        raise ValueError(f"amxopt: unknown tier {tier!r}; known: {TIERS}")
    previous = _cap
    _set_cap(tier)
    return Setting(lambda: _set_cap(previous))


def capped() -> bool:
    """Whether :func:`max_tier` holds the kernels below the best tier this CPU runs."""
    return active_tier() != cpu_tier()


def _set_cap(tier: str) -> None:
    global _cap
    _ops().set_max_tier(tier)
    _cap = tier


@functools.cache
def onednn_isa() -> str:
    """The ISA oneDNN picks for a bf16 matmul here (from ``ONEDNN_VERBOSE``, in a fresh process)."""
    code = "import torch; a = torch.randn(64, 64).bfloat16(); torch.mm(a, a)"
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"unknown ({e})"
    isa = re.search(r"isa:([^\n]*)", out)
    return isa.group(1).strip() if isa else "none (torch does not send bf16 matmuls to oneDNN on this CPU)"
