"""The reload benchmark: a prompt's KV saved from engine blocks, then reloaded into other blocks.

Every path moves the same bytes, the prompt's KV (:attr:`ReloadSpec.prompt_bytes`). The phases
run in this order because each frees memory the next one needs and the last overwrites the KV:

1. ``kvtier``: ``TierWorker.save`` + ``drain`` into the CPU tier, then ``TierWorker.load`` into
   the other blocks, compared byte for byte. The ops and store calls inside are timed in place;
   what is left (``kvtier.rest``) is the checksum (seal on save, verify on load) and overhead.
2. ``disk_cold`` (with a disk tier): a new ChunkStore on the same directory, its files written
   back and dropped from the page cache, so the reload reads the disk.
3. ``naive``: the same gather/scatter through the ``reference`` ops backend (one copy per block
   and region), ops only; timed on a subset of chunks and scaled when the whole would be too slow.
4. ``raw``: one contiguous copy of the same bytes (host to host on CPU, pinned D2H/H2D on CUDA).
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable

import torch

from kvtier import codec
from kvtier import keys as chain
from kvtier.jobs import LoadJob, SaveJob
from kvtier.layout import Layout, build_layout
from kvtier.ops import ChunkSpan, pick_backend
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.transfer import TierWorker

NAMESPACE = "kvtier-bench"  # store namespace: the bench never sees a real deployment's chunks
NAIVE_BUDGET_S = 20.0  # the naive path's total time; beyond it a subset of chunks is timed and scaled
POOL_GRANULE = 4096  # the CPU pool rounds every chunk up to this (see StoreConfig)

Progress = Callable[[str], None]


class BenchError(RuntimeError):
    """The bench could not measure what it set out to: a chunk not stored, a load that failed."""


class VerifyError(BenchError):
    """Reloaded blocks differ from the saved ones."""


@dataclass(frozen=True, slots=True)
class Geometry:
    """The model's KV shape. ``block_size`` in tokens."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token over all layers, K and V."""
        return self.layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class ReloadSpec:
    """What to measure. ``prompt_tokens`` is a multiple of ``chunk_tokens``, itself a multiple of
    the block size (the CLI checks both). ``disk_path``: add a disk tier there and measure a cold
    disk reload. ``repeats``: samples per path; the report takes their median."""

    geometry: Geometry
    prompt_tokens: int
    chunk_tokens: int
    device: torch.device
    backend: str = "auto"
    disk_path: str | None = None
    repeats: int = 3
    seed: int = 0

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
        payload = self.chunk_blocks * self.geometry.block_size * self.geometry.bytes_per_token
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

    def median(self, direction: str) -> float | None:
        samples = self.save_ms if direction == "save" else self.reload_ms
        return statistics.median(samples) if samples else None


@dataclass(slots=True)
class ReloadResult:
    """Everything the report prints. ``paths`` keeps table order; sub-paths are named ``parent.part``."""

    spec: ReloadSpec
    device_name: str
    backend: str
    layout_kind: str
    regions: int
    cpu_tier_bytes: int
    load_avg: float
    paths: dict[str, PathTimes] = field(default_factory=dict)
    verified: list[str] = field(default_factory=list)
    peak_rss_bytes: int = 0
    elapsed_s: float = 0.0


@dataclass(slots=True)
class EngineKV:
    """The engine's KV memory: one allocation, its layout, and the prompt's two block sets.

    ``memory``: ``uint8 [2 * prompt_bytes]`` on the device; every region aliases it.
    ``src`` / ``dst``: ``int64 [prompt_blocks]`` on the device, disjoint shuffled block ids the
    prompt is saved from and reloaded into.
    """

    memory: torch.Tensor
    layout: Layout
    src: torch.Tensor
    dst: torch.Tensor
    kind: str


def make_engine_kv(spec: ReloadSpec) -> EngineKV:
    """Twice the prompt's blocks of random bytes, shaped the way the engine on ``spec.device`` does."""
    g, device = spec.geometry, spec.device
    num_blocks = 2 * spec.prompt_blocks
    memory = torch.empty(num_blocks * g.block_size * g.bytes_per_token, dtype=torch.uint8, device=device)
    generator = torch.Generator(device=device).manual_seed(spec.seed)
    (memory.view(torch.int64) if memory.numel() % 8 == 0 else memory).random_(generator=generator)
    typed = memory.view(g.dtype)
    if device.type == "cuda":
        per_layer = typed.view(g.layers, 2, num_blocks, g.block_size, g.kv_heads, g.head_dim)
        kind = "flash: per layer [2, blocks, block_size, kv_heads, head_dim], K and V regions"
    else:
        per_layer = typed.view(g.layers, num_blocks, g.kv_heads, g.block_size, 2 * g.head_dim)
        kind = "vllm-cpu: per layer [blocks, kv_heads, block_size, 2*head_dim], one region"
    kv_caches = {f"model.layers.{i}.self_attn.attn": per_layer[i] for i in range(g.layers)}
    layout = build_layout(kv_caches, g.block_size, num_blocks, model=NAMESPACE)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(spec.seed))
    n = spec.prompt_blocks
    return EngineKV(memory, layout, perm[:n].to(device), perm[n:].to(device), kind)


