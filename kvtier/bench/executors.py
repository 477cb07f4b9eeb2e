"""The executors benchmark: does a reload slow down while the engine saves as fast as it can?

One :class:`~kvtier.transfer.TierWorker` over a real CPU tier (and optionally a disk tier). A
prompt's KV is stored once; then, in one run, the bench reloads it ``--samples`` times with the
save executor idle, and ``--samples`` times while an "engine" thread saves ``--burst-chunks`` new
chunks every step (``--step-ms`` apart, standing for the forward pass) without pause, more than
the save executor can store, so its backlog stays full and the oldest pending saves are dropped.
Reloads come ``--gap-ms`` apart in both phases (the save executor yields to a running load, so
back-to-back reloads would starve it). A reload's latency is from ``submit_load`` to its
completion on the load executor; the reloaded blocks are verified byte for byte after each
phase. The target: burst p99 <= 1.25 x idle p99.
"""

from __future__ import annotations

import argparse
import os
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field

import numpy as np

from kvtier.bench.common import BenchError, Progress, parse_tokens, positive

TARGET_P99_RATIO = 1.25


@dataclass(frozen=True, slots=True)
class ExecutorsSpec:
    """``reload_tokens``: the reloaded prompt; ``burst_chunks`` new chunks saved per engine step."""

    layers: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    block_size: int = 16
    chunk_tokens: int = 256
    reload_tokens: int = 2048
    burst_chunks: int = 2
    step_ms: float = 10.0
    samples: int = 40
    gap_ms: float = 50.0
    backlog_chunks: int = 8
    disk_path: str | None = None


@dataclass(slots=True)
class ExecutorsResult:
    spec: ExecutorsSpec
    device: str
    reload_bytes: int
    idle_ms: list[float] = field(default_factory=list)
    burst_ms: list[float] = field(default_factory=list)
    burst_saved_chunks: int = 0
    burst_dropped_chunks: int = 0
    burst_offered_chunks: int = 0
    burst_seconds: float = 0.0

    def stats(self, samples: list[float]) -> dict[str, float]:
        return {"p50": float(np.percentile(samples, 50)), "p99": float(np.percentile(samples, 99)),
                "mean": float(np.mean(samples))}

    @property
    def p99_ratio(self) -> float:
        return self.stats(self.burst_ms)["p99"] / self.stats(self.idle_ms)["p99"]

    @property
    def p50_ratio(self) -> float:
        return self.stats(self.burst_ms)["p50"] / self.stats(self.idle_ms)["p50"]


def add_parser(commands) -> None:
    """Register ``kvtier-bench executors``."""
    p = commands.add_parser("executors", help="reload latency idle vs under a continuous save burst",
                            description="Reload a stored prompt with the save executor idle, then while an engine "
                            "thread saves new chunks without pause; report p50/p99 of both and their ratio.")
    d = ExecutorsSpec()
    p.add_argument("--reload-len", type=parse_tokens, default=d.reload_tokens, metavar="TOKENS",
                   help=f"tokens of the reloaded prompt (default {d.reload_tokens})")
    p.add_argument("--burst-chunks", type=positive, default=d.burst_chunks, help=f"chunks saved per engine step (default {d.burst_chunks})")
    p.add_argument("--step-ms", type=float, default=d.step_ms, help=f"engine step between saves, ms (default {d.step_ms})")
    p.add_argument("--samples", type=positive, default=d.samples, help=f"reloads per phase (default {d.samples})")
    p.add_argument("--gap-ms", type=float, default=d.gap_ms, help=f"pause between reloads, ms (default {d.gap_ms})")
    p.add_argument("--backlog-chunks", type=positive, default=d.backlog_chunks, help=f"save backlog bound in chunks (default {d.backlog_chunks})")
    p.add_argument("--layers", type=positive, default=d.layers)
    p.add_argument("--kv-heads", type=positive, default=d.kv_heads)
    p.add_argument("--head-dim", type=positive, default=d.head_dim)
    p.add_argument("--block-size", type=positive, default=d.block_size)
    p.add_argument("--chunk-tokens", type=positive, default=d.chunk_tokens)
    p.add_argument("--disk", metavar="PATH", help="add a disk tier in PATH (saves are written through to it)")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.set_defaults(run=_main, parser=p)


