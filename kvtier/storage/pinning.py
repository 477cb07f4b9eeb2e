"""The CPU tier's pool pinned the fast way on a CUDA host (LMCache's allocation, replaced).

LMCache 0.5.6 allocates its pool as one pinned ``torch.empty``: ``cudaHostAlloc`` faults in and
pins every page on one thread, then LMCache writes zeros over all of it. A 40 GiB tier took
about 50 s of an engine's start that way. Here the pool is an anonymous mapping whose slices of
:data:`SLICE_BYTES` are faulted in by several threads at once (``MADV_POPULATE_WRITE``, or zeroed
where the kernel lacks it), then registered with CUDA (``cudaHostRegister``, portable and mapped,
so the copy kernels reach it through the host address) in ranges of :data:`REGISTER_BYTES`: an
asynchronous copy across two registrations fails (CUDA's "invalid argument"). A 40 GiB tier:
9.2 s on an H100 host. Pages are zero as mapped: nothing is written over them afterwards.

:func:`install` puts :func:`allocate` and :func:`free` in place of LMCache's
``memory_management._allocate_cpu_memory`` / ``_free_cpu_memory`` for the plain pinned pool
(not its shared-memory or huge-page pools), once per process, on CUDA hosts only. A pool that
cannot be made this way (registration refused) is unmapped and LMCache's own allocation runs,
with one log line; an LMCache without those two names pins its pool itself (one line says so).
On a host of several NUMA nodes the pool's pages come preferably from the node the rank's GPU
hangs off (``mbind`` ``MPOL_PREFERRED``, the node read from sysfs); every rank pins its own
pool at the same time, in its own process.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import mmap
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)

SLICE_BYTES = 1 << 30  # faulted in by one thread
REGISTER_BYTES = 64 << 30  # registered at once: an async copy must not cross two registrations, and one
# registration of >= 512 GiB fails
MAX_THREADS = 16
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_MPOL_PREFERRED = 1
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}.get(platform.machine())

Register = Callable[[int, int], None]  # (address, bytes): pin it for the GPU; raises on failure
Unregister = Callable[[int], None]


@dataclass
class _Pool:
    """Kept while LMCache holds the pool: the mapping (the tensor's storage) and what was registered."""

    mapping: mmap.mmap
    array: ctypes.Array
    registered: list[int] = field(default_factory=list)
    unregister: Unregister | None = None


_pools: dict[int, _Pool] = {}  # address -> pool
_lock = threading.Lock()
_installed = False


def allocate(size: int, register: Register | None = None, unregister: Unregister | None = None,
             threads: int | None = None, node: int | None = None) -> torch.Tensor:
    """A ``uint8`` tensor of ``size`` bytes over fresh zeroed pages (preferably of NUMA node
    ``node``), faulted in by ``threads`` threads (default: up to :data:`MAX_THREADS`), then, with
    ``register``, registered in ranges of :data:`REGISTER_BYTES`. Raises what ``register``
    raises, after undoing what was done."""
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = (ctypes.c_uint8 * size).from_buffer(mapping)
    address = ctypes.addressof(array)
    if node is not None and not prefer_node(address, size, node):
        logger.info("kvtier CPU tier: pages not bound to NUMA node %d (mbind refused); the kernel places them.", node)
    pool = _Pool(mapping, array, unregister=unregister)
    pieces = [(address + offset, min(SLICE_BYTES, size - offset)) for offset in range(0, size, SLICE_BYTES)]
    workers = threads or min(MAX_THREADS, os.cpu_count() or 1, len(pieces))
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="kvtier-pin") as pool_threads:
            list(pool_threads.map(lambda piece: _fault_in(*piece), pieces))
        for offset in range(0, size, REGISTER_BYTES) if register is not None else ():
            register(address + offset, min(REGISTER_BYTES, size - offset))
            pool.registered.append(address + offset)
    except BaseException:
        _release(pool)
        raise
    tensor = torch.frombuffer(array, dtype=torch.uint8)
    with _lock:
        _pools[address] = pool
    return tensor


def free(tensor: torch.Tensor) -> bool:
    """Unregister a pool :func:`allocate` made (its pages go once no tensor views it); False if
    ``tensor`` is not one."""
    with _lock:
        pool = _pools.pop(tensor.data_ptr(), None)
    if pool is None:
        return False
    _release(pool)
    return True


def _release(pool: _Pool) -> None:
    for address in pool.registered if pool.unregister is not None else ():
        try:
            pool.unregister(address)
        except Exception as exc:  # an engine shutting down: the process's exit unpins it anyway
            logger.debug("kvtier CPU tier: unregistering %#x: %s", address, exc)
    pool.registered.clear()


def _fault_in(address: int, nbytes: int) -> None:
    """Give ``[address, address + nbytes)`` its pages now (a ctypes call: other threads run meanwhile)."""
    if _libc().madvise(ctypes.c_void_p(address), ctypes.c_size_t(nbytes), _MADV_POPULATE_WRITE) != 0:
        ctypes.memset(address, 0, nbytes)  # a kernel without MADV_POPULATE_WRITE