def run(spec: ReloadSpec, progress: Progress) -> ReloadResult:
    """Measure every path of ``spec``; raises :class:`VerifyError` if a reload returns other bytes."""
    start = time.perf_counter()
    load_avg = os.getloadavg()[0]
    progress(f"filling {_gib(2 * spec.prompt_bytes)} of engine KV ({2 * spec.prompt_blocks} blocks) with random bytes")
    kv = make_engine_kv(spec)
    gather = pick_backend(kv.layout, spec.backend)[0]
    result = ReloadResult(
        spec, device_name(spec.device), gather.__module__.rsplit(".", 1)[-1].removesuffix("_ops"),
        kv.kind, len(kv.layout.regions), spec.cpu_tier_bytes(), load_avg,
    )
    tokens = torch.randint(0, 128_000, (spec.prompt_tokens,), generator=torch.Generator().manual_seed(spec.seed))
    # A fresh salt per run: chunks a crashed run left on disk can never satisfy this run's lookups.
    root = chain.namespace(NAMESPACE, cache_salt=uuid.uuid4().hex)
    keys = chain.chunk_keys(tokens.tolist(), spec.chunk_tokens, root)
    config = StoreConfig(
        cpu_bytes=result.cpu_tier_bytes, disk_path=spec.disk_path,
        disk_bytes=result.cpu_tier_bytes if spec.disk_path else 0, namespace=NAMESPACE,
    )
    progress(f"opening the CPU tier ({_gib(config.cpu_bytes)})")
    with ChunkStore(config) as store:
        _measure_kvtier(spec, kv, keys, store, result, progress)
    if spec.disk_path:  # the close above waited for the write-through to land
        _measure_disk_cold(spec, kv, keys, config, result, progress)
    _measure_naive(spec, kv, result, progress)
    _measure_raw(spec, kv, result, progress)  # last: overwrites the engine KV
    del kv
    result.peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result.elapsed_s = time.perf_counter() - start
    return result


# ---- phases -------------------------------------------------------------------------------------


def _measure_kvtier(spec: ReloadSpec, kv: EngineKV, keys: list[bytes], store: ChunkStore,
                    result: ReloadResult, progress: Progress) -> None:
    ops, storage = _Clock(spec.device), _Clock(torch.device("cpu"))
    worker = TierWorker(kv.layout, _TimedStore(store, storage), spec.chunk_blocks, spec.backend)
    # Timed in place, inside the real path: TierWorker has no per-stage counters of its own.
    worker._gather, worker._scatter = ops.wrap(worker._gather), ops.wrap(worker._scatter)
    skeys = [chain.storage_key(k, kv.layout.fingerprint) for k in keys]
    save_job = SaveJob("bench", tuple(keys), tuple(kv.src.tolist()))
    load_job = LoadJob("bench", tuple(keys), 0, tuple(kv.dst.tolist()))
    total = result.paths["kvtier"] = PathTimes("kvtier, CPU tier (whole path)")
    part_ops = result.paths["kvtier.ops"] = PathTimes("  ops only: gather / scatter")
    part_store = result.paths["kvtier.storage"] = PathTimes("  store: allocate+put / get")
    part_rest = result.paths["kvtier.rest"] = PathTimes("  checksum + overhead (rest)")
    failing = False
    try:
        for r in range(spec.repeats):
            for skey in skeys:  # so that this save stores every chunk again (not timed)
                store.remove(skey)
            saved_before = worker.stats.saved_chunks
            ops.ms = storage.ms = 0.0
            begin = time.perf_counter()
            worker.save([save_job])
            worker.drain()
            save_ms = (time.perf_counter() - begin) * 1e3
            stored = worker.stats.saved_chunks - saved_before
            if stored != spec.num_chunks:
                raise BenchError(
                    f"save stored {stored} of {spec.num_chunks} chunks (CPU tier of {result.cpu_tier_bytes} B, "
                    f"{worker.stats.dropped_saves} dropped); see the log above."
                )
            for path, ms in ((total, save_ms), (part_ops, ops.ms), (part_store, storage.ms),
                             (part_rest, save_ms - ops.ms - storage.ms)):
                path.save_ms.append(ms)

            _clobber(kv.layout, kv.dst)
            ops.ms = storage.ms = 0.0
            begin = time.perf_counter()
            failed = worker.load(load_job)
            load_ms = (time.perf_counter() - begin) * 1e3
            if failed:
                raise BenchError(f"reload from the CPU tier left {len(failed)} of {spec.prompt_blocks} blocks unloaded; see the log above.")
            for path, ms in ((total, load_ms), (part_ops, ops.ms), (part_store, storage.ms),
                             (part_rest, load_ms - ops.ms - storage.ms)):
                path.reload_ms.append(ms)
            _verify(kv.layout, kv.src, kv.dst, "kvtier reload from the CPU tier")
            progress(f"kvtier CPU tier {r + 1}/{spec.repeats}: save {save_ms:.0f} ms, reload {load_ms:.0f} ms, verified")
        result.verified.append("kvtier")
    except BaseException:
        failing = True
        raise
    finally:
        worker.close()
        if failing and spec.disk_path:
            _forget(store, skeys)