def run(spec: ExecutorsSpec, progress=lambda message: None) -> ExecutorsResult:
    import torch

    from kvtier import codec
    from kvtier.bench.engine_kv import Geometry, make_engine_kv, verify_blocks
    from kvtier.jobs import LoadJob, SaveJob
    from kvtier.keys import chunk_keys, namespace
    from kvtier.storage import ChunkStore, StoreConfig
    from kvtier.transfer import TierWorker

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    geometry = Geometry(spec.layers, spec.kv_heads, spec.head_dim, getattr(torch, spec.dtype), spec.block_size)
    chunk_blocks = spec.chunk_tokens // spec.block_size
    reload_blocks = spec.reload_tokens // spec.block_size
    burst_blocks = spec.burst_chunks * chunk_blocks
    if spec.reload_tokens % spec.chunk_tokens or spec.chunk_tokens % spec.block_size:
        raise BenchError("--reload-len must be whole chunks, --chunk-tokens whole blocks.")
    # src half: the prompt's blocks, then the burst's; dst half: where the prompt is reloaded.
    kv = make_engine_kv(geometry, reload_blocks + burst_blocks, device)
    src, burst_src, dst = kv.src[:reload_blocks], kv.src[reload_blocks:], kv.dst[:reload_blocks]
    chunk_bytes = codec.chunk_bytes(kv.layout, chunk_blocks)
    reload_chunks = reload_blocks // chunk_blocks
    # Room for the prompt, the backlog, and 64 stored burst chunks before LRU eviction could reach
    # the prompt (it is refreshed by every reload; far fewer are stored between two reloads).
    cpu_bytes = (reload_chunks + spec.backlog_chunks + 64) * -(-chunk_bytes // 4096) * 4096
    config = StoreConfig(cpu_bytes=cpu_bytes, disk_path=spec.disk_path,
                         disk_bytes=4 * cpu_bytes if spec.disk_path else 0, namespace="kvtier-bench")
    result = ExecutorsResult(spec, str(device), reload_blocks * kv.layout.bytes_per_block)
    root = namespace("kvtier-bench", uuid.uuid4().hex)
    gen = np.random.default_rng(0)

    def fresh_keys(n: int) -> list[bytes]:
        return chunk_keys(gen.integers(0, 128_000, n * spec.chunk_tokens).tolist(), spec.chunk_tokens, root)

    prompt = fresh_keys(reload_chunks)
    with ChunkStore(config) as store:
        worker = TierWorker(kv.layout, store, chunk_blocks, save_backlog_bytes=spec.backlog_chunks * chunk_bytes)
        try:
            ids = src.tolist()
            for at in range(0, reload_chunks, spec.backlog_chunks):  # a backlog at a time: nothing dropped
                end = min(reload_chunks, at + spec.backlog_chunks)
                worker.save([SaveJob("prompt", tuple(prompt[at:end]), tuple(ids[at * chunk_blocks : end * chunk_blocks]))])
                worker.drain()
            if worker.stats.saved_chunks != reload_chunks:
                raise BenchError(f"stored {worker.stats.saved_chunks} of the prompt's {reload_chunks} chunks.")
            job = LoadJob("reload", tuple(prompt), 0, tuple(dst.tolist()))

            def reload_ms() -> float:
                time.sleep(spec.gap_ms / 1e3)
                begin = time.perf_counter()
                worker.submit_load(job).result()
                ms = (time.perf_counter() - begin) * 1e3
                _, failed = worker.take_finished()
                if failed:
                    raise BenchError(f"a reload left {len(failed)} blocks unloaded (evicted under the burst?).")
                return ms

            for _ in range(3):
                reload_ms()  # warm-up
            verify_blocks(kv.layout, src, dst, "reload")
            progress(f"idle: {spec.samples} reloads of {result.reload_bytes / 2**20:.0f} MiB")
            result.idle_ms = [reload_ms() for _ in range(spec.samples)]

            stop = threading.Event()
            offered = [0]

            def engine() -> None:  # saves new chunks every step, like a prefill-heavy engine
                ids = tuple(burst_src.tolist())
                while not stop.is_set():
                    # Chain keys come with the scheduler's metadata (computed in its process): any
                    # fresh 16 bytes will do here.
                    keys = [os.urandom(16) for _ in range(spec.burst_chunks)]
                    worker.save([SaveJob("burst", tuple(keys), ids)])
                    offered[0] += len(keys)
                    stop.wait(spec.step_ms / 1e3)

            before = (worker.stats.saved_chunks, worker.stats.dropped_saves)
            saver = threading.Thread(target=engine, name="bench-engine", daemon=True)
            begin = time.perf_counter()
            saver.start()
            try:
                time.sleep(0.2)  # let the backlog fill
                progress(f"burst: {spec.samples} reloads while saving {spec.burst_chunks} chunks every {spec.step_ms} ms")
                result.burst_ms = [reload_ms() for _ in range(spec.samples)]
            finally:
                stop.set()
                saver.join()
            result.burst_seconds = time.perf_counter() - begin
            result.burst_saved_chunks = worker.stats.saved_chunks - before[0]
            result.burst_dropped_chunks = worker.stats.dropped_saves - before[1]
            result.burst_offered_chunks = offered[0]
            verify_blocks(kv.layout, src, dst, "reload under the save burst")
            if result.burst_saved_chunks == 0:
                raise BenchError("the save burst stored nothing: the bench measured no contention.")
        finally:
            worker.close()
    return result


def format_result(r: ExecutorsResult) -> str:
    s = r.spec
    idle, burst = r.stats(r.idle_ms), r.stats(r.burst_ms)
    chunk = r.reload_bytes / (s.reload_tokens // s.chunk_tokens)
    save_gbps = r.burst_saved_chunks * chunk / r.burst_seconds / 1e9
    verdict = "meets" if r.p99_ratio <= TARGET_P99_RATIO else "MISSES"
    return "\n".join([
        f"kvtier executors on {r.device}: reload of {s.reload_tokens} tokens ({r.reload_bytes / 2**20:.0f} MiB, "
        f"{s.layers}x{s.kv_heads}x{s.head_dim} {s.dtype}, chunks of {s.chunk_tokens}), {s.samples} samples per phase, "
        f"{s.gap_ms:g} ms apart; burst: {s.burst_chunks} chunks every {s.step_ms:g} ms",
        f"  {'':30s} {'p50 ms':>9s} {'p99 ms':>9s} {'mean ms':>9s}",
        f"  {'idle':30s} {idle['p50']:9.1f} {idle['p99']:9.1f} {idle['mean']:9.1f}",
        f"  {'under save burst':30s} {burst['p50']:9.1f} {burst['p99']:9.1f} {burst['mean']:9.1f}",
        f"  ratio burst/idle: p50 {r.p50_ratio:.2f}, p99 {r.p99_ratio:.2f} ({verdict} the {TARGET_P99_RATIO} target)",
        f"  burst: {r.burst_offered_chunks} chunks offered, {r.burst_saved_chunks} stored ({save_gbps:.2f} GB/s), "
        f"{r.burst_dropped_chunks} dropped from the full backlog of {s.backlog_chunks} chunks",
    ])


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    import json
    import sys

    spec = ExecutorsSpec(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, block_size=args.block_size,
                         chunk_tokens=args.chunk_tokens, reload_tokens=args.reload_len, burst_chunks=args.burst_chunks,
                         step_ms=args.step_ms, samples=args.samples, gap_ms=args.gap_ms, backlog_chunks=args.backlog_chunks,
                         disk_path=args.disk)
    try:
        result = run(spec, Progress())
    except BenchError as exc:
        print(f"kvtier-bench: error: {exc}", file=sys.stderr)
        return 1
    print(format_result(result), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**asdict(result), "p50_ratio": result.p50_ratio, "p99_ratio": result.p99_ratio}, f, indent=2)
    return 0
