"""TierWorker on the real LMCache store and real files: split executors, bounded save backlog,
disk promotion, disk full, O_DIRECT, and what it reports for the commit protocol."""

from __future__ import annotations

import logging
import subprocess
import threading
import time

import pytest
import torch

from kvtier import codec, transfer
from kvtier.jobs import LoadJob, RemoteSource, SaveJob
from kvtier.keys import chunk_keys, namespace, storage_key
from kvtier.layout import build_layout
from kvtier.ops import backend_names
from kvtier.storage import ChunkStore, StoreConfig, Tier
from kvtier.transfer import TierWorker

BLOCK = 16  # tokens
CHUNK_BLOCKS = 2
NUM_BLOCKS = 64


def engine_kv(seed: int = 0):
    """vLLM-CPU style KV: 2 layers of ``[NUM_BLOCKS, 2 heads, BLOCK, 16]`` float32 (4 KiB a block)."""
    alloc = torch.randn(NUM_BLOCKS, 2, 2, BLOCK, 16, generator=torch.Generator().manual_seed(seed))
    return alloc, build_layout({f"l{i}": alloc[:, i] for i in range(2)}, BLOCK, NUM_BLOCKS)


def keys(n: int, seed: int = 0) -> list[bytes]:
    tokens = torch.randint(0, 1000, (n * CHUNK_BLOCKS * BLOCK,), generator=torch.Generator().manual_seed(seed))
    return chunk_keys(tokens.tolist(), CHUNK_BLOCKS * BLOCK, namespace("m"))


class Recorder:
    """Collects what the worker and store report as changed holdings."""

    def __init__(self):
        self.keys: list[bytes] = []

    def __call__(self, keys):
        self.keys.extend(keys)


class GatedStore:
    """The real store, with put() held at a gate: stands for a slow disk or a huge save burst."""

    def __init__(self, store: ChunkStore):
        self._store = store
        self.gate = threading.Event()
        self.entered = threading.Event()

    def put(self, keys, buffers):
        self.entered.set()
        assert self.gate.wait(30)
        return self._store.put(keys, buffers)

    def __getattr__(self, name):
        return getattr(self._store, name)


@pytest.fixture
def stores():
    opened: list[ChunkStore] = []

    def make(cpu_bytes=4 << 20, disk=None, disk_bytes=64 << 20, **kw):
        store = ChunkStore(StoreConfig(cpu_bytes=cpu_bytes, disk_path=None if disk is None else str(disk),
                                       disk_bytes=disk_bytes if disk is not None else 0, **kw))
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


def save_job(ks, first_block=0):
    return SaveJob("r", tuple(ks), tuple(range(first_block, first_block + len(ks) * CHUNK_BLOCKS)))


def blocks(alloc, ids):
    return alloc[list(ids)].clone()


def test_save_then_load_into_other_blocks_is_byte_identical(stores):
    alloc, layout = engine_kv()
    held = Recorder()
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS, on_held=held)
    ks = keys(4)
    try:
        assert worker.save([save_job(ks)]) == 4
        worker.drain()
        assert worker.stats.saved_chunks == 4
        assert held.keys == [storage_key(k, layout.fingerprint) for k in ks]  # committed in order
        dst = tuple(range(32, 40))
        assert worker.load(LoadJob("r", tuple(ks), 0, dst)) == set()
        assert torch.equal(blocks(alloc, dst), blocks(alloc, range(8)))
        assert worker.stats.cpu_hit_tokens == 8 * BLOCK
        assert set(worker.chunk_load_ms()) == {"cpu"}
    finally:
        worker.close()


def test_stored_chunks_are_not_saved_again_but_are_reported_held_again(stores):
    _, layout = engine_kv()
    held = Recorder()
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS, on_held=held)
    ks = keys(3)
    try:
        worker.save([save_job(ks[:2])])
        worker.drain()
        held.keys.clear()
        assert worker.save([save_job(ks)]) == 1  # only the third chunk is new
        worker.drain()
        assert worker.stats.saved_chunks == 3 and worker.stats.skipped_saves == 2
        skeys = [storage_key(k, layout.fingerprint) for k in ks]
        assert sorted(held.keys) == sorted(skeys)  # two re-confirmed, one newly stored
    finally:
        worker.close()


