"""Files amxopt writes that others may be reading: kernel choices, cached graphs, saved artifacts."""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import pathlib
import tempfile
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def replacing(path: pathlib.Path) -> Iterator[pathlib.Path]:
    """A new file beside ``path`` to write in the block, renamed over ``path`` when the block ends
    (and removed when it raises): a reader never sees half a file, a process that has the old one
    open or memory-mapped keeps it whole, and an interrupted write leaves the old file as it was.
    The file gets the mode a plain ``open`` would give it (a temporary file is the owner's alone)."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp", delete=False) as f:
        staged = pathlib.Path(f.name)
    try:
        yield staged
        staged.chmod(0o666 & ~_umask())
        os.replace(staged, path)
    except BaseException:
        staged.unlink(missing_ok=True)
        raise


def _umask() -> int:
    # Linux shows it in /proc (since 4.7). Setting it to read it (Python has no getter) would give a
    # file another thread creates meanwhile the mode of the value set: only where /proc lacks it.
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_tensors(tensors: dict[str, torch.Tensor], path: str | pathlib.Path, metadata: dict | None = None) -> None:
    """``safetensors.torch.save_file``, for tensors of which some may share memory (a view of
    another, one tensor read by two graphs): safetensors refuses those, so each one that overlaps
    an earlier one is written as a copy of its own. Tensors side by side in one storage (a loaded
    artifact's, all in one mapping) are written as they are."""
    from safetensors.torch import save_file

    starts: dict[int, list[int]] = {}  # per storage, the byte spans kept as they are: sorted, disjoint
    ends: dict[int, list[int]] = {}
    own = {}
    for name, t in tensors.items():
        own[name] = t
        if t.device.type == "meta" or not t.numel():
            continue
        storage = t.untyped_storage().data_ptr()
        lo = t.data_ptr()
        hi = lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
        first, last = starts.setdefault(storage, []), ends.setdefault(storage, [])
        i = bisect.bisect_right(first, lo)
        if (i and last[i - 1] > lo) or (i < len(first) and first[i] < hi):
            own[name] = t.clone()
        else:
            first.insert(i, lo)
            last.insert(i, hi)
    save_file(own, str(path), metadata=metadata)


def os_error(e: OSError) -> str:
    """``e`` as a user reads it: a path that is a file where a directory is needed is said so
    (``mkdir`` calls it "File exists", or "Not a directory" for a path under it)."""
    if e.filename and e.errno in (errno.EEXIST, errno.ENOTDIR):
        where = pathlib.Path(e.filename)
        for path in (where, *where.parents):
            if path.exists() and not path.is_dir():
                return f"{path} is a file, not a directory"
    return str(e)
