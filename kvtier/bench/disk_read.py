"""``kvtier-bench disk-read``: how fast the disk tier reads a load's chunks with O_DIRECT, next to
the disk's own sequential O_DIRECT read speed, measured the same way on the same directory.

Rows (GB/s = bytes / wall time, 1 GB = 10^9 bytes; each the best and the median of ``--repeats``):

* ``sequential``: one file as large as all the chunks together, read from start to end in
  16 MiB O_DIRECT reads, one at a time (``dd iflag=direct bs=16M``): the disk's own figure;
* ``one request per chunk``: ``ChunkStore.get`` of each chunk in turn, each file read with one
  O_DIRECT request (a reader of one thread and unbounded parts: the tier's reads before parallel parts);
* ``parallel parts``: the same gets with the tier's reader (its threads, its part size);
* ``a load (read-ahead)``: ``will_need`` of every key, then the gets: what a load does;
* ``speed probe``: what the tier measures at start (``ChunkStore.disk_read_speed``), on the same files.

Every store row opens a new store on the directory (its CPU tier empty: every chunk is on disk
only) and times the reads alone. O_DIRECT bypasses the page cache, so no run warms the next. The
bench deletes its files when it ends.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time

from kvtier.bench.common import NO_MATPLOTLIB, Progress, make_parent, positive, pyplot, save_figure

SEQ_READ = 16 << 20  # bytes per sequential O_DIRECT read, as dd bs=16M
HEADER = 64  # bytes of a chunk's header: chunk files are never a whole number of blocks
ROWS = {"sequential": "sequential O_DIRECT (dd bs=16M)", "one": "one request per chunk",
        "parts": "parallel parts", "load": "a load (read-ahead)", "probe": "speed probe"}


def add_parser(commands) -> None:
    """Register ``kvtier-bench disk-read``."""
    p = commands.add_parser(
        "disk-read", help="the disk tier's O_DIRECT chunk reads against the disk's sequential read speed",
        description="Write chunk files into a disk tier in --dir, then read them back with O_DIRECT as a load does "
        "(parallel parts, read-ahead) and as one request per chunk, next to one large file read sequentially with "
        "O_DIRECT in 16 MiB reads. Prints a table; deletes its files at the end.")
    p.add_argument("--dir", required=True, help="directory on the disk to measure (not tmpfs: it refuses O_DIRECT)")
    p.add_argument("--chunk-mib", type=positive, default=32,
                   help="payload MiB per chunk (default 32: 256 tokens of Llama-3-8B); files add a 64-byte header")
    p.add_argument("--chunks", type=positive, default=16, help="chunks per load (default 16)")
    p.add_argument("--repeats", type=positive, default=3, help="samples per row (default 3)")
    p.add_argument("--json", metavar="FILE", help="write every sample to FILE")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart (needs matplotlib)")
    p.set_defaults(run=_main, parser=p)


def _main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from kvtier.storage import StorageError

    directory = os.path.join(args.dir, f"kvtier-disk-read-{os.getpid()}")
    progress = Progress("disk-read")
    try:
        result = run(directory, args.chunk_mib << 20, args.chunks, args.repeats, progress)
    except (RuntimeError, OSError, StorageError) as exc:
        print(f"kvtier-bench disk-read: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(result), flush=True)
    if args.json:
        make_parent(args.json)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        progress(f"wrote {args.json}")
    if args.plot:
        progress(write_plot(result, args.plot) or f"wrote {args.plot}")
    return 0


def run(directory: str, payload_bytes: int, chunks: int, repeats: int, progress) -> dict:
    """Measure every row in ``directory`` (created, and removed with what it holds at the end)."""
    from kvtier.storage import ChunkStore, StoreConfig
    from kvtier.storage._direct import PART_BYTES, THREADS

    os.makedirs(directory, exist_ok=True)
    chunk = payload_bytes + HEADER
    config = StoreConfig(cpu_bytes=chunks * (chunk + (8 << 10)) + (64 << 20), disk_path=directory,
                         disk_bytes=2 * chunks * (chunk + (8 << 10)), o_direct=True)
    keys = [i.to_bytes(16, "little") for i in range(chunks)]
    samples: dict[str, list[float]] = {name: [] for name in ROWS}
    seq = os.path.join(directory, "sequential")
    try:
        progress(f"writing {chunks} chunks of {chunk} bytes and a {chunks * chunk / 2**30:.2f} GiB file in {directory}")
        _write_chunks(ChunkStore(config), keys, chunk)
        _write_file(seq, chunks * chunk)
        for r in range(repeats):
            samples["sequential"].append(_sequential(seq))
            for name in ("one", "parts", "load", "probe"):
                with ChunkStore(config) as store:
                    samples[name].append(_store_row(store, keys, name, chunk))
            progress(f"repeat {r + 1}/{repeats}: " + ", ".join(f"{n} {samples[n][-1] / 1e9:.2f} GB/s" for n in ROWS))
    finally:
        for entry in os.scandir(directory):
            os.unlink(entry.path)
        os.rmdir(directory)
    return {"benchmark": "disk-read", "dir": os.path.dirname(directory), "chunk_bytes": chunk, "chunks": chunks,
            "repeats": repeats, "threads": THREADS, "part_bytes": PART_BYTES, "timestamp": time.time(),
            "rows": {name: {"label": label, "bytes_per_s": samples[name]} for name, label in ROWS.items()}}


def _write_chunks(store, keys: list[bytes], chunk: int) -> None:
    block = os.urandom(1 << 20)  # not zeros: a compressing file system would store nothing
    with store:
        for k in keys:
            buf = store.allocate(chunk)
            data = (block * (chunk // len(block) + 1))[:chunk]
            buf.data.numpy()[:] = memoryview(data)
            store.put([k], [buf])
        if not store._flush(600):
            raise RuntimeError("the chunks' writes to disk did not finish within 600 s")


def _write_file(path: str, nbytes: int) -> None:
    block = os.urandom(SEQ_READ)
    with open(path, "wb") as f:
        for off in range(0, nbytes, len(block)):
            f.write(block[: min(len(block), nbytes - off)])
        f.flush()
        os.fsync(f.fileno())


def _sequential(path: str) -> float:
    """Bytes/s of ``path``'s aligned head read with O_DIRECT, one :data:`SEQ_READ` read at a time."""
    buf = mmap.mmap(-1, SEQ_READ)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        size = os.fstat(fd).st_size
        size -= size % 4096
        done, start = 0, time.perf_counter()
        while done < size:
            n = os.preadv(fd, [memoryview(buf)[: min(SEQ_READ, size - done)]], done)
            if not n:
                break
            done += n
        return done / (time.perf_counter() - start)
    finally:
        os.close(fd)
        buf.close()