def test_a_load_never_waits_for_a_stuck_save(stores):
    alloc, layout = engine_kv()
    store = GatedStore(stores())
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    ks = keys(6)
    try:
        store.gate.set()
        worker.save([save_job(ks[:2])])
        worker.drain()
        store.gate.clear()
        worker.save([save_job(ks[2:], first_block=4)])  # the save thread now sits inside put()
        assert store.entered.wait(5)
        begin = time.perf_counter()
        worker.submit_load(LoadJob("r", tuple(ks[:2]), 0, tuple(range(40, 44)))).result(timeout=5)
        assert time.perf_counter() - begin < 1.0
        assert worker.take_finished() == ({"r"}, set())
        assert torch.equal(blocks(alloc, range(40, 44)), blocks(alloc, range(4)))
        assert worker.save([save_job(keys(1, seed=9), first_block=20)]) == 1  # the engine is not blocked
    finally:
        store.gate.set()
        worker.close()


def test_the_save_thread_stores_the_chunks_that_landed_meanwhile_in_one_put(stores):
    """One wait (and so one return to the interpreter) per batch, not per chunk."""
    alloc, layout = engine_kv()
    store, puts = GatedStore(stores()), []
    put = store.put
    store.put = lambda ks, buffers: (puts.append(len(ks)), put(ks, buffers))[1]
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    ks = keys(6)
    try:
        worker.save([save_job(ks[:1])])
        assert store.entered.wait(5)  # the save thread holds the first chunk, in put()
        assert worker.save([save_job(ks[1:], first_block=2)]) == 5
        store.gate.set()
        worker.drain()
        assert puts == [1, 5] and worker.stats.saved_chunks == 6
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 52)))) == set()
        assert torch.equal(blocks(alloc, range(40, 52)), blocks(alloc, range(12)))
    finally:
        store.gate.set()
        worker.close()


def test_a_full_save_backlog_drops_the_oldest_pending_chunks_and_counts_them(stores, caplog):
    _, layout = engine_kv()
    store = GatedStore(stores())
    chunk = codec.chunk_bytes(layout, CHUNK_BLOCKS)
    worker = TierWorker(layout, store, CHUNK_BLOCKS, save_backlog_bytes=3 * chunk)
    ks = keys(6)
    try:
        assert worker.save([save_job(ks[:1])]) == 1
        assert store.entered.wait(5)  # chunk 0 is being stored: it cannot be dropped
        assert worker.save([save_job(ks[1:3], first_block=2)]) == 2  # backlog full: 0 (storing), 1, 2
        assert worker.save([save_job(ks[3:5], first_block=6)]) == 2  # drops 1 and 2, the oldest pending
        assert worker.stats.dropped_saves == 2
        assert worker.pending_save_bytes() == 3 * chunk
        assert worker.save([save_job([ks[5]], first_block=10)]) == 1  # drops 3
        assert worker.stats.dropped_saves == 3
        said = [r.getMessage() for r in caplog.records if "given up" in r.getMessage()]
        assert said == [f"kvtier: 2 chunk saves given up (more than save_backlog_bytes={3 * chunk} waiting); those "
                        "chunks are recomputed when needed. 2 given up since start."]  # once a minute at most
        store.gate.set()
        worker.drain()
        stored = [store.contains(storage_key(k, layout.fingerprint)) is not None for k in ks]
        assert stored == [True, False, False, False, True, True]
        assert worker.stats.saved_chunks == 3
        assert store.cpu_bytes_used() == 3 * (-(-chunk // 4096) * 4096)  # dropped buffers went back
    finally:
        store.gate.set()
        worker.close()


def test_a_save_with_no_room_in_the_pool_is_given_up_and_said(stores, monkeypatch, caplog):
    _, layout = engine_kv()
    store = stores()
    lost = Recorder()
    worker = TierWorker(layout, store, CHUNK_BLOCKS, on_lost=lost)
    monkeypatch.setattr(store, "allocate", lambda *a, **k: None)  # every chunk held by readers
    ks = keys(2)
    try:
        assert worker.save([save_job(ks)]) == 0
        assert lost.keys == [storage_key(k, layout.fingerprint) for k in ks] and worker.stats.dropped_saves == 2
        assert "2 chunk saves given up (no room in the CPU tier" in caplog.text
    finally:
        worker.close()


def test_a_save_bigger_than_the_whole_backlog_keeps_its_leading_chunks(stores):
    _, layout = engine_kv()
    chunk = codec.chunk_bytes(layout, CHUNK_BLOCKS)
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS, save_backlog_bytes=2 * chunk)
    ks = keys(5)
    try:
        assert worker.save([save_job(ks)]) == 2
        worker.drain()
        assert worker.stats.dropped_saves == 3
        assert [worker.store.contains(storage_key(k, layout.fingerprint)) for k in ks[:3]] == [Tier.CPU, Tier.CPU, None]
    finally:
        worker.close()


def test_a_corrupt_chunk_is_removed_and_the_store_reports_it_gone(stores):
    alloc, layout = engine_kv()
    store = stores()
    changed = Recorder()
    store.watch(changed)
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    ks = keys(2)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        bad = storage_key(ks[1], layout.fingerprint)
        buffer = store.get(bad)
        buffer.data[codec.HEADER_BYTES + 5] ^= 0xFF
        buffer.release()
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 44)))) == {42, 43}
        assert store.contains(bad) is None and bad in changed.keys
        # Only the intact chunk counts as a hit, whether the check ran on fetch or in the copy.
        stats = worker.stats
        assert (stats.loaded_chunks, stats.failed_chunks) == (1, 1)
        assert stats.cpu_hit_tokens == CHUNK_BLOCKS * layout.block_size
        assert torch.equal(blocks(alloc, range(40, 42)), blocks(alloc, range(2)))
    finally:
        worker.close()


