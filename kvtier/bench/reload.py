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
"""

from __future__ import annotations

import os
import resource
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvtier import codec
from kvtier import keys as chain
from kvtier.bench import BenchError
from kvtier.bench.engine_kv import EngineKV, Geometry, clobber_blocks, host_buffer, make_engine_kv, verify_blocks
from kvtier.jobs import LoadJob, SaveJob
from kvtier.codec import DEFAULT_HOST_CHECKSUM
from kvtier.codec.checksums import NAMES
from kvtier.ops import ChunkSpan, checksums_in_kernel, pick_backend, resolve_backend
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.transfer import TierWorker

NAMESPACE = "kvtier-bench"  # store namespace: the bench never sees a real deployment's chunks
NAIVE_BUDGET_S = 20.0  # the naive path's total time; beyond it a subset of chunks is timed and scaled
POOL_GRANULE = 4096  # the CPU pool rounds every chunk up to this (see StoreConfig)

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class ReloadSpec:
    """What to measure. ``prompt_tokens`` is a multiple of ``chunk_tokens``, itself a multiple of
    the block size (the CLI checks both). ``disk_path``: add a disk tier there and measure a cold
    disk reload. ``repeats``: samples per path (the report picks the best or the median)."""

    geometry: Geometry
    prompt_tokens: int
    chunk_tokens: int
    device: torch.device
    backend: str = "auto"
    disk_path: str | None = None
    repeats: int = 3
    seed: int = 0
    shared_url: str | None = None
    checksum_rows: bool = True  # on a CPU with backend auto: a whole-path row per checksum candidate
    beside_gemm: bool = False  # CUDA: also save and reload in a loop beside a GEMM loop (kvtier.bench.beside_gemm)

    @property
    def chunk_blocks(self) -> int:
        return self.chunk_tokens // self.geometry.block_size

    @property
    def prompt_blocks(self) -> int:
        return self.prompt_tokens // self.geometry.block_size

    @property
    def num_chunks(self) -> int:
        return self.prompt_tokens // self.chunk_tokens

    @property
    def prompt_bytes(self) -> int:
        return self.prompt_tokens * self.geometry.bytes_per_token

    def cpu_tier_bytes(self) -> int:
        """CPU tier size: every chunk of the prompt (header included, pool-rounded) plus slack."""
        payload = self.chunk_tokens * self.geometry.bytes_per_token
        per_chunk = -(-(codec.HEADER_BYTES + payload) // POOL_GRANULE) * POOL_GRANULE
        total = per_chunk * self.num_chunks
        return total + max(64 << 20, total // 32)

    def memory_needed(self) -> tuple[int, int]:
        """(device bytes, host bytes) at the peak: engine KV (two block sets) and the CPU tier."""
        engine = 2 * self.prompt_bytes
        if self.device.type == "cuda":
            return engine, self.cpu_tier_bytes()
        return 0, engine + self.cpu_tier_bytes()


@dataclass(slots=True)
class PathTimes:
    """One path's samples in milliseconds; an empty list means the path has no such direction."""

    label: str
    save_ms: list[float] = field(default_factory=list)
    reload_ms: list[float] = field(default_factory=list)
    note: str = ""


@dataclass(slots=True)
class ReloadResult:
    """Everything the report prints. ``paths`` keeps table order; sub-paths are named ``parent.part``."""

    spec: ReloadSpec
    device_name: str
    backend: str
    layout_kind: str
    regions: int
    cpu_tier_bytes: int
    load_avg: tuple[float, float]  # 1-minute load average at start and at end
    others_cpu_s: float | None = None  # CPU seconds other processes used during the run (Linux)
    paths: dict[str, PathTimes] = field(default_factory=dict)
    verified: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0
    elapsed_s: float = 0.0
    beside_gemm: list | None = None  # [kvtier.bench.beside_gemm.BesideGemm], when measured


