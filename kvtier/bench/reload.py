"""The reload benchmark: a prompt's KV saved from engine blocks, then reloaded into other blocks.

Every path moves the same bytes, the prompt's KV (:attr:`ReloadSpec.prompt_bytes`). The phases
run in this order because each frees memory the next one needs and the last overwrites the KV:

1. ``kvtier``: ``TierWorker.save`` + ``drain`` into a CPU-only store, then ``TierWorker.load``
   into the other blocks, compared byte for byte. The ops and store calls inside are timed in
   place; what is left (``kvtier.rest``) is the checksum (seal on save, verify on load, unless
   the ops compute it while copying) and overhead. On a CPU the same again per chunk-checksum
   candidate (``kvtier-xxh3-128``, ``kvtier-crc32c``, ``kvtier-blake3``: a plain torch copy, then
   the checksum on the host), so the chosen one is picked by measurement.
2. ``disk_cold`` (with a disk path): one save into a store with a disk tier, timed until the
   store's close has waited for the write-through; then per repeat a new store on the same
   directory, its files written back and dropped from the page cache, so the reload reads disk.
3. ``naive``: the same gather/scatter through the ``reference`` ops backend (one copy per block
   and region), ops only; timed on a subset of chunks and scaled when the whole would be too slow.
4. ``raw``: one contiguous copy of the same bytes (host to host on CPU, pinned D2H/H2D on CUDA),
   measured in phase 1, once per repeat after the kvtier paths, so both see the same neighbours.

This module runs the phases and measures ``kvtier``, ``naive`` and ``raw`` itself; the spec and
result types are in :mod:`.reload_spec`, the timed save and reload in :mod:`.reload_timing`, the
disk phase in :mod:`.reload_disk`, the shared tier's rows in :mod:`.shared`, the GEMM loop in
:mod:`.beside_gemm`; :mod:`.report` prints the result.
"""

from __future__ import annotations

import os
import resource
import time
import uuid
from dataclasses import dataclass

import torch

from kvtier import codec
from kvtier import keys as chain
from kvtier.bench import beside_gemm
from kvtier.bench.common import BenchError, Progress, cpu_model
from kvtier.bench.engine_kv import EngineKV, clobber_blocks, host_buffer, make_engine_kv, verify_blocks
from kvtier.bench.reload_disk import measure_disk_cold
from kvtier.bench.reload_spec import NAMESPACE, PathTimes, ReloadResult, ReloadSpec
from kvtier.bench.reload_timing import Clock, TimedStore, chunk_spans, load_prompt, prompt_jobs, save_prompt, timed_ms
from kvtier.bench.shared import measure_shared
from kvtier.codec import DEFAULT_HOST_CHECKSUM
from kvtier.codec.checksums import NAMES
from kvtier.ops import ChunkSpan, checksums_in_kernel, pick_backend, resolve_backend
from kvtier.storage import ChunkStore, StoreConfig
from kvtier.transfer import TierWorker

NAIVE_BUDGET_S = 20.0  # the naive path's total time; beyond it a subset of chunks is timed and scaled