def test_restart_hits_disk_and_promotes_to_cpu(stores, tmp_path):
    alloc, layout = engine_kv()
    ks = keys(3)
    worker = TierWorker(layout, stores(disk=tmp_path), CHUNK_BLOCKS)
    worker.save([save_job(ks)])
    worker.drain()
    worker.close()
    worker.store.close()  # a clean shutdown: every disk write landed

    store = stores(disk=tmp_path)
    skeys = [storage_key(k, layout.fingerprint) for k in ks]
    assert sorted(store.keys()) == sorted(skeys)  # what a restarted rank reports held
    held = Recorder()
    worker = TierWorker(layout, store, CHUNK_BLOCKS, on_held=held)
    try:
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 46)))) == set()
        assert torch.equal(blocks(alloc, range(40, 46)), blocks(alloc, range(6)))
        assert worker.stats.disk_hit_tokens == 6 * BLOCK
        assert held.keys == skeys  # promoted: rank 0 learns they are in CPU now
        assert [store.contains(k) for k in skeys] == [Tier.CPU] * 3
        assert "disk" in worker.chunk_load_ms()
    finally:
        worker.close()


def test_a_read_speed_seeds_the_disk_figure_until_a_load_replaces_it(stores, tmp_path):
    alloc, layout = engine_kv()
    ks = keys(3)
    worker = TierWorker(layout, stores(disk=tmp_path), CHUNK_BLOCKS)
    worker.save([save_job(ks)])
    worker.drain()
    worker.close()
    worker.store.close()
    worker = TierWorker(layout, stores(disk=tmp_path), CHUNK_BLOCKS)
    try:
        assert worker.chunk_load_ms() == {} and worker.probed_tiers() == []
        worker.seed_read_speed("disk", worker.chunk_bytes / 7.0)  # 7 s a chunk: far slower than any real read
        assert worker.chunk_load_ms() == {"disk": pytest.approx(7e3)} and worker.probed_tiers() == ["disk"]
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 46)))) == set()
        assert worker.chunk_load_ms()["disk"] < 1e3  # the loads' own reads, not an average with the seed
        assert worker.probed_tiers() == ["disk"]  # still a measured read speed, refined by loads
    finally:
        worker.close()