def _store_row(store, keys: list[bytes], name: str, chunk: int) -> float:
    """Bytes/s of row ``name`` through ``store`` (a new one: every chunk on disk only; ``chunk`` bytes each)."""
    if name == "probe":
        return store.disk_read_speed().bytes_per_s
    # Touch the pool's pages first, as pinned memory (cudaHostAlloc) or a pool in use would have them.
    touched = [store.allocate(chunk) for _ in keys]
    for buf in touched:
        buf.data.zero_()
        buf.release()
    if name == "one":
        reader = store._disk._reader
        reader.threads, reader.part_bytes = 1, 1 << 40
    total, start = 0, time.perf_counter()
    if name == "load":
        store.will_need(keys)
    for k in keys:
        buf = store.get(k)
        if buf is None:
            raise RuntimeError(f"chunk {k.hex()} was not read back from {store._config.disk_path}")
        total += buf.data.numel()
        buf.release()
    return total / (time.perf_counter() - start)


def format_table(result: dict) -> str:
    """The rows: GB/s best and median, ms per chunk (median), and each row against sequential."""
    rows = result["rows"]
    seq = statistics.median(rows["sequential"]["bytes_per_s"])
    lines = [f"kvtier-bench disk-read: {result['chunks']} chunks of {result['chunk_bytes']} bytes in {result['dir']}; "
             f"O_DIRECT on {result['threads']} threads, parts of {result['part_bytes'] >> 20} MiB; "
             f"best / median of {result['repeats']}",
             f"{'row':<32} {'GB/s best':>9} {'median':>7} {'ms/chunk':>8} {'x seq':>6}"]
    lines.append("-" * len(lines[-1]))
    for name, row in rows.items():
        values = row["bytes_per_s"]
        med = statistics.median(values)
        per_chunk = result["chunk_bytes"] / med * 1e3
        lines.append(f"{row['label']:<32} {max(values) / 1e9:>9.2f} {med / 1e9:>7.2f} {per_chunk:>8.1f} "
                     f"{med / seq:>6.2f}")
    return "\n".join(lines)


def write_plot(result: dict, path: str) -> str | None:
    """Bar chart of each row's median GB/s as a PNG; the reason when skipped (matplotlib missing)."""
    plt = pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    rows = result["rows"]
    values = [statistics.median(r["bytes_per_s"]) / 1e9 for r in rows.values()]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar(range(len(values)), values)
    ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
    ax.set_xticks(range(len(values)), [r["label"].replace(" (", "\n(") for r in rows.values()], fontsize=8)
    ax.set_ylabel(f"GB/s (median of {result['repeats']})")
    ax.set_title(f"disk tier O_DIRECT reads: {result['chunks']} chunks of {result['chunk_bytes'] / 2**20:.0f} MiB",
                 fontsize=10)
    save_figure(fig, path)
    return None
