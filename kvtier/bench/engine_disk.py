"""The disk rows of ``kvtier-bench engine`` (``--engines disk``): a prompt's first sight served
from the disk tier by a fresh engine, against computing it, with the page cache emptied between.

Steps: the disk's own read speed is measured on the disk tier's directory, the way a worker's
speed probe measures it at start (``ChunkStore.disk_read_speed``: a scratch file, buffered or
O_DIRECT as ``--disk-io`` says); an engine with a disk tier computes the prompts (``recompute_ms``:
their TTFT, kvtier saving them through to disk) and ends once the directory holds every chunk
file (the write-through landed); their chunk files leave the page cache (:func:`drop_page_cache`:
``/proc/sys/vm/drop_caches`` where this process may write it, else ``POSIX_FADV_DONTNEED`` per
file, then the pages still resident are counted); a fresh engine on the same directory serves
each prompt (``first_sight_ms``: its chunks read from disk), then the same prompt again after
``reset_prefix_cache()`` (``again_ms``: the chunks the first sight promoted, a CPU-tier hit).
With ``--disk-queue N``, N more prompts of the longest length are written, and the fresh engine
gets them last, all at once: ``queue`` says which tier each one's load came from (those that wait
should find their chunks promoted to the CPU tier meanwhile, by the look-ahead of kvtier's
scheduler, which the fresh engine runs). The CPU tier is ``--cpu-gib``.

The result (:func:`disk_result`), ``{length: [ms, ...]}`` per row, is written on its own as
``disk-<card>-<release>.json`` (:func:`result_name`) beside its table as ``.txt``.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import re
import shutil
import statistics
from typing import Callable

from kvtier.bench.common import evict_from_page_cache, files_under, make_parent, vllm_version
from kvtier.bench.ttft import spawn

CHILD = "kvtier.bench.engine_child"
CHECK_TOKENS = 16
DISK_BYTES = 96 << 30  # the disk tier: room for every prompt the bench writes (12 of 32k: 48 GiB), none evicted
CHUNK_TOKENS = 256  # kvtier's chunk_tokens, left at its default by the bench
DROP_CACHES = "/proc/sys/vm/drop_caches"
ROWS = (("recompute_ms", "recompute"), ("first_sight_ms", "first sight (disk)"), ("again_ms", "again (cpu)"))


def run(args, lengths: list[int], prompt: Callable[[int, int], list[int]], spec: Callable[[list[dict], dict], dict],
        tmp: str, progress) -> tuple[list[dict], dict, dict]:
    """Run both engines; returns the fresh engine's rounds, its output and :func:`disk_result`.
    ``spec(rounds, kvtier_config)``: an engine child's spec; ``prompt(seed, length)``: token ids."""
    disk = os.path.join(args.disk_dir or tmp, "kvtier-disk-bench")
    if os.path.exists(disk):
        raise SystemExit(f"--disk-dir: {disk} exists already; remove it or give another directory")
    config = {"cpu_bytes": args.cpu_gib << 30, "disk_path": disk, "disk_bytes": DISK_BYTES, "disk_io": args.disk_io}
    speed = disk_read_speed(disk, args.disk_io == "direct")
    progress("disk read speed " + (speed.describe() if speed else "not measured"))
    ttft = [(n, prompt(300_000 + 1000 * r + n, n)) for n in lengths for r in range(args.repeats)]
    warm = [{"prompts": [prompt(1, 1024)], "max_tokens": 4, "tag": ["warmup"]}]
    warm += [{"prompts": [prompt(400_000 + n, n)], "tag": ["warmup"]} for n in lengths]  # long-context first steps
    write = warm + [{"prompts": [p], "tag": ["recompute", n]} for n, p in ttft]
    write += [{"prompts": [prompt(7 + n, n)], "tag": ["write", n]} for n in lengths]
    queue = [prompt(800_000 + i, max(lengths)) for i in range(args.disk_queue)]
    write += [{"prompts": [p], "tag": ["write-queue"]} for p in queue]
    files = chunk_files(write, CHUNK_TOKENS) * args.tp  # each rank writes its piece of a chunk
    write[-1]["until_files"] = {"dir": disk, "count": files, "timeout_s": 600}
    progress("engine disk-write: computes the disk prompts (written through to the disk tier)")
    written, _ = spawn(spec(write, config), tmp, "disk-write", timeout_s=900, multiprocess=True, module=CHILD)
    if not (files := written["rounds"][-1].get("files", {})).get("landed"):
        why = " (no file came for a minute: some were evicted?)" if files.get("stalled") else ""
        progress(f"the write-through had not landed when the writing engine ended: {files}{why}; "
                 "first sights may recompute")
    cache = drop_page_cache(disk)
    progress("page cache: " + describe_drop(cache) + "; engine disk (fresh, same directory)")
    read = [{**r, "prompts": [prompt(500_000 + i, len(r["prompts"][0]))]} for i, r in enumerate(warm)]  # not on disk
    for n, p in ttft:
        read.append({"prompts": [p], "pause_s": args.settle_s, "tag": ["disk", n]})
        read.append({"prompts": [p], "reset": True, "pause_s": args.settle_s, "tag": ["again", n]})
    read += [{"prompts": [prompt(7 + n, n)], "max_tokens": CHECK_TOKENS, "tag": ["check-disk", n]} for n in lengths]
    read += [{"prompts": queue, "pause_s": args.settle_s, "tag": ["queue", max(lengths)]}] if queue else []
    fresh = {**spec(read, config), "scheduler": True}
    out, log = spawn(fresh, tmp, "disk", timeout_s=900, multiprocess=True, module=CHILD,
                     env={"KVTIER_LOG_LEVEL": "DEBUG"})
    ms = rows_ms(write, written) | rows_ms(read, out)
    result = disk_result(_card(args.tp), vllm_version(), lengths, args.repeats, args.disk_io, speed, cache, ms)
    result["queue"] = queue_result(out["rounds"][-1], max(lengths), log) if queue else None
    result["medium"], result["plans"] = medium(disk), plan_lines(log)
    for line in result["plans"]:
        progress("engine disk: " + line)
    shutil.rmtree(disk, ignore_errors=True)
    return read, out, result