def huge_share(tensor: torch.Tensor, smaps: str = "/proc/self/smaps") -> float | None:
    """The share of a pool :func:`allocate` made that the kernel backs with transparent huge pages
    (``AnonHugePages`` of its mappings in ``smaps``), 0 to 1; None if ``tensor`` is not such a pool
    or ``smaps`` cannot be read. Said at start: a pool's pages decide how many translations the
    GPU's copies need."""
    with _lock:
        pool = _pools.get(tensor.data_ptr())
    if pool is None:
        return None
    start, end, huge, inside = tensor.data_ptr(), tensor.data_ptr() + len(pool.mapping), 0, False
    try:
        with open(smaps) as f:
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and not head.endswith(":"):  # a mapping's first line: its address range
                    inside = start <= int(head.split("-")[0], 16) < end
                elif inside and head == "AnonHugePages:":
                    huge += int(line.split()[1]) << 10
    except (OSError, ValueError):
        return None
    return huge / (end - start)


def prefer_node(address: int, nbytes: int, node: int) -> bool:
    """Ask the kernel for pages of NUMA node ``node`` in ``[address, address + nbytes)`` (before
    they are faulted in); False where it refuses or this machine's ``mbind`` is unknown."""
    if _SYS_MBIND is None or not 0 <= node < 64:
        return False
    mask = ctypes.c_ulong(1 << node)
    return _libc().syscall(_SYS_MBIND, ctypes.c_void_p(address), ctypes.c_ulong(nbytes), _MPOL_PREFERRED,
                           ctypes.byref(mask), ctypes.c_ulong(65), 0) == 0


def gpu_numa_node(device: int, sysfs: str = "/sys") -> int | None:
    """The NUMA node CUDA device ``device`` hangs off, on a host of several nodes (None: one node,
    or not known)."""
    if len(glob.glob(f"{sysfs}/devices/system/node/node[0-9]*")) < 2:
        return None
    props = torch.cuda.get_device_properties(device)
    ids = [getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if None in ids:
        return None
    try:
        with open(f"{sysfs}/bus/pci/devices/{ids[0]:04x}:{ids[1]:02x}:{ids[2]:02x}.0/numa_node") as f:
            node = int(f.read())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


def cuda_register(device: int) -> tuple[Register, Unregister]:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's CUDA runtime, on CUDA device
    ``device`` (a thread left on device 0 would make a context there)."""
    cudart = torch.cuda.cudart()

    def register(address: int, nbytes: int) -> None:
        torch.cuda.set_device(device)
        error = cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_PORTABLE_MAPPED)
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} B failed: {error}")

    def unregister(address: int) -> None:
        cudart.cudaHostUnregister(address)

    return register, unregister


def install() -> None:
    """Make LMCache's pinned CPU pools through :func:`allocate` in this process (CUDA hosts only)."""
    global _installed
    if _installed or not torch.cuda.is_available():
        return
    import lmcache.v1.memory_management as lm

    original_alloc, original_free = getattr(lm, "_allocate_cpu_memory", None), getattr(lm, "_free_cpu_memory", None)
    if original_alloc is None or original_free is None:  # another LMCache: it pins its pool its own way
        logger.info("kvtier CPU tier: this LMCache has no _allocate_cpu_memory / _free_cpu_memory; it pins the "
                    "pool itself (slower to start).")
        _installed = True
        return

    def allocate_cpu_memory(size, numa_mapping=None, shm_name=None, use_hugepages=False):
        if size == 0 or shm_name or use_hugepages:
            return original_alloc(size, numa_mapping, shm_name, use_hugepages=use_hugepages)
        begin = time.perf_counter()
        device = torch.cuda.current_device()
        register, unregister = cuda_register(device)
        try:
            tensor = allocate(size, register, unregister, node=gpu_numa_node(device))
        except Exception as exc:
            logger.warning("kvtier CPU tier: pinning %.1f GiB failed (%s); LMCache pins it instead.",
                           size / (1 << 30), exc)
            return original_alloc(size, numa_mapping, shm_name, use_hugepages=use_hugepages)
        took_s, huge = time.perf_counter() - begin, huge_share(tensor)
        logger.info("kvtier CPU tier: %.1f GiB pinned in %.1f s%s.", size / (1 << 30), took_s,
                    "" if huge is None else f", {huge:.0%} of it in transparent huge pages")
        return tensor

    def free_cpu_memory(buffer, size=None, numa_mapping=None, shm_name=None, use_hugepages=False):
        if not free(buffer):
            original_free(buffer, size, numa_mapping, shm_name, use_hugepages=use_hugepages)

    lm._allocate_cpu_memory, lm._free_cpu_memory = allocate_cpu_memory, free_cpu_memory
    _installed = True
