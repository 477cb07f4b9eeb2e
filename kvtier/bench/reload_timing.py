"""How the reload benches move and time a prompt's KV: the save and load jobs of one prompt, one
save or reload run to the end, and clocks around the ops and store calls inside a path.

Shared by the reload bench's phases (:mod:`kvtier.bench.reload`, :mod:`.reload_disk`,
:mod:`.shared`) and :mod:`.beside_gemm`, so every path times the same calls the same way. Times
are wall milliseconds, CUDA synchronized at both ends.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from kvtier.bench.common import BenchError
from kvtier.bench.engine_kv import EngineKV
from kvtier.jobs import LoadJob, SaveJob
from kvtier.ops import ChunkSpan
from kvtier.storage import ChunkStore
from kvtier.transfer import TierWorker


def chunk_spans(host: torch.Tensor, count: int, ids: torch.Tensor, chunk_blocks: int, chunk_bytes: int) -> list[ChunkSpan]:
    """``count`` whole chunks back to back in ``host``, chunk ``i`` over blocks ``ids[i*cb:(i+1)*cb]``."""
    return [ChunkSpan(host[i * chunk_bytes : (i + 1) * chunk_bytes], chunk_blocks, 0,
                      ids[i * chunk_blocks : (i + 1) * chunk_blocks]) for i in range(count)]


def prompt_jobs(kv: EngineKV, keys: list[bytes]) -> tuple[SaveJob, LoadJob]:
    """Save the prompt from ``kv.src``; load it into ``kv.dst``."""
    return (SaveJob("bench", tuple(keys), tuple(kv.src.tolist())),
            LoadJob("bench", tuple(keys), 0, tuple(kv.dst.tolist())))


def save_prompt(worker: TierWorker, job: SaveJob, num_chunks: int) -> float:
    """Run ``job`` to the end (copy out, seal, put); its wall time in ms."""
    before = worker.stats.saved_chunks
    begin = time.perf_counter()
    worker.save([job])
    worker.drain()
    elapsed = (time.perf_counter() - begin) * 1e3
    stored = worker.stats.saved_chunks - before
    if stored != num_chunks:
        raise BenchError(f"save stored {stored} of {num_chunks} chunks ({worker.stats.dropped_saves} dropped "
                         "for want of CPU tier room); see the log above.")
    return elapsed


def load_prompt(worker: TierWorker, job: LoadJob, tier: str) -> float:
    """Run ``job`` until its blocks are written (device synchronized); its wall time in ms."""
    begin = time.perf_counter()
    failed = worker.load(job)
    sync(worker.layout.device)
    elapsed = (time.perf_counter() - begin) * 1e3
    if failed:
        raise BenchError(f"reload from {tier} left {len(failed)} of {len(job.block_ids)} blocks unloaded; see the log above.")
    return elapsed


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(device: torch.device, fn: Callable[[], object]) -> float:
    """Wall time of ``fn()`` in ms, ``device`` synchronized before and after."""
    sync(device)
    begin = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - begin) * 1e3


class Clock:
    """Adds the wall time of the calls it wraps to ``ms`` (CUDA synchronized at both ends)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ms = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            sync(self.device)
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(self.device)
                self.ms += (time.perf_counter() - begin) * 1e3

        return timed


class TimedStore:
    """A ChunkStore whose data calls add their wall time to ``clock``; behaviour unchanged."""

    def __init__(self, store: ChunkStore, clock: Clock):
        self._store = store
        for name in ("allocate", "put", "contains", "prefix_hits", "get", "remove", "will_need"):
            setattr(self, name, clock.wrap(getattr(store, name)))

    def __getattr__(self, name: str):  # anything else, untimed
        return getattr(self._store, name)