def _measure_disk_cold(spec: ReloadSpec, kv: EngineKV, keys: list[bytes], config: StoreConfig,
                       result: ReloadResult, progress: Progress) -> None:
    total = result.paths["disk_cold"] = PathTimes(
        "kvtier, cold disk reload", note="new store on the disk directory; files fsynced and dropped from the "
        "page cache (posix_fadvise DONTNEED) before every repeat; the save column is absent (saves go through the CPU tier)")
    reads = result.paths["disk_cold.storage"] = PathTimes("  store: get (disk read)")
    skeys = [chain.storage_key(k, kv.layout.fingerprint) for k in keys]
    load_job = LoadJob("bench", tuple(keys), 0, tuple(kv.dst.tolist()))
    for r in range(spec.repeats):
        _drop_page_cache(config.disk_path)
        progress(f"cold disk {r + 1}/{spec.repeats}: opening a new store on {config.disk_path}")
        with ChunkStore(config) as store:
            last = r == spec.repeats - 1
            try:
                hits = store.prefix_hits(skeys)
                if hits != [Tier.DISK] * len(skeys):
                    raise BenchError(f"the new store finds {len(hits)} of {len(skeys)} chunks on disk in {config.disk_path}.")
                storage = _Clock(torch.device("cpu"))
                worker = TierWorker(kv.layout, _TimedStore(store, storage), spec.chunk_blocks, spec.backend)
                try:
                    _clobber(kv.layout, kv.dst)
                    begin = time.perf_counter()
                    failed = worker.load(load_job)
                    load_ms = (time.perf_counter() - begin) * 1e3
                finally:
                    worker.close()
                if failed:
                    raise BenchError(f"cold disk reload left {len(failed)} of {spec.prompt_blocks} blocks unloaded; see the log above.")
                _verify(kv.layout, kv.src, kv.dst, "kvtier cold reload from disk")
                total.reload_ms.append(load_ms)
                reads.reload_ms.append(storage.ms)
                progress(f"cold disk {r + 1}/{spec.repeats}: reload {load_ms:.0f} ms, verified")
            except BaseException:
                last = True
                raise
            finally:
                if last:  # delete the bench's chunk files
                    _forget(store, skeys)
    result.verified.append("disk_cold")