def test_o_direct_reads_load_identical_bytes(stores, tmp_path):
    alloc, layout = engine_kv()
    ks = keys(2)
    worker = TierWorker(layout, stores(disk=tmp_path), CHUNK_BLOCKS)
    worker.save([save_job(ks)])
    worker.drain()
    worker.close()
    worker.store.close()
    worker = TierWorker(layout, stores(disk=tmp_path, o_direct=True), CHUNK_BLOCKS)
    try:
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 44)))) == set()
        assert torch.equal(blocks(alloc, range(40, 44)), blocks(alloc, range(4)))
        assert worker.stats.disk_hit_tokens == 4 * BLOCK
    finally:
        worker.close()


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 64 KiB file system (tmpfs), so writes fail with ENOSPC; skipped where mounting is not allowed."""
    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield mount / "disk"
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_disk_full_keeps_every_chunk_in_cpu(stores, tiny_fs, caplog):
    caplog.set_level(logging.WARNING, logger="kvtier")
    alloc, layout = engine_kv()
    store = stores(disk=tiny_fs, disk_bytes=64 << 20)  # the tier believes it has room; the disk has not
    ks = keys(12)
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        assert store._flush()
        failed = [r for r in caplog.records if "disk write failed" in r.getMessage()]
        on_disk = sum(store.contains(storage_key(k, layout.fingerprint)) is not None for k in ks)
        assert failed and on_disk == 12  # each failed write: one line, CPU copy kept
        assert all("No space left" in r.getMessage() for r in failed)
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 64)))) == set()
        assert torch.equal(blocks(alloc, range(40, 64)), blocks(alloc, range(24)))
    finally:
        worker.close()


# ---- CUDA: the load and save executors each on their own stream -----------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def cuda_kv():
    """vLLM's flash layout on the GPU: per layer ``[2, NUM_BLOCKS, BLOCK, 2 heads, 64]`` bf16."""
    alloc = torch.randn(2, 2, NUM_BLOCKS, BLOCK, 2, 64, device="cuda").to(torch.bfloat16)
    return alloc, build_layout({f"l{i}": alloc[i] for i in range(2)}, BLOCK, NUM_BLOCKS)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["torch", "auto", "dma", "triton", "cuda"])
def test_cuda_save_then_load_on_their_own_streams(stores, backend):
    alloc, layout = cuda_kv()
    if backend not in ("auto", *backend_names()):
        pytest.skip(f"ops backend {backend} is not available on this machine")
    worker = TierWorker(layout, stores(cpu_bytes=64 << 20), CHUNK_BLOCKS, backend)
    ks = keys(8)
    try:
        expected = alloc[:, :, :16].clone()
        assert worker.save([save_job(ks)]) == 8  # the engine may overwrite the blocks right after
        alloc[:, :, :16].zero_()
        worker.drain()
        worker.submit_load(LoadJob("r", tuple(ks), 0, tuple(range(32, 48)))).result(timeout=30)
        assert worker.take_finished() == ({"r"}, set())
        assert torch.equal(alloc[:, :, 32:48], expected)  # visible on the engine's stream at once
    finally:
        worker.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("backlog_chunks", "second_waits"), [(None, False), (14, False), (11, True), (7, True)])