def run(spec: ReloadSpec, progress: Progress) -> ReloadResult:
    """Measure every path of ``spec``; raises :class:`~kvtier.bench.common.VerifyError` if a reload
    returns other bytes and :class:`~kvtier.bench.common.BenchError` if a chunk is not stored or loaded."""
    start = time.perf_counter()
    load_at_start = os.getloadavg()[0]
    others_at_start = _others_cpu_s()
    progress(f"filling {_gib(2 * spec.prompt_bytes)} of engine KV ({2 * spec.prompt_blocks} blocks) with random bytes")
    kv = make_engine_kv(spec.geometry, spec.prompt_blocks, spec.device, spec.seed, NAMESPACE)
    gather = pick_backend(kv.layout, spec.backend)[0]
    result = ReloadResult(
        spec, device_name(spec.device), gather.__module__.rsplit(".", 1)[-1].removesuffix("_ops"),
        kv.kind, len(kv.layout.regions), spec.cpu_tier_bytes(), (load_at_start, 0.0),
    )
    tokens = torch.randint(0, 128_000, (spec.prompt_tokens,), generator=torch.Generator().manual_seed(spec.seed))
    # A fresh salt per run: chunks a crashed run left on disk can never satisfy this run's lookups.
    keys = chain.chunk_keys(tokens.tolist(), spec.chunk_tokens, chain.namespace(NAMESPACE, uuid.uuid4().hex))
    progress(f"opening the CPU tier ({_gib(result.cpu_tier_bytes)})")
    with ChunkStore(StoreConfig(cpu_bytes=result.cpu_tier_bytes, namespace=NAMESPACE)) as store:
        _measure_kvtier_and_raw(spec, kv, keys, store, result, progress)
        if spec.beside_gemm:
            result.beside_gemm = beside_gemm.measure(kv, keys, store, spec.chunk_blocks, spec.backend,
                                                     spec.prompt_bytes, progress)
            result.verified.append("beside_gemm")
    if spec.disk_path:
        config = StoreConfig(cpu_bytes=result.cpu_tier_bytes, disk_path=spec.disk_path,
                             disk_bytes=result.cpu_tier_bytes, namespace=NAMESPACE)
        measure_disk_cold(spec, kv, keys, config, result, progress)
    if spec.shared_url:
        measure_shared(spec, kv, keys, result, progress)
    _measure_naive(spec, kv, result, progress)
    del kv
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result.elapsed_s = time.perf_counter() - start
    result.load_avg = (load_at_start, os.getloadavg()[0])
    others_at_end = _others_cpu_s()
    if others_at_start is not None and others_at_end is not None:
        result.others_cpu_s = max(0.0, others_at_end - others_at_start)
    return result


# ---- phases -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Variant:
    """One whole-path row: ``name`` keys the result (``kvtier`` is what ``auto`` runs), ``backend``
    the ops backend, ``checksum`` the host chunk checksum when the backend computes none."""

    name: str
    label: str
    backend: str
    checksum: str | None = None


CHECKSUM_CANDIDATES = ("xxh3-128", "crc32c", "blake3")  # each after a plain torch copy, on the host


def variants(spec: ReloadSpec, kv: EngineKV) -> list[Variant]:
    """``kvtier`` (the chosen backend and checksum) and, on a CPU with ``--backend auto``, a row per
    chunk-checksum candidate: the one folded into the copy is ``kvtier`` itself when the cpu op builds."""
    backend = resolve_backend(kv.layout, spec.backend)
    fused = checksums_in_kernel(backend)
    what = f"{backend} ops, KVSUM64 in the copy" if fused else f"{backend} ops + {NAMES[DEFAULT_HOST_CHECKSUM]}"
    out = [Variant("kvtier", f"kvtier whole path ({what})", spec.backend)]
    if spec.device.type == "cpu" and spec.backend == "auto" and spec.checksum_rows:
        out += [Variant(f"kvtier-{name}", f"kvtier whole path (torch ops + {name})", "torch", name)
                for name in CHECKSUM_CANDIDATES]
    return out


