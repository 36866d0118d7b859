"""Files amxopt writes that others may be reading: kernel choices, cached graphs, saved artifacts."""

from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import tempfile
from collections.abc import Iterator


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
    mask = os.umask(0o022)  # (read by setting it: Python has no getter)
    os.umask(mask)
    return mask


def os_error(e: OSError) -> str:
    """``e`` as a user reads it: a path that is a file where a directory is needed is said so
    (``mkdir`` calls it "File exists")."""
    where = pathlib.Path(e.filename) if e.filename else None
    if where is not None and e.errno in (errno.EEXIST, errno.ENOTDIR) and where.exists() and not where.is_dir():
        return f"{where} is a file, not a directory"
    return str(e)