def test_cuda_save_waits_for_the_engines_stream_only_when_the_next_save_might_not_fit(stores, backlog_chunks,
                                                                                      second_waits):
    """The engine thread calls save() right after queueing the step's forward, and with async
    scheduling the next step's save comes while that forward still runs: the previous step's
    chunks are still pending then. A save waits for the forward only when its backlog could not
    take another save of its size: two saves of 4 chunks, the first still pending when the second
    comes, fit in 14 chunks with room for a third (12), not in 11. Nothing is dropped, and both
    reload byte for byte."""
    alloc, layout = cuda_kv()
    chunk = codec.chunk_bytes(layout, CHUNK_BLOCKS)
    backlog = None if backlog_chunks is None else backlog_chunks * chunk
    worker = TierWorker(layout, stores(cpu_bytes=64 << 20), CHUNK_BLOCKS, "auto", save_backlog_bytes=backlog)
    first, second = keys(4), keys(4, seed=1)
    try:
        expected = alloc[:, :, :16].clone()
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # a long "forward" on the engine's stream (~1 s)
        forward_done = torch.cuda.Event()
        forward_done.record()
        waits = backlog_chunks is not None and backlog_chunks < 8
        assert worker.save([SaveJob("a", tuple(first), tuple(range(8)))]) == 4
        assert forward_done.query() == waits, "the first save did not wait" if waits else "the first save waited"
        if not waits:
            assert worker.save([SaveJob("b", tuple(second), tuple(range(8, 16)))]) == 4
            assert forward_done.query() == second_waits, (
                "the second save did not wait" if second_waits else "the second save waited")
        worker.drain()
        assert worker.stats.dropped_saves == 0
        assert worker.stats.backlog_waits == int(waits or second_waits)  # each wait counted, and timed
        assert (worker.stats.backlog_wait_ms > 0) == (waits or second_waits)
        if waits:
            assert worker.save([SaveJob("b", tuple(second), tuple(range(8, 16)))]) == 4
            worker.drain()
        worker.submit_load(LoadJob("r", tuple(first) + tuple(second), 0, tuple(range(32, 48)))).result(timeout=30)
        assert worker.take_finished() == ({"r"}, set())
        assert torch.equal(alloc[:, :, 32:48], expected)
    finally:
        worker.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_save_of_a_pushing_producer_waits_for_the_forward(stores):
    """A P/D producer pushing into a consumer's GPU saves with ``wait_forward``: the save waits
    for the step's forward whatever room its backlog has (none bounds it here)."""
    _, layout = cuda_kv()
    worker = TierWorker(layout, stores(cpu_bytes=64 << 20), CHUNK_BLOCKS, "auto")
    try:
        torch.cuda.synchronize()
        torch.cuda._sleep(2_000_000_000)  # a long "forward" on the engine's stream (~1 s)
        forward_done = torch.cuda.Event()
        forward_done.record()
        assert worker.save([save_job(keys(2))], wait_forward=True) == 2
        assert forward_done.query(), "the save did not wait for the forward"
        worker.drain()
        assert worker.stats.dropped_saves == 0
    finally:
        worker.close()


@pytest.mark.gpu
@needs_cuda
def test_cuda_pipelined_save_and_load_at_once_keep_their_bytes(stores, monkeypatch):
    """dma copies in the background, a batch at a time: with one-chunk batches, a save of 8 chunks
    and a load of 8 others run at once on one worker, each with copies still in flight while it
    stores or fetches the next chunks. Both must land byte for byte."""
    if "dma" not in backend_names():
        pytest.skip("ops backend dma is not available on this machine")
    monkeypatch.setattr(transfer, "PIPELINE_BYTES", 1)
    alloc, layout = cuda_kv()
    worker = TierWorker(layout, stores(cpu_bytes=64 << 20), CHUNK_BLOCKS, "dma")
    first, second = keys(8), keys(8, seed=1)
    try:
        worker.save([save_job(first)])
        worker.drain()
        expected_load, expected_save = alloc[:, :, :16].clone(), alloc[:, :, 16:32].clone()
        loading = worker.submit_load(LoadJob("r", tuple(first), 0, tuple(range(32, 48))))
        assert worker.save([SaveJob("s", tuple(second), tuple(range(16, 32)))]) == 8
        loading.result(timeout=30)
        worker.drain()
        assert worker.take_finished() == ({"r"}, set())
        assert torch.equal(alloc[:, :, 32:48], expected_load)
        alloc[:, :, 16:32].zero_()
        assert worker.load(LoadJob("r2", tuple(second), 0, tuple(range(48, 64)))) == set()
        assert torch.equal(alloc[:, :, 48:64], expected_save)
    finally:
        worker.close()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_cuda_load_of_a_corrupt_chunk_fails_from_that_chunk_on(stores, backend, caplog):
    alloc, layout = cuda_kv()
    store = stores(cpu_bytes=64 << 20)
    worker = TierWorker(layout, store, CHUNK_BLOCKS, backend)
    ks = keys(4)
    try:
        worker.save([save_job(ks)])
        worker.drain()
        victim = storage_key(ks[2], layout.fingerprint)
        held = store.get(victim)
        held.data[codec.HEADER_BYTES + 100] ^= 0xFF  # bit rot inside the CPU tier's copy
        held.release()
        worker.submit_load(LoadJob("r", tuple(ks), 0, tuple(range(32, 40)))).result(timeout=30)
        finished, failed = worker.take_finished()
        assert finished == {"r"} and failed == set(range(36, 40))  # chunks 2 and 3
        assert store.contains(victim) is None
        assert "unusable" in caplog.text
    finally:
        worker.close()


