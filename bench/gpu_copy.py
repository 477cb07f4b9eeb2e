"""Save (gather) and load (scatter) bandwidth of every copy path, idle and beside a GEMM loop.

Geometry: Llama-3-8B-like KV (32 layers, K and V regions, 8 KV heads x head dim 128 x 16-token
blocks x bf16 = 32 KiB per block per region), 32k tokens = 2048 blocks = 4 GiB, engine blocks in
shuffled order, chunk buffers of 256 tokens (16 blocks, 32 MiB) in pinned host memory.

Run on a GPU machine: ``python bench/gpu_copy.py [--out DIR] [--quick]``. Prints a table, writes
``gpu_copy.json`` (and ``gpu_copy.png`` when matplotlib is there) to ``--out`` (default $OUT or
bench/results). Every section is saved as soon as it is measured, so a cut-off run keeps its data.

``python bench/gpu_copy.py --checksum-pass`` measures only the read-only KVSUM64 pass a P/D decode
engine runs over chunks that landed in its engine blocks (:class:`kvtier.transfer.landed.BlockSums`:
one plan, one launch over every SM): the kernel alone and with the plan built, at 16 and all
chunks; writes ``checksum_pass.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier import codec  # noqa: E402
from kvtier.layout import build_layout  # noqa: E402
from kvtier.ops import ChunkSpan, cuda_ops, dma_ops, reference, torch_ops, triton_ops  # noqa: E402

LAYERS, HEADS, HEAD_DIM, BLOCK_TOKENS, CHUNK_BLOCKS = 32, 8, 128, 16, 16
GiB = 1 << 30


def setup(tokens: int):
    dev = torch.device("cuda")
    blocks = tokens // BLOCK_TOKENS
    engine_blocks = 2 * blocks  # the copied blocks are a shuffled half of the engine's
    kv = {f"layer{i}": torch.empty(2, engine_blocks, BLOCK_TOKENS, HEADS, HEAD_DIM, dtype=torch.bfloat16, device=dev) for i in range(LAYERS)}
    for t in kv.values():
        t.view(torch.uint8).random_(0, 256)
    layout = build_layout(kv, BLOCK_TOKENS, engine_blocks, model="llama-3-8b-like")
    ids = torch.randperm(engine_blocks, device=dev)[:blocks]
    cb = codec.chunk_bytes(layout, CHUNK_BLOCKS)
    stride = -(-cb // 4096) * 4096
    chunks = blocks // CHUNK_BLOCKS
    host = torch.empty(chunks * stride, dtype=torch.uint8, pin_memory=True)
    spans = [ChunkSpan(host[c * stride : c * stride + cb], CHUNK_BLOCKS, 0, ids[c * CHUNK_BLOCKS : (c + 1) * CHUNK_BLOCKS]) for c in range(chunks)]
    return layout, spans, host, layout.payload_bytes(CHUNK_BLOCKS)


def timed(fn, reps: int = 3, warmup: int = 1) -> float:
    """Median wall seconds of ``fn()`` (which returns when its copy is done)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class Bench:
    def __init__(self, args):
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.layout, self.spans, self.host, self.chunk_payload = setup(args.tokens)
        self.nbytes = self.chunk_payload * len(self.spans)
        self.sums = torch.zeros(len(self.spans), dtype=torch.int64, device="cuda")
        self.result = {
            "device": torch.cuda.get_device_name(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "torch": torch.__version__,
            "triton": getattr(triton_ops.triton, "__version__", None),
            "geometry": dict(layers=LAYERS, regions=len(self.layout.regions), block_bytes=self.layout.regions[0].block_bytes,
                             blocks=len(self.spans) * CHUNK_BLOCKS, chunks=len(self.spans), bytes=self.nbytes),
            "idle": [], "interference": [], "gemm_alone_tflops": [], "checks": {},
        }

    def save(self):
        (self.out / "gpu_copy.json").write_text(json.dumps(self.result, indent=1))

    # ---- paths: name -> (save(spans), load(spans)) ---------------------------------------
    def paths(self):
        lay, sums = self.layout, self.sums
        expected = lambda spans: sums[: len(spans)]  # noqa: E731 - sums of the same data, from the last save
        p = {"torch": (partial(torch_ops.gather, lay), partial(torch_ops.scatter, lay)),
             "naive": (partial(reference.gather, lay), partial(reference.scatter, lay))}
        for mode in dma_ops.MODES:
            if not dma_ops.available(mode):
                continue
            configs = self.args.staged if mode == "staged" else [("auto", None, dma_ops.SLOTS, dma_ops.DEFAULT_STAGE_BYTES >> 20)]
            for kernel, ctas, slots, mib in configs:
                kw = dict(mode=mode, kernel=kernel, max_ctas=ctas, slots=slots, stage_bytes=mib << 20)
                name = f"dma-{mode}" + (f"-{kernel}-c{ctas}-{slots}x{mib // slots}M" if mode == "staged" else "")
                p[name] = (lambda s, kw=kw: dma_ops.gather(lay, s, sums[: len(s)], **kw),
                           lambda s, kw=kw: self.ok(dma_ops.scatter(lay, s, expected(s), **kw)))
            if mode == "batch":  # the copy engines alone, no checksum pass
                p["dma-batch-nosum"] = (lambda s: dma_ops.gather(lay, s, mode="batch"), lambda s: dma_ops.scatter(lay, s, mode="batch"))
        if triton_ops.available():
            for tile, warps in self.args.tiles:
                for ctas in self.args.ctas:
                    launch = partial(triton_ops.launch, tile_bytes=tile, num_warps=warps)
                    p[f"triton-c{ctas}-t{tile // 1024}k-w{warps}"] = (
                        lambda s, c=ctas, la=launch: triton_ops.run_copy(lay, s, la, gather=True, checksums_out=sums[: len(s)], max_ctas=c),
                        lambda s, c=ctas, la=launch: self.ok(triton_ops.run_copy(lay, s, la, gather=False, expected_checksums=expected(s), max_ctas=c)))
        if cuda_ops.available():
            for ctas in self.args.cuda_ctas:
                p[f"cuda-c{ctas}"] = (lambda s, c=ctas: cuda_ops.gather(lay, s, sums[: len(s)], max_ctas=c),
                                      lambda s, c=ctas: self.ok(cuda_ops.scatter(lay, s, expected(s), max_ctas=c)))
        return p

    @staticmethod
    def ok(flags):
        if not all(flags):
            raise AssertionError(f"checksum verification failed on {flags.count(False)} spans")

    # ---- idle -----------------------------------------------------------------------------
    def raw_memcpy(self):
        dev = torch.empty(self.nbytes, dtype=torch.uint8, device="cuda")
        hostv = self.host[: self.nbytes]
        save = timed(lambda: hostv.copy_(dev, non_blocking=True))
        load = timed(lambda: dev.copy_(hostv, non_blocking=True))
        self.raw = dev
        self.add_idle("raw pinned memcpy", self.nbytes, save, load, "one contiguous copy")

    def add_idle(self, name, nbytes, save, load, note=""):
        row = dict(path=name, bytes=nbytes, save_gbps=nbytes / save / 1e9, load_gbps=nbytes / load / 1e9, note=note)
        self.result["idle"].append(row)
        print(f"{name:32s} save {row['save_gbps']:7.2f} GB/s   load {row['load_gbps']:7.2f} GB/s  {note}", flush=True)
        self.save()

    def idle(self):
        self.raw_memcpy()
        for name, (save, load) in self.paths().items():
            spans = self.spans
            try:
                save(spans[:4])  # warm-up: compiles, allocations
                load(spans[:4])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                save(spans[:4])  # a time estimate on 4 chunks
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - report and go on with the other paths
                print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                self.result["idle"].append(dict(path=name, error=f"{type(exc).__name__}: {exc}"))
                continue
            est = (time.perf_counter() - t0) * len(spans) / 4
            if name == "naive" or est > 0.6:  # slow path: a subset of ~0.6 s, timed once
                spans = spans[: max(4, min(len(spans), int(len(spans) * 0.6 / max(est, 1e-9))))]
            nbytes = self.chunk_payload * len(spans)
            reps = 1 if len(spans) < len(self.spans) else 3
            try:
                s = timed(lambda: save(spans), reps=reps, warmup=0 if reps == 1 else 1)
                l = timed(lambda: load(spans), reps=reps, warmup=0 if reps == 1 else 1)
            except Exception as exc:  # noqa: BLE001 - report and go on with the other paths
                print(f"{name}: FAILED {type(exc).__name__}: {exc}", flush=True)
                self.result["idle"].append(dict(path=name, error=f"{type(exc).__name__}: {exc}"))
                continue
            self.add_idle(name, nbytes, s, l, f"{len(spans)} chunks" if len(spans) < len(self.spans) else "")

    def small(self):
        """Latency side: GB/s of batches of 1..16 chunks, for the default staged DMA and kernels."""
        paths = self.paths()
        rows = self.result.setdefault("small_batches", [])
        for name in self.args.small:
            if name not in paths:
                continue
            save, load = paths[name]
            for n in (1, 2, 4, 16):
                spans = self.spans[:n]
                nbytes = self.chunk_payload * n
                s, l = timed(lambda: save(spans), reps=5), timed(lambda: load(spans), reps=5)
                rows.append(dict(path=name, chunks=n, save_gbps=nbytes / s / 1e9, load_gbps=nbytes / l / 1e9, save_ms=s * 1e3, load_ms=l * 1e3))
                print(f"small {name:30s} {n:3d} chunks: save {rows[-1]['save_gbps']:6.2f} GB/s ({s * 1e3:6.2f} ms)  load {rows[-1]['load_gbps']:6.2f} GB/s ({l * 1e3:6.2f} ms)", flush=True)
        self.save()

    def checks(self):
        """At scale: Triton and CUDA C++ agree on bytes and sums; checksum cost; a corrupt chunk is caught."""
        lay, spans = self.layout, self.spans
        c = self.result["checks"]
        s1 = torch.zeros(len(spans), dtype=torch.int64, device="cuda")
        triton_ops.gather(lay, spans, s1)
        ref = torch.empty(self.spans[0].buffer.numel(), dtype=torch.uint8).pin_memory()
        reference.gather(lay, [ChunkSpan(ref, CHUNK_BLOCKS, 0, spans[0].block_ids)])
        c["triton_chunk0_equals_reference"] = bool(torch.equal(ref[codec.HEADER_BYTES :], spans[0].buffer[codec.HEADER_BYTES :]))
        if cuda_ops.available():
            s2 = torch.zeros_like(s1)
            cuda_ops.gather(lay, spans, s2)
            c["triton_cuda_sums_equal"] = bool(torch.equal(s1, s2))
        spans[3].buffer[codec.HEADER_BYTES + 12345] ^= 4
        ok = triton_ops.scatter(lay, spans, s1)
        c["corrupt_chunk_caught"] = ok == [i != 3 for i in range(len(spans))]
        spans[3].buffer[codec.HEADER_BYTES + 12345] ^= 4
        for name, mod in (("triton", triton_ops), ("cuda", cuda_ops)):
            if name == "cuda" and not cuda_ops.available():
                continue
            plain = (timed(lambda: mod.gather(lay, spans)), timed(lambda: mod.scatter(lay, spans)))
            summed = (timed(lambda: mod.gather(lay, spans, s1)), timed(lambda: self.ok(mod.scatter(lay, spans, s1))))
            c[f"{name}_checksum_cost_pct"] = dict(save=100 * (summed[0] / plain[0] - 1), load=100 * (summed[1] / plain[1] - 1))
        print("checks:", json.dumps(c), flush=True)
        self.save()

    # ---- interference ---------------------------------------------------------------------
    def gemm(self, iters: int) -> float:
        a = self.ga
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            torch.matmul(a, self.gb, out=self.gc)
        end.record()
        end.synchronize()
        return 2 * 8192**3 * iters / (start.elapsed_time(end) / 1e3) / 1e12

    def interference(self):
        self.ga, self.gb = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        self.gc = torch.empty_like(self.ga)
        self.gemm(20)
        alone = self.gemm(self.args.gemm_iters)
        self.result["gemm_alone_tflops"].append(alone)
        print(f"GEMM alone: {alone:.1f} TFLOP/s", flush=True)
        sub = self.spans[: self.args.load_chunks]
        paths = self.paths()
        raw_host, raw_dev = self.host[: self.chunk_payload * len(sub)], self.raw[: self.chunk_payload * len(sub)]

        def raw_save(_spans):
            raw_host.copy_(raw_dev, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        def raw_load(_spans):
            raw_dev.copy_(raw_host, non_blocking=True)
            torch.cuda.current_stream().synchronize()

        paths["raw pinned memcpy"] = (raw_save, raw_load)
        for name in self.args.interfere:
            if name not in paths:
                continue
            self.one_interference(name, *paths[name], sub, 0, alone)
        self.result["gemm_alone_tflops"].append(self.gemm(self.args.gemm_iters))
        print(f"GEMM alone again: {self.result['gemm_alone_tflops'][-1]:.1f} TFLOP/s", flush=True)
        self.save()

    def one_interference(self, name, save, load, spans, prio, alone):
        stop, log = threading.Event(), []
        nbytes = self.chunk_payload * len(spans)
        side = torch.cuda.Stream(priority=prio)

        errors = []

        def copier():
            try:
                with torch.cuda.stream(side):
                    while not stop.is_set():
                        for direction, fn in (("save", save), ("load", load)):
                            t0 = time.perf_counter()
                            fn(spans)
                            side.synchronize()
                            log.append((direction, t0, time.perf_counter()))
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(f"{type(exc).__name__}: {exc}")
                stop.set()

        th = threading.Thread(target=copier, daemon=True)
        th.start()
        while len(log) < 2 and th.is_alive():  # steady state: one save and one load done (compiles included)
            time.sleep(0.01)
        if errors or not log:
            print(f"{name}: FAILED {errors}", flush=True)
            self.result["interference"].append(dict(path=name, error=str(errors)))
            th.join()
            return
        w0 = time.perf_counter()
        tflops = self.gemm(self.args.gemm_iters)
        w1 = time.perf_counter()
        stop.set()
        th.join()
        inside = [x for x in log if x[1] >= w0 - 0.05 and x[2] <= w1 + 0.05] or log[-2:]
        rate = {d: nbytes * sum(1 for x in inside if x[0] == d) / max(1e-9, sum(x[2] - x[1] for x in inside if x[0] == d)) / 1e9 for d in ("save", "load")}
        row = dict(path=name, gemm_tflops=tflops, slowdown_pct=100 * (1 - tflops / alone), save_gbps=rate["save"], load_gbps=rate["load"],
                   copy_gbps=nbytes * len(inside) / max(1e-9, sum(x[2] - x[1] for x in inside)) / 1e9, calls_in_window=len(inside))
        self.result["interference"].append(row)
        print(f"{name:40s} GEMM {tflops:6.1f} TFLOP/s ({row['slowdown_pct']:5.1f}% slower)  copy {row['copy_gbps']:6.2f} GB/s "
              f"(save {rate['save']:.1f}, load {rate['load']:.1f})", flush=True)
        self.save()

    # ---- report ---------------------------------------------------------------------------
    def summary(self):
        r = self.result
        raw = next((x for x in r["idle"] if x["path"].startswith("raw")), None)
        print(f"\n== {r['device']} ({r['sms']} SMs), {r['geometry']['bytes'] / GiB:.2f} GiB, idle GPU ==")
        print(f"{'path':34s} {'save GB/s':>10s} {'load GB/s':>10s} {'save/raw':>9s} {'load/raw':>9s}")
        for x in r["idle"]:
            if "save_gbps" in x:
                rel = (x["save_gbps"] / raw["save_gbps"], x["load_gbps"] / raw["load_gbps"]) if raw else (0, 0)
                print(f"{x['path']:34s} {x['save_gbps']:10.2f} {x['load_gbps']:10.2f} {rel[0]:9.2f} {rel[1]:9.2f} {x['note']}")
        print(f"\n== beside a bf16 8192^3 GEMM loop (alone: {', '.join(f'{t:.1f}' for t in r['gemm_alone_tflops'])} TFLOP/s) ==")
        print(f"{'path':40s} {'GEMM TF/s':>9s} {'slowdown':>9s} {'copy GB/s':>9s} {'save':>7s} {'load':>7s}")
        for x in r["interference"]:
            if "gemm_tflops" in x:
                print(f"{x['path']:40s} {x['gemm_tflops']:9.1f} {x['slowdown_pct']:8.1f}% {x['copy_gbps']:9.2f} {x['save_gbps']:7.2f} {x['load_gbps']:7.2f}")
        if r.get("small_batches"):
            print("\n== small batches, idle GPU (GB/s save / load, ms) ==")
            for x in r["small_batches"]:
                print(f"{x['path']:34s} {x['chunks']:3d} chunks  {x['save_gbps']:6.2f} / {x['load_gbps']:6.2f} GB/s   {x['save_ms']:6.2f} / {x['load_ms']:6.2f} ms")
        print("checks:", json.dumps(r["checks"]), flush=True)

    def plot(self):
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib not available: no PNG", flush=True)
            return
        idle = [r for r in self.result["idle"] if "save_gbps" in r]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(16, 7))
        y = range(len(idle))
        ax1.barh([i - 0.2 for i in y], [r["save_gbps"] for r in idle], 0.4, label="save (gather)")
        ax1.barh([i + 0.2 for i in y], [r["load_gbps"] for r in idle], 0.4, label="load (scatter)")
        ax1.set_yticks(list(y), [r["path"] for r in idle], fontsize=7)
        ax1.set_xlabel("GB/s, idle GPU")
        ax1.legend()
        for r in self.result["interference"]:
            ax2.scatter(r["copy_gbps"], r["slowdown_pct"])
            ax2.annotate(r["path"], (r["copy_gbps"], r["slowdown_pct"]), fontsize=6)
        ax2.axhline(3, ls="--", c="gray")
        ax2.axvline(40, ls="--", c="gray")
        ax2.set_xlabel("copy GB/s beside the GEMM loop")
        ax2.set_ylabel("GEMM slowdown %")
        fig.suptitle(f"kvtier GPU copy paths on {self.result['device']}")
        fig.tight_layout()
        fig.savefig(self.out / "gpu_copy.png", dpi=110)


def checksum_pass(args) -> None:
    """The read-only checksum pass over landed chunks, as ``BlockSums.launch`` runs it: best of 5."""
    layout, spans, _, payload = setup(args.tokens)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    scratch = torch.empty(codec.chunk_bytes(layout, CHUNK_BLOCKS), dtype=torch.uint8, device="cuda")
    want = torch.zeros(len(spans), dtype=torch.int64, device="cuda")
    cuda_ops.gather(layout, spans, checksums_out=want)  # the save's own sums of the same blocks
    rows = []
    print(f"{'chunks':>6s} {'GiB':>5s} {'kernel ms':>9s} {'GB/s':>6s} {'plan + kernel + wait ms':>23s}  sums as the save's")
    for count in sorted({16, len(spans)}):
        landed = [ChunkSpan(scratch, CHUNK_BLOCKS, 0, s.block_ids) for s in spans[:count]]
        sums = torch.zeros(count, dtype=torch.int64, device="cuda")
        kernel, whole = [], []
        for _ in range(6):
            begin = time.perf_counter()
            plan = triton_ops.build_plan(layout, landed, write=False)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            sums.zero_()
            a.record()
            cuda_ops.launch(plan, gather=True, sums=sums, max_ctas=sms)
            b.record()
            b.synchronize()
            whole.append(time.perf_counter() - begin)
            kernel.append(a.elapsed_time(b) / 1e3)
        same = torch.equal(sums, want[:count])
        row = dict(chunks=count, bytes=count * payload, kernel_ms=min(kernel[1:]) * 1e3, whole_ms=min(whole[1:]) * 1e3, same=same)
        rows.append(row)
        print(f"{count:6d} {row['bytes'] / GiB:5.2f} {row['kernel_ms']:9.3f} {row['bytes'] / row['kernel_ms'] / 1e6:6.0f} "
              f"{row['whole_ms']:23.3f}  {'yes' if same else 'NO'}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "checksum_pass.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), sms=sms, rows=rows), indent=1))
    print(f"wrote {out / 'checksum_pass.json'}")
    if not all(r["same"] for r in rows):
        sys.exit(1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or str(Path(__file__).parent / "results"))
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--ctas", type=int, nargs="+", default=[2, 4, 8, 16, 32, 132], help="Triton CTA sweep")
    ap.add_argument("--cuda-ctas", type=int, nargs="+", default=[1, 2, 4, 8, 16, 132], help="CUDA C++ CTA sweep")
    ap.add_argument("--staged", nargs="+", default=["cuda:4:4:512", "triton:16:4:512", "cuda:8:4:512", "cuda:4:8:256"],
                    help="dma-staged configs kernel:pack_ctas:slots:staging_MiB")
    ap.add_argument("--tiles", default="16384:16", help="tile_bytes:num_warps,... for the Triton sweep")
    ap.add_argument("--gemm-iters", type=int, default=200)
    ap.add_argument("--load-chunks", type=int, default=32, help="chunks per copy call in the interference run")
    ap.add_argument("--interfere", nargs="+", default=[
        "raw pinned memcpy", "torch", "dma-staged-cuda-c4-4x128M", "dma-staged-triton-c16-4x128M", "dma-staged-cuda-c8-4x128M",
        "dma-staged-cuda-c4-8x32M", "dma-batch", "dma-batch-nosum", "triton-c4-t16k-w16", "triton-c8-t16k-w16",
        "triton-c16-t16k-w16", "triton-c132-t16k-w16", "cuda-c1", "cuda-c2", "cuda-c8"])
    ap.add_argument("--small", nargs="+", default=["dma-staged-cuda-c4-4x128M", "triton-c16-t16k-w16", "cuda-c8"], help="paths of the small-batch section")
    ap.add_argument("--skip", nargs="*", default=[], help="sections to skip: idle small checks interference")
    ap.add_argument("--checksum-pass", action="store_true", help="only the read-only checksum pass over landed chunks")
    args = ap.parse_args()
    if args.checksum_pass:
        return checksum_pass(args)
    args.tiles = [tuple(int(x) for x in t.split(":")) for t in args.tiles.split(",")]
    args.staged = [(k, int(c), int(n), int(m)) for k, c, n, m in (x.split(":") for x in args.staged)]
    b = Bench(args)
    print(f"{b.result['device']}: {b.nbytes / GiB:.2f} GiB in {len(b.spans)} chunks, {len(b.layout.regions)} regions", flush=True)
    if "idle" not in args.skip:
        b.idle()
    if "small" not in args.skip:
        b.small()
    if "checks" not in args.skip:
        b.checks()
    if "interference" not in args.skip:
        if not hasattr(b, "raw"):
            b.raw = torch.empty(b.nbytes, dtype=torch.uint8, device="cuda")
        b.interference()
    b.summary()
    b.plot()
    print(f"wrote {b.out / 'gpu_copy.json'}")


if __name__ == "__main__":
    main()
