"""The reload benchmark's shared-tier rows: kvtier through a Redis/Valkey server against raw
GET/SET of the same bytes on the same server, in the same run.

kvtier's row saves the prompt through a store whose CPU tier writes through to the server (save
time ends when the last chunk is on the server), then per repeat opens a new store with an empty
CPU tier, so every chunk comes from the server: LMCache's redis connector (two GETs per chunk:
metadata, then bytes), checksum verify, scatter, and the promotion into CPU. The raw row is
redis-py's plain ``SET`` / ``GET`` of the same sealed chunks, one after another as kvtier does.
"""

from __future__ import annotations

import os
import time
import uuid

from kvtier import keys as chain
from kvtier.bench.common import BenchError, Progress
from kvtier.bench.engine_kv import EngineKV, clobber_blocks, verify_blocks
from kvtier.bench.reload_spec import PathTimes, ReloadResult, ReloadSpec
from kvtier.bench.reload_timing import load_prompt, prompt_jobs, save_prompt
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.transfer import TierWorker
from kvtier.urls import redact


def measure_shared(spec: ReloadSpec, kv: EngineKV, keys: list[bytes], result: ReloadResult,
                   progress: Progress) -> None:
    """Add paths ``shared`` and ``shared_raw`` to ``result`` (see the module docstring)."""
    url = spec.shared_url
    namespace = f"kvtier-bench-{uuid.uuid4().hex[:8]}"  # never another run's chunks
    config = StoreConfig(cpu_bytes=result.cpu_tier_bytes, namespace=namespace, shared_url=url,
                         shared_write_bytes=result.cpu_tier_bytes, shared_timeout_ms=10_000)
    total = result.paths["shared"] = PathTimes(
        "kvtier, shared tier (Redis/Valkey)",
        note="save: TierWorker.save + drain + the write-through landing on the server; reload: per repeat a new "
        "store with an empty CPU tier, every chunk read from the server (LMCache redis connector: 2 GETs), "
        "verified, scattered")
    gets = result.paths["shared.storage"] = PathTimes("  store: get (from the server, promoted into CPU)")
    raw = result.paths["shared_raw"] = PathTimes(
        "raw SET / GET of the same bytes, same server",
        note="redis-py, one SET / GET per sealed chunk in turn, no verify, no scatter")
    skeys = [chain.storage_key(k, kv.layout.fingerprint) for k in keys]
    save_job, load_job = prompt_jobs(kv, keys)
    with ChunkStore(config) as store:
        if not store.shared_stats()["up"]:
            raise BenchError(f"the shared tier {redact(url)} is unreachable; see the log above.")
        worker = TierWorker(kv.layout, store, spec.chunk_blocks, spec.backend)
        try:
            progress(f"shared tier: saving through {redact(url)}")
            begin = time.perf_counter()
            save_prompt(worker, save_job, spec.num_chunks)
            if not store._flush(600):
                raise BenchError("the shared tier's writes did not land within 600 s.")
            total.save_ms.append((time.perf_counter() - begin) * 1e3)
        finally:
            worker.close()
        stats = store.shared_stats()
        if stats["writes"] != spec.num_chunks:
            raise BenchError(f"{stats['writes']} of {spec.num_chunks} chunks reached the shared tier: {stats}")
        chunks = [store.get(k) for k in skeys]
        sealed = [bytes(c.data.numpy()) for c in chunks]
        for c in chunks:
            c.release()
    for r in range(spec.repeats):
        with ChunkStore(config) as store:
            timed = _TimedGets(store)
            worker = TierWorker(kv.layout, timed, spec.chunk_blocks, spec.backend)
            try:
                clobber_blocks(kv.layout, kv.dst)
                ms = load_prompt(worker, load_job, "shared")
                if worker.stats.shared_hit_tokens != spec.prompt_tokens:
                    raise BenchError(f"only {worker.stats.shared_hit_tokens} tokens came from the shared tier.")
            finally:
                worker.close()
            verify_blocks(kv.layout, kv.src, kv.dst, "kvtier reload from the shared tier")
            total.reload_ms.append(ms)
            gets.reload_ms.append(timed.ms)
            progress(f"shared tier {r + 1}/{spec.repeats}: reload {ms:.0f} ms ({ms / spec.num_chunks:.2f} ms a chunk), "
                     "verified")
            if r == spec.repeats - 1:
                for k in skeys:
                    assert store.contains(k) is Tier.CPU  # promoted
                    store.remove(k)  # deletes it from the server too
    _measure_raw(url, sealed, raw, spec.repeats, progress)
    result.verified.append("shared")


class _TimedGets:
    """The store, with the time spent in ``get`` summed (ms)."""

    def __init__(self, store: ChunkStore):
        self._store = store
        self.ms = 0.0

    def get(self, key: bytes, cpu_only: bool = False):
        begin = time.perf_counter()
        try:
            return self._store.get(key, cpu_only)
        finally:
            self.ms += (time.perf_counter() - begin) * 1e3

    def __getattr__(self, name: str):
        return getattr(self._store, name)


def _measure_raw(url: str, sealed: list[bytes], times: PathTimes, repeats: int, progress: Progress) -> None:
    import redis

    client = redis.Redis.from_url(url.replace("valkey://", "redis://", 1), socket_timeout=30,
                                  password=os.environ.get("KVTIER_SHARED_PASSWORD"))
    names = [f"kvtier-bench-raw-{uuid.uuid4().hex}-{i}" for i in range(len(sealed))]
    try:
        for r in range(repeats):
            begin = time.perf_counter()
            for name, value in zip(names, sealed):
                client.set(name, value)
            times.save_ms.append((time.perf_counter() - begin) * 1e3)
            begin = time.perf_counter()
            got = [client.get(name) for name in names]
            times.reload_ms.append((time.perf_counter() - begin) * 1e3)
            if got != sealed:
                raise BenchError("raw GETs returned other bytes than were SET.")
            progress(f"raw SET/GET {r + 1}/{repeats}: {times.save_ms[-1]:.0f} / {times.reload_ms[-1]:.0f} ms")
    finally:
        client.delete(*names)
        client.close()