def test_a_chunk_of_the_previous_format_on_disk_reads_as_a_miss_and_is_removed(stores, tmp_path):
    """Regression for the format version 2 bump: a version-1 chunk file left by an older kvtier
    (same storage key: the layout fingerprint did not change) is refused, not loaded, and deleted."""
    from codec.test_chunk import old_format_chunk

    alloc, layout = engine_kv()
    ks = keys(2)
    skeys = [storage_key(k, layout.fingerprint) for k in ks]
    store = stores(disk=tmp_path)
    for skey in skeys:
        buffer = store.allocate(codec.chunk_bytes(layout, CHUNK_BLOCKS))
        buffer.data.copy_(old_format_chunk(layout, CHUNK_BLOCKS))
        store.put([skey], [buffer])
    store.close()  # waits for the write-through
    files = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert len(files) == 2

    store = stores(disk=tmp_path)  # a restarted kvtier of the new format
    assert [store.contains(k) for k in skeys] == [Tier.DISK, Tier.DISK]
    worker = TierWorker(layout, store, CHUNK_BLOCKS)
    before = blocks(alloc, range(40, 44))
    try:
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(40, 44)))) == {40, 41, 42, 43}
        assert store.contains(skeys[0]) is None
        assert sum((tmp_path / f).exists() for f in files) == 1  # the first is deleted; the load stopped there
        assert torch.equal(blocks(alloc, range(40, 44)), before)  # nothing was scattered
        assert worker.load(LoadJob("r", tuple(ks[1:]), 0, tuple(range(40, 42)))) == {40, 41}
        assert [store.contains(k) for k in skeys] == [None, None]
        assert [f for f in files if (tmp_path / f).exists()] == []
    finally:
        worker.close()


def test_an_inline_load_runs_on_the_callers_thread_and_is_finished_when_submit_returns(stores):
    """For a worker sharing the engine loop's interpreter: no load thread waiting for the GIL."""
    alloc, layout = engine_kv()
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS, load_inline=True)
    ks = keys(2)
    threads = []
    load = worker.load

    def spy(job):
        threads.append(threading.get_ident())
        return load(job)

    worker.load = spy
    try:
        worker.save([save_job(ks)])
        worker.drain()
        future = worker.submit_load(LoadJob("r", tuple(ks), 0, tuple(range(40, 44))))
        assert future.done() and threads == [threading.get_ident()]
        assert worker.take_finished() == ({"r"}, set())
        assert torch.equal(blocks(alloc, range(40, 44)), blocks(alloc, range(4)))
    finally:
        worker.close()


def test_a_busy_steps_load_goes_to_the_load_thread_and_later_ones_queue_behind_it(stores):
    """load_inline, but the step computes other requests (busy): their tokens must not wait for
    the load, so it runs on the load thread; an idle step's load while that one still runs
    queues behind it (loads run in order, never two at once)."""
    alloc, layout = engine_kv()
    worker = TierWorker(layout, stores(), CHUNK_BLOCKS, load_inline=True)
    ks = keys(2)
    threads, release = [], threading.Event()
    load = worker.load

    def spy(job):
        threads.append(threading.get_ident())
        if job.req_id == "busy":
            assert release.wait(5)
        return load(job)

    worker.load = spy
    try:
        worker.save([save_job(ks)])
        worker.drain()
        busy = worker.submit_load(LoadJob("busy", tuple(ks), 0, tuple(range(40, 44))), busy=True)
        idle = worker.submit_load(LoadJob("idle", tuple(ks), 0, tuple(range(50, 54))))
        assert not busy.done() and not idle.done()  # the idle step's load waits its turn on the thread
        release.set()
        idle.result(timeout=5)
        assert threading.get_ident() not in threads and len(threads) == 2
        assert worker.take_finished() == ({"busy", "idle"}, set())
        inline = worker.submit_load(LoadJob("later", tuple(ks), 0, tuple(range(40, 44))))  # the thread is free again
        assert inline.done() and threads[-1] == threading.get_ident()
        assert torch.equal(blocks(alloc, range(50, 54)), blocks(alloc, range(4)))
    finally:
        worker.close()


