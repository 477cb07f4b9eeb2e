"""The reload bench's cold disk path (``disk_cold``): the prompt saved once into a store with a
disk tier, then per repeat reloaded through a new store on the same directory, its chunk files
written back and dropped from the page cache first, so every chunk is read from disk.

The bench deletes its chunk files at the end, or on the way out when a phase failed.
"""

from __future__ import annotations

import os
import time

import torch

from kvtier import keys as chain
from kvtier.bench.common import BenchError, Progress, evict_from_page_cache
from kvtier.bench.engine_kv import EngineKV, clobber_blocks, verify_blocks
from kvtier.bench.reload_spec import NAMESPACE, PathTimes, ReloadResult, ReloadSpec
from kvtier.bench.reload_timing import Clock, TimedStore, load_prompt, prompt_jobs, save_prompt
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.transfer import TierWorker


def measure_disk_cold(spec: ReloadSpec, kv: EngineKV, keys: list[bytes], config: StoreConfig,
                      result: ReloadResult, progress: Progress) -> None:
    """Add paths ``disk_cold`` and ``disk_cold.storage`` to ``result``: the prompt's ``keys`` saved
    from ``kv.src`` through a store of ``config`` (its disk tier included), then reloaded cold into
    ``kv.dst`` and verified, ``spec.repeats`` times."""
    total = result.paths["disk_cold"] = PathTimes(
        "kvtier, disk tier, cold reload",
        note="save: once, TierWorker.save + drain + ChunkStore.close (which waits for the write-through to disk); "
        "reload: per repeat a new store on the directory, its files fsynced and dropped from the page cache "
        "(posix_fadvise DONTNEED) first",
    )
    reads = result.paths["disk_cold.storage"] = PathTimes("  store: get (disk read)")
    skeys = [chain.storage_key(k, kv.layout.fingerprint) for k in keys]
    save_job, load_job = prompt_jobs(kv, keys)
    progress(f"disk tier: saving to {config.disk_path}")
    done = False
    try:
        store = ChunkStore(config)
        try:
            worker = TierWorker(kv.layout, store, spec.chunk_blocks, spec.backend)
            try:
                begin = time.perf_counter()  # the store's start-up is not part of the save
                save_prompt(worker, save_job, spec.num_chunks)
            finally:
                worker.close()
        finally:
            store.close()
        total.save_ms.append((time.perf_counter() - begin) * 1e3)
        for r in range(spec.repeats):
            _drop_page_cache(config.disk_path)
            progress(f"disk tier {r + 1}/{spec.repeats}: cold reload through a new store")
            with ChunkStore(config) as store:
                hits = store.prefix_hits(skeys)
                if hits != [Tier.DISK] * len(skeys):
                    raise BenchError(f"a new store finds {len(hits)} of {len(skeys)} chunks on disk in {config.disk_path}.")
                storage = Clock(torch.device("cpu"))
                worker = TierWorker(kv.layout, TimedStore(store, storage), spec.chunk_blocks, spec.backend)
                try:
                    clobber_blocks(kv.layout, kv.dst)
                    load_ms = load_prompt(worker, load_job, "disk")
                finally:
                    worker.close()
                verify_blocks(kv.layout, kv.src, kv.dst, "kvtier cold reload from disk")
                total.reload_ms.append(load_ms)
                reads.reload_ms.append(storage.ms)
                progress(f"disk tier {r + 1}/{spec.repeats}: reload {load_ms:.0f} ms, verified")
                if r == spec.repeats - 1:
                    done = True
                    _forget(store, skeys)
    finally:
        if not done:  # delete whatever chunk files the bench left, without hiding why it stopped
            try:
                with ChunkStore(config) as store:
                    _forget(store, skeys)
            except Exception as exc:  # noqa: BLE001
                progress(f"could not delete the bench's chunk files in {config.disk_path}: {exc}")
    result.verified.append("disk_cold")


def _forget(store: ChunkStore, skeys: list[bytes]) -> None:
    for skey in skeys:
        store.remove(skey)


def _drop_page_cache(path: str) -> None:
    """Write back and evict the bench's chunk files from the OS page cache: the next read is cold."""
    evict_from_page_cache(entry.path for entry in os.scandir(path)
                          if entry.is_file(follow_symlinks=False) and entry.name.startswith(f"{NAMESPACE}@"))