_PLAN = re.compile(r"kvtier: (request \S+ (?:loads nothing of .*|loaded \d+ of \d+ blocks .*)|disk reads .*)")


def plan_lines(log: str, limit: int = 60) -> list[str]:
    """The fresh engine's word on each load (kvtier's DEBUG lines: what each request loaded from which
    tier, or why it loaded nothing), at most ``limit`` of them, in order."""
    return [m.group(1) for m in map(_PLAN.search, log.splitlines()) if m][:limit]


def chunk_files(rounds: list[dict], chunk_tokens: int) -> int:
    """How many chunk files the disk tier holds once ``rounds``' prompts are all written: their
    distinct prompts' whole chunks (random prompts share no chunk)."""
    prompts = {tuple(p) for r in rounds for p in r["prompts"]}
    return sum(len(p) // chunk_tokens for p in prompts)


_LOADED = re.compile(r"kvtier: request (\S+) (?:loaded \d+ of \d+ blocks \(([^)]*)\)|loads nothing of )")
_TOKENS = re.compile(r"(\d+) tokens from (\w+)")


def queue_result(round_out: dict, length: int, log: str) -> dict:
    """The queue round (``--disk-queue`` prompts of ``length`` tokens on disk, arriving at once):
    ``{"requests": n, "tokens": length, "seconds": until the last one's first token, "tiers": per
    request in arrival order, "cpu" | "disk" | "cpu+disk" | "none" (recomputed), from its first
    load line in ``log``, "transfers": tokens per tier the engine reported for the round}``."""
    lines = [(m.group(1), dict((t, int(n)) for n, t in _TOKENS.findall(m.group(2) or "")))
             for m in map(_LOADED.search, log.splitlines()) if m]
    tiers = []
    for output in round_out["outputs"]:
        rid = output.get("id")
        first = next((tokens for line_id, tokens in lines if rid and (line_id == rid or line_id.startswith(rid + "-"))),
                     None)
        tiers.append("?" if first is None else "+".join(t for t in ("cpu", "disk") if first.get(t)) or "none")
    moved = round_out.get("transfers") or {}
    return {"requests": len(round_out["outputs"]), "tokens": length, "seconds": round_out["seconds"], "tiers": tiers,
            "transfers": {tier: moved.get(f"hit_tokens_{tier}", 0) for tier in ("cpu", "disk")}}


def medium(path: str) -> str:
    """The file system type ``path`` lies on, as the disk tier sees it (e.g. ``ext4``, ``tmpfs``;
    ``unknown`` where that cannot be read)."""
    from kvtier.storage import file_system

    return file_system(path)


def disk_read_speed(disk: str, o_direct: bool):
    """The disk's sequential read speed in ``disk`` (a DiskSpeed, or None), as the speed probe takes it."""
    from kvtier.storage import ChunkStore, StoreConfig

    with ChunkStore(StoreConfig(cpu_bytes=64 << 20, disk_path=disk, disk_bytes=1 << 30, o_direct=o_direct)) as store:
        return store.disk_read_speed()


def rows_ms(rounds: list[dict], out: dict) -> dict[str, dict[str, list[float]]]:
    """``{"recompute_ms" | "first_sight_ms" | "again_ms": {length: [ms, ...]}}`` from an engine's rounds."""
    names = {"recompute": "recompute_ms", "disk": "first_sight_ms", "again": "again_ms"}
    ms: dict[str, dict[str, list[float]]] = {}
    for rnd, one in zip(rounds, out["rounds"]):
        tag = rnd.get("tag", [""])
        if tag[0] in names:
            ms.setdefault(names[tag[0]], {}).setdefault(str(tag[1]), []).append(round(one["seconds"] * 1e3, 2))
    return ms


def disk_result(card: str, release: str, lengths: list[int], repeats: int, disk_io: str, speed, cache: dict,
                ms: dict) -> dict:
    """The JSON of the disk rows; ``speed``: a DiskSpeed or None; ``cache``: :func:`drop_page_cache`'s."""
    return {"benchmark": "disk", "card": card, "vllm": release, "lengths": lengths, "repeats": repeats,
            "disk_io": disk_io, "disk_read_bytes_per_s": speed.bytes_per_s if speed else None,
            "disk_read": speed.describe() if speed else None, "page_cache": cache,
            **{name: ms.get(name, {}) for name, _ in ROWS}}


def result_name(card: str, release: str, medium: str = "") -> str:
    """``disk-<card>-<release>``, e.g. ``disk-h200-v033`` for an H200 and vLLM 0.33.0; ``-tmpfs`` added
    for a disk tier on a ``medium`` of memory (tmpfs, ramfs)."""
    parts = release.split(".")
    tag = f"v{parts[0]}{int(parts[1]):02d}" if len(parts) > 1 and parts[0].isdigit() and parts[1].isdigit() else release
    from kvtier.storage import MEMORY_FILE_SYSTEMS

    return f"disk-{card}-{tag}" + ("-tmpfs" if medium in MEMORY_FILE_SYSTEMS else "")


def write(result: dict, directory: str) -> str:
    """Write ``result`` as ``directory/disk-<card>-<release>.json`` and its table as ``.txt``; the JSON's path."""
    path = os.path.join(directory, result_name(result["card"], result["vllm"], result.get("medium", "")) + ".json")
    make_parent(path)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    with open(path[: -len(".json")] + ".txt", "w") as f:
        f.write(format_table(result) + "\n")
    return path


def format_table(result: dict) -> str:
    """TTFT per length, median / best ms of each row, and first sight against recompute."""
    speed = result["disk_read_bytes_per_s"]
    lines = [f"kvtier-bench engine, disk tier ({result['disk_io']} on {result.get('medium', '?')}, {result['card']}, "
             f"vLLM {result['vllm']}): "
             f"TTFT ms, median / best of {result['repeats']}",
             "disk read speed: " + (f"{speed / 1e9:.2f} GB/s ({result['disk_read']})" if speed else "not measured"),
             "page cache: " + describe_drop(result["page_cache"])]
    head = f"{'tokens':>6} " + " ".join(f"{label:>18}" for _, label in ROWS) + f" {'first sight / recompute':>23}"
    lines += [head, "-" * len(head)]
    for n in result["lengths"]:
        cells, med = [], {}
        for name, _ in ROWS:
            values = result[name].get(str(n))
            med[name] = statistics.median(values) if values else None
            cells.append(f"{med[name]:.0f} / {min(values):.0f}" if values else "-")
        ratio = (f"{med['first_sight_ms'] / med['recompute_ms']:.2f}" if med["first_sight_ms"] and med["recompute_ms"]
                 else "-")
        lines.append(f"{n:>6} " + " ".join(f"{c:>18}" for c in cells) + f" {ratio:>23}")
    if queue := result.get("queue"):
        moved = queue["transfers"]
        lines.append(f"queue: {queue['requests']} prompts of {queue['tokens']} tokens on disk at once, last first token "
                     f"after {queue['seconds']:.2f} s; loaded from, in arrival order: {', '.join(queue['tiers'])} "
                     f"({moved['cpu']} tokens from cpu, {moved['disk']} from disk)")
    return "\n".join(lines)


def describe_drop(cache: dict) -> str:
    """E.g. ``dropped (drop_caches), 12 files`` or ``NOT dropped: ... (3.1 MiB of 12 files still resident)``."""
    where = f"{cache['files']} files"
    if cache["dropped"]:
        return f"dropped ({cache['how']}), {where}"
    return (f"NOT dropped: {cache['problem']} ({cache['resident_bytes'] / 2**20:.1f} MiB of {where} still resident; "
            "first sight may read from memory)")


def drop_page_cache(path: str) -> dict:
    """Write back and evict every file under ``path`` from the page cache, and say how it went:
    ``{"dropped": bool, "how": "drop_caches" | "fadvise", "files": n, "resident_bytes": bytes still
    cached, "problem": why not dropped, or None}``."""
    files = files_under(path)
    problem = None
    evict_from_page_cache(files)
    how = "fadvise"
    try:
        os.sync()
        with open(DROP_CACHES, "w") as f:
            f.write("1\n")
        how = "drop_caches"
    except OSError as exc:
        problem = f"{DROP_CACHES} not writable ({exc.strerror or type(exc).__name__})"
    resident = sum(resident_bytes(file) for file in files)
    if resident == 0:
        problem = None
    elif problem is None:
        problem = "pages stayed cached"
    return {"dropped": resident == 0, "how": how, "files": len(files), "resident_bytes": resident, "problem": problem}


def resident_bytes(path: str) -> int:
    """Bytes of ``path`` in the page cache now (``mincore`` over a private mapping of it); 0 for an empty file."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        anchor = ctypes.c_char.from_buffer(m)
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore failed on {path}")
        finally:
            del anchor
        return min(size, sum(b & 1 for b in vec) * mmap.PAGESIZE)


def _card(tp: int) -> str:
    """The GPU's short name, ``h200`` (``h200x2`` at TP=2), from CUDA's device name."""
    import torch

    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w and w not in ("nvidia", "tesla", "geforce")]
    card = words[0] if words else "gpu"
    return card if tp == 1 else f"{card}x{tp}"
