"""Fixtures of the storage tests: a directory where O_DIRECT reads work."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def o_direct_refusal(directory: Path) -> str | None:
    """Why O_DIRECT cannot read a 4 KiB block in ``directory`` (tmpfs, for one, refuses), or None."""
    if not hasattr(os, "O_DIRECT"):
        return "this platform has no O_DIRECT"
    path = directory / ".odirect-check"
    path.write_bytes(b"\0" * 4096)
    buf = mmap.mmap(-1, 4096)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            return None if os.readv(fd, [buf]) == 4096 else "a short O_DIRECT read"
        finally:
            os.close(fd)
    except OSError as exc:
        return "O_DIRECT is refused on this file system" if exc.errno == errno.EINVAL else str(exc)
    finally:
        buf.close()
        path.unlink()


@pytest.fixture
def direct_dir(tmp_path):
    """An empty directory on a file system that takes O_DIRECT: ``tmp_path``, or one under the
    repository's ``.pytest-tmp`` (git-ignored) when ``tmp_path`` is on tmpfs; skips where neither does."""
    if o_direct_refusal(tmp_path) is None:
        yield tmp_path
        return
    local = ROOT / ".pytest-tmp" / tmp_path.name
    local.mkdir(parents=True, exist_ok=True)
    try:
        reason = o_direct_refusal(local)
        if reason is not None:
            pytest.skip(reason)
        yield local
    finally:
        shutil.rmtree(local, ignore_errors=True)