def run(spec: ReloadSpec, progress: Progress) -> ReloadResult:
    """Measure every path of ``spec``; raises :class:`~kvtier.bench.VerifyError` if a reload
    returns other bytes and :class:`~kvtier.bench.BenchError` if a chunk is not stored or loaded."""
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
            from kvtier.bench import beside_gemm

            result.beside_gemm = beside_gemm.measure(kv, keys, store, spec.chunk_blocks, spec.backend,
                                                     spec.prompt_bytes, progress)
            result.verified.append("beside_gemm")
    if spec.disk_path:
        config = StoreConfig(cpu_bytes=result.cpu_tier_bytes, disk_path=spec.disk_path,
                             disk_bytes=result.cpu_tier_bytes, namespace=NAMESPACE)
        _measure_disk_cold(spec, kv, keys, config, result, progress)
    if spec.shared_url:
        from kvtier.bench.shared import measure_shared

        measure_shared(spec, kv, keys, result, progress, prompt_jobs, _save, _load, PathTimes)
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
        self.ops, self.storage = _Clock(spec.device), _Clock(torch.device("cpu"))
        worker = TierWorker(kv.layout, _TimedStore(store, self.storage), spec.chunk_blocks, variant.backend,
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
            save_ms = _timed_ms(spec.device, lambda: worker._gather(kv.layout, out, checksums_out=sums))
            reload_ms = _timed_ms(spec.device, lambda: worker._scatter(kv.layout, back, sums))
        return save_ms, reload_ms

    def repeat(self, r: int, progress: Progress) -> None:
        ops, storage, (part_ops, part_store, part_rest) = self.ops, self.storage, self.parts
        for skey in self.skeys:  # so that this save stores every chunk again (not timed)
            self.store.remove(skey)
        ops.ms = storage.ms = 0.0
        save_ms = _save(self.worker, self.save_job, self.spec.num_chunks)
        save_parts = (ops.ms, storage.ms)
        clobber_blocks(self.kv.layout, self.kv.dst)
        ops.ms = storage.ms = 0.0
        load_ms = _load(self.worker, self.load_job, "the CPU tier")
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


def _measure_disk_cold(spec: ReloadSpec, kv: EngineKV, keys: list[bytes], config: StoreConfig,
                       result: ReloadResult, progress: Progress) -> None:
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
                _save(worker, save_job, spec.num_chunks)
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
                storage = _Clock(torch.device("cpu"))
                worker = TierWorker(kv.layout, _TimedStore(store, storage), spec.chunk_blocks, spec.backend)
                try:
                    clobber_blocks(kv.layout, kv.dst)
                    load_ms = _load(worker, load_job, "disk")
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


def _measure_naive(spec: ReloadSpec, kv: EngineKV, result: ReloadResult, progress: Progress) -> None:
    gather, scatter = pick_backend(kv.layout, "reference")
    cb, n = spec.chunk_blocks, spec.num_chunks
    chunk_bytes = codec.chunk_bytes(kv.layout, cb)

    def spans(host: torch.Tensor, count: int, ids: torch.Tensor) -> list[ChunkSpan]:
        return chunk_spans(host, count, ids, cb, chunk_bytes)

    with host_buffer(chunk_bytes, spec.device) as probe:  # the faster of two: the first warms up
        probe_ms = min(_timed_ms(spec.device, lambda: gather(kv.layout, spans(probe, 1, kv.src))) for _ in range(2))
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
            save_ms = _timed_ms(spec.device, lambda: gather(kv.layout, save_spans)) * scale
            load_ms = _timed_ms(spec.device, lambda: scatter(kv.layout, load_spans)) * scale
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
            times.save_ms.append(_timed_ms(spec.device, lambda: host.copy_(engine)))
            times.reload_ms.append(_timed_ms(spec.device, lambda: engine.copy_(host)))
        progress(f"raw memcpy {r + 1}/{spec.repeats}: {times.save_ms[-1]:.0f} ms / {times.reload_ms[-1]:.0f} ms")


# ---- helpers ------------------------------------------------------------------------------------


def chunk_spans(host: torch.Tensor, count: int, ids: torch.Tensor, chunk_blocks: int, chunk_bytes: int) -> list[ChunkSpan]:
    """``count`` whole chunks back to back in ``host``, chunk ``i`` over blocks ``ids[i*cb:(i+1)*cb]``."""
    return [ChunkSpan(host[i * chunk_bytes : (i + 1) * chunk_bytes], chunk_blocks, 0,
                      ids[i * chunk_blocks : (i + 1) * chunk_blocks]) for i in range(count)]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{model}, {torch.get_num_threads()} threads"


def prompt_jobs(kv: EngineKV, keys: list[bytes]) -> tuple[SaveJob, LoadJob]:
    """Save the prompt from ``kv.src``; load it into ``kv.dst``."""
    return (SaveJob("bench", tuple(keys), tuple(kv.src.tolist())),
            LoadJob("bench", tuple(keys), 0, tuple(kv.dst.tolist())))


def _save(worker: TierWorker, job: SaveJob, num_chunks: int) -> float:
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


def _load(worker: TierWorker, job: LoadJob, tier: str) -> float:
    """Run ``job`` until its blocks are written (device synchronized); its wall time in ms."""
    begin = time.perf_counter()
    failed = worker.load(job)
    _sync(worker.layout.device)
    elapsed = (time.perf_counter() - begin) * 1e3
    if failed:
        raise BenchError(f"reload from {tier} left {len(failed)} of {len(job.block_ids)} blocks unloaded; see the log above.")
    return elapsed


def _forget(store: ChunkStore, skeys: list[bytes]) -> None:
    for skey in skeys:
        store.remove(skey)


def _drop_page_cache(path: str) -> None:
    """Write back and evict the bench's chunk files from the OS page cache: the next read is cold."""
    for entry in os.scandir(path):
        if entry.is_file(follow_symlinks=False) and entry.name.startswith(f"{NAMESPACE}@"):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed_ms(device: torch.device, fn: Callable[[], object]) -> float:
    _sync(device)
    begin = time.perf_counter()
    fn()
    _sync(device)
    return (time.perf_counter() - begin) * 1e3


class _Clock:
    """Adds the wall time of the calls it wraps to ``ms`` (CUDA synchronized at both ends)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.ms = 0.0

    def wrap(self, fn: Callable) -> Callable:
        def timed(*args, **kwargs):
            _sync(self.device)
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(self.device)
                self.ms += (time.perf_counter() - begin) * 1e3

        return timed


class _TimedStore:
    """A ChunkStore whose data calls add their wall time to ``clock``; behaviour unchanged."""

    def __init__(self, store: ChunkStore, clock: _Clock):
        self._store = store
        for name in ("allocate", "put", "contains", "prefix_hits", "get", "remove", "will_need"):
            setattr(self, name, clock.wrap(getattr(store, name)))

    def __getattr__(self, name: str):  # anything else, untimed
        return getattr(self._store, name)


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