def _measure_naive(spec: ReloadSpec, kv: EngineKV, result: ReloadResult, progress: Progress) -> None:
    gather, scatter = pick_backend(kv.layout, "reference")
    cb, n = spec.chunk_blocks, spec.num_chunks
    pinned = spec.device.type == "cuda"

    def buffer() -> torch.Tensor:
        return torch.zeros(codec.chunk_bytes(kv.layout, cb), dtype=torch.uint8, pin_memory=pinned)

    def spans(count: int, ids: torch.Tensor) -> list[ChunkSpan]:
        return [ChunkSpan(buffers[i], cb, 0, ids[i * cb : (i + 1) * cb]) for i in range(count)]

    buffers = [buffer()]
    probe_ms = _timed_ms(spec.device, lambda: gather(kv.layout, spans(1, kv.src)))
    m = n
    if probe_ms * n * 2 * spec.repeats > NAIVE_BUDGET_S * 1e3:
        m = max(1, min(n, int(NAIVE_BUDGET_S * 1e3 / (probe_ms * 2 * spec.repeats))))
    buffers += [buffer() for _ in range(m - 1)]
    save_spans, load_spans = spans(m, kv.src), spans(m, kv.dst)
    src, dst = kv.src[: m * cb], kv.dst[: m * cb]
    scale = n / m
    note = "" if m == n else f"timed on {m} of {n} chunks and scaled x{scale:.1f} (too slow in full)"
    times = result.paths["naive"] = PathTimes("naive per-block copies, ops only", note=note)
    for r in range(spec.repeats):
        if r == 0:  # verified once: this path is the tests' oracle, the timing is what matters here
            _clobber(kv.layout, dst)
        save_ms = _timed_ms(spec.device, lambda: gather(kv.layout, save_spans)) * scale
        load_ms = _timed_ms(spec.device, lambda: scatter(kv.layout, load_spans)) * scale
        if r == 0:
            _verify(kv.layout, src, dst, "naive per-block reload")
        times.save_ms.append(save_ms)
        times.reload_ms.append(load_ms)
        progress(f"naive per-block {r + 1}/{spec.repeats}: gather {save_ms:.0f} ms, scatter {load_ms:.0f} ms"
                 + ("" if m == n else f" (scaled from {m}/{n} chunks)"))
    result.verified.append("naive")


def _measure_raw(spec: ReloadSpec, kv: EngineKV, result: ReloadResult, progress: Progress) -> None:
    nbytes = spec.prompt_bytes
    engine = kv.memory[:nbytes]
    if spec.device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        save, load = (lambda: host.copy_(engine)), (lambda: engine.copy_(host))
        label = "raw memcpy, pinned D2H / H2D"
    else:  # the engine allocation's other half is the destination: no extra memory
        other = kv.memory[nbytes : 2 * nbytes]
        save, load = (lambda: other.copy_(engine)), (lambda: engine.copy_(other))
        label = "raw memcpy, host to host"
    times = result.paths["raw"] = PathTimes(label, note="one contiguous copy of the prompt's bytes: the ceiling")
    for r in range(spec.repeats):
        times.save_ms.append(_timed_ms(spec.device, save))
        times.reload_ms.append(_timed_ms(spec.device, load))
        progress(f"raw memcpy {r + 1}/{spec.repeats}: {times.save_ms[-1]:.0f} ms / {times.reload_ms[-1]:.0f} ms")


# ---- helpers ------------------------------------------------------------------------------------


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


def _verify(layout: Layout, src: torch.Tensor, dst: torch.Tensor, what: str) -> None:
    """Raise :class:`VerifyError` unless blocks ``dst`` equal blocks ``src`` in every region.

    Compares ~8 MiB of blocks at a time through reused scratch buffers: fresh 100 MiB temporaries
    would cost more in page faults than the comparison itself.
    """
    scratch: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for region in layout.regions:
        rows = _words(region.blocks)
        step = max(1, (8 << 20) // region.block_bytes)
        for at in range(0, len(src), step):
            s, d = src[at : at + step], dst[at : at + step]
            shape = (len(s), rows.shape[1])
            if shape not in scratch:
                scratch[shape] = (rows.new_empty(shape), rows.new_empty(shape))
            saved, loaded = scratch[shape]
            torch.index_select(rows, 0, s, out=saved)
            torch.index_select(rows, 0, d, out=loaded)
            if not torch.equal(saved, loaded):
                bad = (saved != loaded).any(dim=1).nonzero().flatten().tolist()
                raise VerifyError(
                    f"{what}: region {region.name!r} block {int(d[bad[0]])} differs from saved block {int(s[bad[0]])} "
                    f"({len(bad)} of {len(s)} blocks differ in blocks {at}..{at + len(s) - 1} of this region)."
                )


def _clobber(layout: Layout, block_ids: torch.Tensor) -> None:
    """Zero ``block_ids`` in every region, so a reload that writes nothing cannot pass verification."""
    for region in layout.regions:
        _words(region.blocks).index_fill_(0, block_ids, 0)


def _words(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (``uint8 [n, block_bytes]``) as ``int64`` rows when aligned: torch's CPU
    index_fill_ and equal run byte by byte on uint8, ~5x slower than on 8-byte words."""
    try:
        return blocks.view(torch.int64)
    except RuntimeError:
        return blocks


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
    """A ChunkStore whose calls add their wall time to ``clock``; behaviour unchanged."""

    def __init__(self, store: ChunkStore, clock: _Clock):
        for name in ("allocate", "put", "contains", "prefix_hits", "get", "remove"):
            setattr(self, name, clock.wrap(getattr(store, name)))


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