@pytest.mark.gpu
@needs_cuda
def test_deferred_save_reads_are_guarded_when_their_blocks_are_given_out_again(stores, monkeypatch):
    """defer_reuse: a save leaves the engine's stream free; a step that is given one of the
    blocks being read (guard_reuse) waits for the read, so zeroing them right after the guard
    cannot reach the saved chunk. Staging of one small slot keeps the reads in flight a while."""
    if "dma" not in backend_names():
        pytest.skip("ops backend dma is not available on this machine")
    monkeypatch.setattr(transfer, "PIPELINE_BYTES", 1)
    alloc, layout = cuda_kv()
    worker = TierWorker(layout, stores(cpu_bytes=64 << 20), CHUNK_BLOCKS, "dma", defer_reuse=True)
    ks = keys(8)
    try:
        expected = alloc[:, :, :16].clone()
        torch.cuda._sleep(200_000_000)  # a "forward" still running: the save's reads wait for it
        assert worker.save([save_job(ks)]) == 8
        worker.guard_reuse(tuple(range(40, 44)))  # unrelated blocks: nothing to wait for
        assert worker.stats.reuse_waits == 0
        worker.guard_reuse((3, 200))  # block 3 is being read
        assert worker.stats.reuse_waits == 1  # the step's stream waited, and it was counted
        alloc[:, :, :16].zero_()  # the step's kernels, on the engine's stream
        worker.drain()
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(32, 48)))) == set()
        assert torch.equal(alloc[:, :, 32:48], expected)
        worker.guard_reuse((3,))  # every read has passed: the record of it is dropped
        assert not worker._unread
    finally:
        worker.close()


@pytest.mark.gpu
@needs_cuda
def test_a_pd_load_waits_on_the_host_for_a_deferred_save_reading_its_blocks(stores, monkeypatch):
    """Regression: NIXL writes a P/D load's blocks from the host, on no CUDA stream. A deferred save
    still reading those blocks (they were freed and given to the P/D request) must have read them
    before the transfer starts, else the chunk it stores holds the new request's KV under the old
    key, with a valid checksum. The transfer here is a copy on a stream of its own."""
    if "dma" not in backend_names():
        pytest.skip("ops backend dma is not available on this machine")
    monkeypatch.setattr(transfer, "PIPELINE_BYTES", 1)  # one small staging slot: the reads stay in flight a while
    alloc, layout = cuda_kv()
    landed_early = []

    def fetch_remote(job, items, targets):  # a generator, as fetch_chunks
        reads = worker.reuse.reuse_after
        landed_early.append(reads is not None and not reads.query())
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            alloc[:, :, :16].zero_()
        other.synchronize()
        yield from ()

    worker = TierWorker(layout, stores(cpu_bytes=64 << 20), CHUNK_BLOCKS, "dma", defer_reuse=True,
                        fetch_remote=fetch_remote)
    ks = keys(8)
    try:
        expected = alloc[:, :, :16].clone()
        assert worker.save([save_job(ks)]) == 8
        worker.guard_reuse(tuple(range(16)))  # the step that parks the P/D request gives it the blocks
        remote = RemoteSource("t", ("tcp://127.0.0.1:1",), 0, False, ())
        worker.submit_load(LoadJob("pd", tuple(ks), 0, tuple(range(16)), 0, remote)).result(timeout=30)
        worker.drain()
        assert landed_early == [False]
        assert worker.load(LoadJob("r", tuple(ks), 0, tuple(range(32, 48)))) == set()
        assert torch.equal(alloc[:, :, 32:48], expected)
    finally:
        worker.close()