class _KvtierPath:
    """One variant's TierWorker on the shared store, its rows, and one save + reload per repeat."""

    def __init__(self, spec: ReloadSpec, kv: EngineKV, keys: list[bytes], store: ChunkStore,
                 result: ReloadResult, variant: Variant):
        self.spec, self.kv, self.store, self.variant = spec, kv, store, variant
        self.ops, self.storage = Clock(spec.device), Clock(torch.device("cpu"))
        worker = TierWorker(kv.layout, TimedStore(store, self.storage), spec.chunk_blocks, variant.backend,
                            checksum=variant.checksum)
        if not (callable(getattr(worker, "_gather", None)) and callable(getattr(worker, "_scatter", None))):
            worker.close()
            raise BenchError("TierWorker no longer has _gather/_scatter: kvtier/bench/reload.py must learn its new shape.")
        # Copies in the background overlap the store work: timing them in place (synchronized)
        # would serialize what the path overlaps, so their ops are timed alone on the same chunks.
        self.background = getattr(worker, "_gather_async", None) is not None
        if not self.background:  # timed in place, inside the real path
            worker._gather, worker._scatter = self.ops.wrap(worker._gather), self.ops.wrap(worker._scatter)
        self.worker = worker
        self.skeys = [chain.storage_key(k, kv.layout.fingerprint) for k in keys]
        self.save_job, self.load_job = prompt_jobs(kv, keys)
        fused = checksums_in_kernel(worker.backend)
        name = variant.name
        self.total = result.paths[name] = PathTimes(variant.label)
        ops_label = "  ops only: gather / scatter" + (" (KVSUM64 included)" if fused else "")
        self.parts = (
            result.paths.setdefault(f"{name}.ops", PathTimes(ops_label + (", timed alone" if self.background else ""))),
            result.paths.setdefault(f"{name}.storage", PathTimes(
                "  store: allocate+put / get" + (", overlapping the copies" if self.background else ""))),
            result.paths.setdefault(f"{name}.rest", PathTimes(
                "  whole path less ops alone: what the copies do not hide" if self.background else
                "  header + overhead (rest)" if fused else "  checksum + header + overhead (rest)")),
        )

    def _ops_alone(self) -> tuple[float, float]:
        """(save ms, reload ms) of the worker's own ops over the same chunks, nothing else."""
        spec, kv, worker = self.spec, self.kv, self.worker
        chunk_bytes = codec.chunk_bytes(kv.layout, spec.chunk_blocks)
        sums = torch.empty(spec.num_chunks, dtype=torch.int64, device=spec.device)
        with host_buffer(spec.num_chunks * chunk_bytes, spec.device) as host:
            out = chunk_spans(host, spec.num_chunks, kv.src, spec.chunk_blocks, chunk_bytes)
            back = chunk_spans(host, spec.num_chunks, kv.dst, spec.chunk_blocks, chunk_bytes)
            save_ms = timed_ms(spec.device, lambda: worker._gather(kv.layout, out, checksums_out=sums))
            reload_ms = timed_ms(spec.device, lambda: worker._scatter(kv.layout, back, sums))
        return save_ms, reload_ms

    def repeat(self, r: int, progress: Progress) -> None:
        ops, storage, (part_ops, part_store, part_rest) = self.ops, self.storage, self.parts
        for skey in self.skeys:  # so that this save stores every chunk again (not timed)
            self.store.remove(skey)
        ops.ms = storage.ms = 0.0
        save_ms = save_prompt(self.worker, self.save_job, self.spec.num_chunks)
        save_parts = (ops.ms, storage.ms)
        clobber_blocks(self.kv.layout, self.kv.dst)
        ops.ms = storage.ms = 0.0
        load_ms = load_prompt(self.worker, self.load_job, "the CPU tier")
        load_parts = (ops.ms, storage.ms)
        verify_blocks(self.kv.layout, self.kv.src, self.kv.dst, f"{self.variant.name} reload from the CPU tier")
        if self.background:
            alone = self._ops_alone()
            save_parts, load_parts = (alone[0], save_parts[1]), (alone[1], load_parts[1])
        for whole, (ops_ms, store_ms), times in ((save_ms, save_parts, "save_ms"), (load_ms, load_parts, "reload_ms")):
            rest = whole - ops_ms - (0.0 if self.background else store_ms)
            for path, ms in ((self.total, whole), (part_ops, ops_ms), (part_store, store_ms), (part_rest, rest)):
                getattr(path, times).append(ms)
        progress(f"{self.variant.name} CPU tier {r + 1}/{self.spec.repeats}: save {save_ms:.0f} ms, "
                 f"reload {load_ms:.0f} ms, verified")

    def close(self) -> None:
        self.worker.close()


def _measure_kvtier_and_raw(spec: ReloadSpec, kv: EngineKV, keys: list[bytes], store: ChunkStore,
                            result: ReloadResult, progress: Progress) -> None:
    """Every variant and the raw memcpy once per repeat, in turn: a neighbour's burst on a shared
    machine then hits one repeat of each, not every repeat of one path."""
    paths: list[_KvtierPath] = []
    try:
        for variant in variants(spec, kv):
            paths.append(_KvtierPath(spec, kv, keys, store, result, variant))
        raw = _Raw(spec, kv, result)
        for r in range(spec.repeats):
            for path in paths:
                path.repeat(r, progress)
            raw.repeat(r, progress)
    finally:
        for path in paths:
            path.close()
    result.verified += [path.variant.name for path in paths]


