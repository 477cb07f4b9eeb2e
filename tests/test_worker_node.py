"""The engine-neutral worker node: started from layouts alone (no engine), it saves a chunk, shows it to rank 0's
lookup index and loads it back into other blocks; and importing it loads no vLLM."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import zmq

from kvtier.config import KvtierConfig
from kvtier.jobs import LoadJob, SaveJob
from kvtier.keys import chunk_keys
from kvtier.layout import build_layout
from kvtier.lookup import LookupClient
from kvtier.worker_node import WorkerNode

BLOCK, CHUNK, NUM_BLOCKS = 16, 32, 24  # tokens per block, tokens per chunk, blocks per layer


def finished(node: WorkerNode, timeout_s: float = 10.0) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while not (done := node.finished_loads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return done


def test_importing_the_worker_node_loads_no_vllm():
    code = "import sys, kvtier.worker_node; print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_a_node_started_from_layouts_saves_and_loads_a_chunk(tmp_path):
    kv = torch.randn(2, NUM_BLOCKS, 2, BLOCK, 8)  # [layers, blocks, K/V, block, head] float32, vLLM-CPU-like
    layout = build_layout({f"layer.{i}": kv[i] for i in range(2)}, BLOCK, NUM_BLOCKS, model="tiny")
    config = KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24)
    node = WorkerNode(config, [layout], (CHUNK // BLOCK,), rank=0, world_size=1, endpoint=f"ipc://{tmp_path}/l.sock",
                      produce=False, engine="a test")
    try:
        assert node.server is not None and node.chunk_server is None and node.group_transfers == [node.transfers]
        key = chunk_keys(list(range(CHUNK)), CHUNK, b"root")[0]
        node.save((SaveJob("a", (key,), (3, 4)),))
        assert node.settle()
        client = LookupClient(node.endpoint)
        try:  # rank 0 hears of it a moment after the report went out
            deadline = time.monotonic() + 10
            while client.prefix_tiers([key]) != ["cpu"] and time.monotonic() < deadline:
                time.sleep(0.01)
            assert client.prefix_tiers([key]) == ["cpu"]  # every rank (one) holds it
        finally:
            client.close()
        want = kv[:, 3:5].clone()
        node.start_loads((LoadJob("b", (key,), 0, (10, 11)),))
        assert finished(node) == {"b"} and node.failed_blocks() == set()
        assert torch.equal(kv[:, 10:12], want)
    finally:
        node.close()
    assert node.store is None and node.group_transfers == []


def test_a_save_that_finds_its_chunk_stored_sends_no_report_unless_one_was_dropped(tmp_path):
    """A local prefix hit's prompt is saved again when it is scheduled; its chunks are stored
    already and rank 0 knows them: reporting them again cost a 32k local hit 5 ms (the reporter's
    thread and the index, beside the engine's). After a dropped report they are reported again."""
    kv = torch.randn(2, NUM_BLOCKS, 2, BLOCK, 8)
    layout = build_layout({f"layer.{i}": kv[i] for i in range(2)}, BLOCK, NUM_BLOCKS, model="tiny")
    node = WorkerNode(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), [layout], (CHUNK // BLOCK,), rank=0,
                      world_size=1, endpoint=f"ipc://{tmp_path}/l.sock", produce=False, engine="a test")
    try:
        key = chunk_keys(list(range(CHUNK)), CHUNK, b"root")[0]
        node.save((SaveJob("a", (key,), (3, 4)),))
        assert node.settle() and node.reporter.flush()
        sent = node.reporter.sent_reports
        node.save((SaveJob("b", (key,), (5, 6)),))  # the same chunk, found stored
        assert node.reporter.flush() and node.reporter.sent_reports == sent
        assert node.transfers.stats.skipped_saves == 1
        node.reporter.dropped_reports = 1  # as after a full queue towards rank 0
        node.save((SaveJob("c", (key,), (7, 8)),))
        assert node.reporter.flush() and node.reporter.sent_reports == sent + 1
    finally:
        node.close()


def test_a_node_needs_a_blocks_per_chunk_figure_per_layout(tmp_path):
    kv = torch.zeros(NUM_BLOCKS, 2, BLOCK, 8)
    layout = build_layout({"layer.0": kv}, BLOCK, NUM_BLOCKS)
    with pytest.raises(ValueError, match="1 layouts, 2 figures"):
        WorkerNode(KvtierConfig(chunk_tokens=CHUNK), [layout], (2, 1), rank=0, world_size=1,
                   endpoint=f"ipc://{tmp_path}/l.sock")


def test_a_node_whose_start_fails_stops_what_it_started(tmp_path):
    """A failure half-way (here: the engine's listener) closes the parts already running: the
    lookup port is free again for the next node, which starts."""
    kv = torch.zeros(NUM_BLOCKS, 2, BLOCK, 8)
    layout = build_layout({"layer.0": kv}, BLOCK, NUM_BLOCKS)
    with socket.socket() as probe:  # TCP: a port still bound refuses a second bind (an IPC path does not)
        probe.bind(("127.0.0.1", 0))
        endpoint = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    config = KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 22)

    def listen(store):
        raise RuntimeError("the engine's listener failed")

    with pytest.raises(RuntimeError, match="listener failed"):
        WorkerNode(config, [layout], (CHUNK // BLOCK,), rank=0, world_size=1, endpoint=endpoint, produce=False,
                   listen=listen)
    # ZMQ closes a socket on its I/O thread: the port is free a moment after close() returns, not at once.
    deadline = time.monotonic() + 5
    while True:
        try:
            node = WorkerNode(config, [layout], (CHUNK // BLOCK,), rank=0, world_size=1, endpoint=endpoint,
                              produce=False)
            break
        except zmq.ZMQError as exc:
            assert exc.errno == zmq.EADDRINUSE and time.monotonic() < deadline, exc  # never freed: a leak
            time.sleep(0.05)
    node.close()


def test_a_node_with_a_disk_tier_measures_it_and_the_first_lookup_carries_its_figure(tmp_path, caplog):
    kv = torch.randn(2, NUM_BLOCKS, 2, BLOCK, 8)
    layout = build_layout({f"layer.{i}": kv[i] for i in range(2)}, BLOCK, NUM_BLOCKS, model="tiny")
    config = KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24, disk_path=str(tmp_path / "disk"), disk_bytes=1 << 24)
    with caplog.at_level("INFO", logger="kvtier.worker_node"):
        node = WorkerNode(config, [layout], (CHUNK // BLOCK,), rank=0, world_size=1,
                          endpoint=f"ipc://{tmp_path}/l.sock", produce=False, engine="a test")
    try:
        client = LookupClient(node.endpoint)
        try:  # before any load: the disk's figure is its measured read speed, offered as such
            reply = client.lookup([chunk_keys(list(range(CHUNK)), CHUNK, b"root")[0]])
            assert reply.chunk_load_ms["disk"] > 0 and reply.probed == ["disk"]
        finally:
            client.close()
        assert list((tmp_path / "disk").iterdir()) == []  # the scratch file is gone
    finally:
        node.close()
    assert "disk reads" in caplog.text and "GB/s" in caplog.text


def restarted_on_disk(tmp_path, disk: str) -> tuple[WorkerNode, list[bytes]]:
    """A node restarted on ``disk`` after another wrote two chunks there: they are on disk only;
    the node and the chunks' chain keys."""
    kv = torch.randn(2, NUM_BLOCKS, 2, BLOCK, 8)
    layout = build_layout({f"layer.{i}": kv[i] for i in range(2)}, BLOCK, NUM_BLOCKS, model="tiny")
    config = KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24, disk_path=disk)
    keys = chunk_keys(list(range(2 * CHUNK)), CHUNK, b"root")

    def start(name):
        return WorkerNode(config, [layout], (CHUNK // BLOCK,), rank=0, world_size=1,
                          endpoint=f"ipc://{tmp_path}/{name}.sock", produce=False, engine="a test")

    node = start("first")
    try:
        node.save((SaveJob("a", tuple(keys), (3, 4, 5, 6)),))
        assert node.settle()
    finally:
        node.close()
    return start("second"), keys


def test_a_disk_chunk_named_for_promotion_ends_up_in_the_cpu_tier(tmp_path):
    """A plan that leaves disk chunks to recompute names them; the node reads them into CPU in
    the background, so the prompt's next sight is a CPU hit."""
    from kvtier.storage import Tier

    node, keys = restarted_on_disk(tmp_path, str(tmp_path / "disk"))  # a fresh CPU tier: the chunks are on disk only
    try:
        skeys = [node.transfers.skey(k) for k in keys]
        assert [node.store.contains(k) for k in skeys] == [Tier.DISK, Tier.DISK]
        node.start_loads((), promotes=(keys[1],))
        assert node.promoter.wait_idle(10)
        assert [node.store.contains(k) for k in skeys] == [Tier.DISK, Tier.CPU]
        assert node.promoter.promoted == 1
    finally:
        node.close()


@pytest.mark.parametrize("medium", ["tmpfs", "disk"])
def test_promotions_read_beside_loads_only_where_the_disk_has_room_for_both(tmp_path, medium):
    """Behind a tmpfs a burst's loads run back to back: promotions read beside them. Behind a disk
    they wait for the loads (a load stands running here for the whole test)."""
    import shutil
    import tempfile

    from kvtier.storage import Tier
    from kvtier.storage._direct import memory_backed

    if medium == "tmpfs" and not (os.path.isdir("/dev/shm") and memory_backed("/dev/shm")):
        pytest.skip("no tmpfs at /dev/shm")
    if medium == "disk" and memory_backed(str(tmp_path)):
        pytest.skip("the test directory is on a tmpfs here")
    disk = tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-test-") if medium == "tmpfs" else str(tmp_path / "disk")
    try:
        node, keys = restarted_on_disk(tmp_path, disk)
        try:
            node.transfers.loads.running = lambda: 1
            node.start_loads((), promotes=(keys[1],))
            promoted = node.promoter.wait_idle(10 if medium == "tmpfs" else 0.5)
            assert promoted is (medium == "tmpfs")
            assert node.store.contains(node.transfers.skey(keys[1])) is (Tier.CPU if promoted else Tier.DISK)
            node.transfers.loads.running = lambda: 0
        finally:
            node.close()
    finally:
        if medium == "tmpfs":
            shutil.rmtree(disk, ignore_errors=True)


@pytest.mark.parametrize("latent", [True, False], ids=["mla", "heads"])
def test_rank_0_of_a_tp_engine_says_its_cpu_tier_keeps_mla_on_every_rank(tmp_path, caplog, latent):
    """MLA's KV (no head dim) is one piece for every rank; its CPU tier is still one per rank, said at start."""
    kv = torch.randn(2, NUM_BLOCKS, BLOCK, 24) if latent else torch.randn(2, NUM_BLOCKS, 2, BLOCK, 2, 8)
    layout = build_layout({f"layer.{i}": kv[i] for i in range(2)}, BLOCK, NUM_BLOCKS, model="tiny", tp_rank=0,
                          tp_size=2, kv_heads=0 if latent else 2, total_kv_heads=0 if latent else 4)
    assert layout.shard is not None and layout.shard.replicated == latent
    caplog.set_level(logging.INFO, logger="kvtier.worker_node")
    node = WorkerNode(KvtierConfig(chunk_tokens=CHUNK, cpu_bytes=1 << 24), [layout], (CHUNK // BLOCK,), rank=0,
                      world_size=2, endpoint=f"ipc://{tmp_path}/l.sock", produce=False, engine="a test")
    node.close()
    said = "the CPU tier one in each of the 2 ranks, 16777216 bytes each" in caplog.text
    assert said == latent
