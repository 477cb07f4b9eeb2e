"""kvtier beside a running model (CUDA): ``TierWorker`` saves and reloads the prompt in a loop
while the default stream runs a loop of bf16 GEMMs in steps, as a model's forward would.

Reported: the GEMMs' TFLOP/s alone and beside the copies (the slowdown is what kvtier costs the
model), and the whole path's GB/s meanwhile (save = ``save`` + ``drain``, reload = ``load``,
each moving the prompt's bytes); then the same for the worker's ops alone on the same chunks
(no store work), which tells the copies' cost from the store work's. The worker's "engine stream" is a side stream of the copier
thread, so a save waits for nothing of the GEMMs (a real save waits for the one forward that
wrote its blocks). The last reload is checked byte for byte.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator

import torch

from kvtier import codec
from kvtier import keys as chain
from kvtier.bench.common import BenchError, Progress
from kvtier.bench.engine_kv import EngineKV, host_buffer, verify_blocks
from kvtier.bench.reload_timing import chunk_spans, prompt_jobs
from kvtier.storage import ChunkStore
from kvtier.transfer import TierWorker

GEMM_N = 8192  # bf16 [N, N] @ [N, N], like a large model's MLP
STEP_GEMMS = 8  # GEMMs per "forward step": the loop then waits for them, as an engine waits for its outputs
WINDOW_S = 4.0  # seconds of GEMMs beside the copies


@dataclass(frozen=True, slots=True)
class BesideGemm:
    """One copy loop beside the GEMMs: their TFLOP/s alone and beside it, and its GB/s (1e9 B/s)
    meanwhile."""

    path: str
    gemm_alone_tflops: float
    gemm_tflops: float
    save_gbps: float
    reload_gbps: float
    copy_gbps: float  # both directions together
    copies: int  # saves and reloads that ran wholly inside the window

    @property
    def slowdown_pct(self) -> float:
        return 100 * (1 - self.gemm_tflops / self.gemm_alone_tflops)


class _Gemm:
    def __init__(self, device: torch.device):
        self.a, self.b = (torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16) for _ in range(2))
        self.c = torch.empty_like(self.a)

    def run(self, iters: int) -> tuple[float, float]:
        """(TFLOP/s, wall seconds) of ``iters`` GEMMs on the current stream, launched a step at a
        time and waited for after each step (the wait releases the GIL, as an engine's does; a
        launch queue kept full would hold it). Launch gaps count: kvtier's Python delaying the
        engine thread is part of what it costs."""
        begin = time.perf_counter()
        for done in range(0, iters, STEP_GEMMS):
            for _ in range(min(STEP_GEMMS, iters - done)):
                torch.matmul(self.a, self.b, out=self.c)
            torch.cuda.current_stream().synchronize()
        seconds = time.perf_counter() - begin
        return 2 * GEMM_N**3 * iters / seconds / 1e12, seconds


def measure(kv: EngineKV, keys: list[bytes], store: ChunkStore, chunk_blocks: int, backend: str,
            nbytes: int, progress: Progress) -> list[BesideGemm]:
    """Both loops beside the GEMMs, the whole path and then its ops alone (the same copies, no
    store work); ``nbytes``: the prompt's KV bytes (one save or reload)."""
    device = kv.layout.device
    gemm = _Gemm(device)
    gemm.run(24)  # warm up (cuBLAS heuristics, clocks)
    _, seconds = gemm.run(48)
    iters = max(48, int(WINDOW_S / (seconds / 48)))
    alone, _ = gemm.run(iters)
    progress(f"beside a GEMM loop: GEMMs alone {alone:.0f} TFLOP/s; now with kvtier saving and reloading")
    skeys = [chain.storage_key(k, kv.layout.fingerprint) for k in keys]
    save_job, load_job = prompt_jobs(kv, keys)
    worker = TierWorker(kv.layout, store, chunk_blocks, backend)
    try:
        def save() -> Iterator[None]:
            for skey in skeys:  # so that the save stores every chunk again
                store.remove(skey)
            yield
            worker.save([save_job])
            worker.drain()

        def reload() -> Iterator[None]:
            yield
            if worker.load(load_job):
                raise BenchError("a reload beside the GEMMs left blocks unloaded; see the log above.")

        whole = _beside(gemm, iters, save, reload, device, alone, nbytes, "kvtier whole path")
        verify_blocks(kv.layout, kv.src, kv.dst, "kvtier reload beside a GEMM loop")
        chunk_bytes = codec.chunk_bytes(kv.layout, chunk_blocks)
        num_chunks = len(keys)
        with host_buffer(num_chunks * chunk_bytes, device) as host:
            sums = torch.empty(num_chunks, dtype=torch.int64, device=device)
            out = chunk_spans(host, num_chunks, kv.src, chunk_blocks, chunk_bytes)
            back = chunk_spans(host, num_chunks, kv.dst, chunk_blocks, chunk_bytes)

            def gather() -> Iterator[None]:
                yield
                worker._gather(kv.layout, out, checksums_out=sums)

            def scatter() -> Iterator[None]:
                yield
                if not all(worker._scatter(kv.layout, back, sums)):
                    raise BenchError("ops-only reload beside the GEMMs failed its checksums.")

            ops = _beside(gemm, iters, gather, scatter, device, alone, nbytes, f"ops only ({worker.backend})")
    finally:
        worker.close()
    return [whole, ops]


def _beside(gemm: _Gemm, iters: int, save, reload, device: torch.device, alone: float, nbytes: int,
            path: str) -> BesideGemm:
    """Loop ``save`` and ``reload`` (generators: set-up, ``yield``, then the timed part) on a
    thread with its own stream while ``gemm`` runs ``iters`` GEMMs."""
    log: list[tuple[str, float, float]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def copier() -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream(device)):
                while not stop.is_set():
                    for kind, step in (("save", save), ("reload", reload)):
                        steps = step()
                        next(steps)  # untimed set-up
                        begin = time.perf_counter()
                        next(steps, None)
                        log.append((kind, begin, time.perf_counter()))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            errors.append(exc)

    thread = threading.Thread(target=copier, name="kvtier-bench-copier", daemon=True)
    try:
        thread.start()
        while len(log) < 2 and thread.is_alive():  # steady state: one save and one reload done
            time.sleep(0.01)
        w0 = time.perf_counter()
        busy, _ = gemm.run(iters)
        w1 = time.perf_counter()
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]
    inside = [x for x in log if x[1] >= w0 and x[2] <= w1]
    if not inside:
        raise BenchError(f"{path}: no save or reload ran wholly inside the {w1 - w0:.1f} s GEMM window.")

    def gbps(kind: str | None) -> float:
        runs = [x for x in inside if kind is None or x[0] == kind]
        return nbytes * len(runs) / max(1e-9, sum(x[2] - x[1] for x in runs)) / 1e9 if runs else 0.0

    return BesideGemm(path, alone, busy, gbps("save"), gbps("reload"), gbps(None), len(inside))