def _measure_naive(spec: ReloadSpec, kv: EngineKV, result: ReloadResult, progress: Progress) -> None:
    gather, scatter = pick_backend(kv.layout, "reference")
    cb, n = spec.chunk_blocks, spec.num_chunks
    chunk_bytes = codec.chunk_bytes(kv.layout, cb)

    def spans(host: torch.Tensor, count: int, ids: torch.Tensor) -> list[ChunkSpan]:
        return chunk_spans(host, count, ids, cb, chunk_bytes)

    with host_buffer(chunk_bytes, spec.device) as probe:  # the faster of two: the first warms up
        probe_ms = min(timed_ms(spec.device, lambda: gather(kv.layout, spans(probe, 1, kv.src))) for _ in range(2))
    m = n
    if probe_ms * n * 2 * spec.repeats > NAIVE_BUDGET_S * 1e3:
        m = max(1, min(n, int(NAIVE_BUDGET_S * 1e3 / (probe_ms * 2 * spec.repeats))))
    scale = n / m
    note = "" if m == n else f"timed on {m} of {n} chunks and scaled x{scale:.1f} (too slow in full)"
    times = result.paths["naive"] = PathTimes("naive per-block copies, ops only", note=note)
    src, dst = kv.src[: m * cb], kv.dst[: m * cb]
    with host_buffer(m * chunk_bytes, spec.device) as host:
        save_spans, load_spans = spans(host, m, kv.src), spans(host, m, kv.dst)
        for r in range(spec.repeats):
            if r == 0:  # verified once: this path is the tests' oracle, its timing is what matters here
                clobber_blocks(kv.layout, dst)
            save_ms = timed_ms(spec.device, lambda: gather(kv.layout, save_spans)) * scale
            load_ms = timed_ms(spec.device, lambda: scatter(kv.layout, load_spans)) * scale
            if r == 0:
                verify_blocks(kv.layout, src, dst, "naive per-block reload")
            times.save_ms.append(save_ms)
            times.reload_ms.append(load_ms)
            progress(f"naive per-block {r + 1}/{spec.repeats}: gather {save_ms:.0f} ms, scatter {load_ms:.0f} ms"
                     + ("" if m == n else f" (scaled from {m}/{n} chunks)"))
    result.verified.append("naive")


class _Raw:
    """One contiguous copy of the prompt's bytes: the ceiling. On CPU the engine allocation's two
    halves are the two sides (no extra memory): save copies the first half onto the second,
    reload copies it back, so the first half keeps its bytes; the second then holds a copy of the
    first, which later repeats save and verify as they find it."""

    def __init__(self, spec: ReloadSpec, kv: EngineKV, result: ReloadResult):
        self.spec, self.kv = spec, kv
        cuda = spec.device.type == "cuda"
        label = "raw memcpy, pinned D2H / H2D" if cuda else "raw memcpy, host to host"
        self.times = result.paths["raw"] = PathTimes(label, note="one contiguous copy of the prompt's bytes: the ceiling")

    def repeat(self, r: int, progress: Progress) -> None:
        spec, times, nbytes = self.spec, self.times, self.spec.prompt_bytes
        engine = self.kv.memory[:nbytes]
        cuda = spec.device.type == "cuda"
        with host_buffer(nbytes if cuda else 0, spec.device) as pinned:
            host = pinned if cuda else self.kv.memory[nbytes : 2 * nbytes]
            times.save_ms.append(timed_ms(spec.device, lambda: host.copy_(engine)))
            times.reload_ms.append(timed_ms(spec.device, lambda: engine.copy_(host)))
        progress(f"raw memcpy {r + 1}/{spec.repeats}: {times.save_ms[-1]:.0f} ms / {times.reload_ms[-1]:.0f} ms")


# ---- the host -----------------------------------------------------------------------------------


def device_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's model and torch's thread count."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model('unknown CPU')}, {torch.get_num_threads()} threads"


def _others_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy, less this process's own: the interference
    a run met (a busy neighbour stalls torch's OpenMP copies far more than one memcpy)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(fields[:8]) - fields[3] - fields[4]  # all but idle and iowait
    own = resource.getrusage(resource.RUSAGE_SELF)
    return busy / os.sysconf("SC_CLK_TCK") - own.ru_utime - own.ru_stime


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
