"""Build amxopt's C++ kernels (``csrc/``) into one shared library, each source with its ISA's flags.

``torch.utils.cpp_extension`` compiles every source with the same flags, which cannot express
"this translation unit is AVX-512, that one is plain x86-64"; so this module runs the compiler
itself, with torch's own include paths, ABI flag and libraries (what cpp_extension would use). The
drivers compile for plain x86-64, so the library loads on every x86-64 CPU; the ISA units are only
entered after ``cpu.cpp`` has seen their instructions on the CPU.

The library lands in ``_build/<hash>/`` where the hash covers the sources, the flags, the compiler
and the torch version: a change of any rebuilds, and a stale library is never loaded.
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess

import torch

logger = logging.getLogger(__name__)

CSRC = pathlib.Path(__file__).parent / "csrc"
BUILD = pathlib.Path(__file__).parent / "_build"
LIBRARY = "libamxopt_native.so"

_AVX2 = ("-mavx2", "-mfma", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2")
_AVX512 = ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
_AVX512_VEC = _AVX512 + ("-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512")
_AVX512_BF16 = _AVX512_VEC + ("-mavx512bf16",)

# Source -> its ISA flags. Plain x86-64 units first: at link time the first definition of an inline
# function wins, and it must be one that any x86-64 CPU can run.
SOURCES: dict[str, tuple[str, ...]] = {
    "ops.cpp": (),
    "cpu.cpp": (),
    "gemm.cpp": (),
    "attention.cpp": (),
    "norm.cpp": (),
    "glue.cpp": (),
    "conv.cpp": (),
    "amx_emulated.cpp": (),
    "vec_default.cpp": ("-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"),
    "vec_avx2.cpp": _AVX2,
    "vec_avx512.cpp": _AVX512_VEC,
    "vec_avx512_bf16.cpp": _AVX512_BF16,
    "gemm_avx512_bf16.cpp": _AVX512_BF16,
    "gemm_amx.cpp": ("-mamx-tile", "-mamx-bf16"),
}


def _cxx() -> str:
    return os.environ.get("CXX", "g++")


def _torch_paths() -> tuple[list[str], list[str]]:
    """torch's include and library directories. cpp_extension is imported here, only for a build:
    it imports setuptools, about 5 MB of RSS in every process that imports amxopt."""
    from torch.utils import cpp_extension

    return cpp_extension.include_paths(), cpp_extension.library_paths()


def _flags() -> list[str]:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    # at::parallel_for is OpenMP in these wheels: -fopenmp links the libgomp torch already loaded,
    # so there is one thread pool, sized by torch.set_num_threads.
    return ["-std=c++20", "-O3", "-fPIC", "-fopenmp", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]


_LIBS = ["-lc10", "-ltorch_cpu", "-ltorch"]


def _link_flags() -> list[str]:
    libdirs = _torch_paths()[1]
    return ["-shared", "-fopenmp", *[f"-L{d}" for d in libdirs], *[f"-Wl,-rpath,{d}" for d in libdirs], *_LIBS]


@functools.cache
def _fingerprint() -> str:
    # torch's directory stands for its include and library paths (which name it), without the import.
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    compiler = subprocess.run([_cxx(), "--version"], capture_output=True, text=True, check=True).stdout
    torch_dir = str(pathlib.Path(torch.__file__).parent)
    for part in (repr(SOURCES), repr(_flags()), repr(_LIBS), torch_dir, compiler, torch.__version__):
        h.update(part.encode())
    return h.hexdigest()[:16]


def _compile(source: str, flags: tuple[str, ...], out_dir: pathlib.Path) -> pathlib.Path:
    obj = out_dir / (source.removesuffix(".cpp") + ".o")
    includes = [f"-I{p}" for p in _torch_paths()[0]]
    cmd = [_cxx(), *_flags(), *includes, *flags, "-c", str(CSRC / source), "-o", str(obj)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"amxopt: compiling {source} failed:\n{' '.join(cmd)}\n{result.stderr[-4000:]}")
    return obj


def library_path() -> pathlib.Path:
    """Where the library for the current sources lives (built or not)."""
    return BUILD / _fingerprint() / LIBRARY


def build() -> pathlib.Path:
    """Compile and link the library unless an up-to-date one exists; return its path."""
    target = library_path()
    if target.exists():
        return target
    BUILD.mkdir(exist_ok=True)
    with open(BUILD / ".lock", "w") as lock:  # one build at a time (tests, TP workers, two shells)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return target
        logger.warning("amxopt: building the native kernels (once per source change, 1-3 minutes)")
        work = target.parent.with_suffix(".tmp")
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            objs = list(pool.map(lambda item: _compile(*item, work), SOURCES.items()))
        cmd = [_cxx(), *map(str, objs), *_link_flags(), "-o", str(work / LIBRARY)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"amxopt: linking the native kernels failed:\n{result.stderr[-4000:]}")
        for obj in objs:
            obj.unlink()
        for stale in BUILD.iterdir():
            if stale.is_dir() and stale != work:
                shutil.rmtree(stale, ignore_errors=True)
        work.rename(target.parent)
    return target
