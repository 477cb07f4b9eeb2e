"""The commit protocol with TP=2: kvtier's worker half in two real processes, each with its own
KV memory and real LMCache store (and disk files), rank 0 serving lookups over a real IPC socket.

The real-vLLM TP=2 run is in tests/e2e/test_tiers_hetero_tp.py; here faults are injected per rank, which
vLLM offers no way to do.
"""

from __future__ import annotations

import multiprocessing
import time
import uuid
from pathlib import Path

import pytest

from kvtier.keys import chunk_keys, namespace
from kvtier.lookup import LookupClient

from rank_proc import BLOCK, CHUNK_BLOCKS, rank_main

CHUNK_TOKENS = BLOCK * CHUNK_BLOCKS
POOL_CHUNK = 12288  # one chunk in the CPU pool: 64 B header + 2 blocks of 4 KiB, 4 KiB-aligned


class Group:
    """Two rank processes and a scheduler-side lookup client."""

    def __init__(self, tmp_path, configs: list[dict], endpoint: str | None = None):
        ctx = multiprocessing.get_context("spawn")
        self.endpoint = endpoint or f"ipc://{tmp_path}/lookup-{uuid.uuid4().hex[:8]}.sock"
        self.conns, self.procs = [], []
        for rank, config in enumerate(configs):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=rank_main, args=(child, rank, len(configs), self.endpoint, config), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        for conn in self.conns:
            assert conn.poll(120), "a rank did not start"
            assert conn.recv() == "ready"
        self.client = LookupClient(self.endpoint, 2000)
        self._barriers = 0

    def ask(self, rank: int, *cmd):
        self.conns[rank].send(cmd)
        assert self.conns[rank].poll(60), f"rank {rank} did not answer {cmd[0]}"
        return self.conns[rank].recv()

    def all(self, *cmd):
        for conn in self.conns:
            conn.send(cmd)
        return [conn.recv() if conn.poll(60) else pytest.fail(f"no answer to {cmd[0]}") for conn in self.conns]

    def save(self, keys, first_block):
        return self.all("save", keys, list(range(first_block, first_block + len(keys) * CHUNK_BLOCKS)))

    def barrier(self):
        """Save a fresh chunk on every rank and wait until it is visible: every report the ranks
        sent before it has then been applied (rank 0's server reads each peer in order)."""
        self._barriers += 1
        marker = prompt_keys(1, seed=1000 + self._barriers)
        self.save(marker, first_block=62)
        self.wait_for(marker, ["cpu"])

    def wait_for(self, keys, expected, timeout=5.0):
        deadline = time.monotonic() + timeout
        while (got := self.client.prefix_tiers(keys)) != expected:
            assert time.monotonic() < deadline, f"lookup {got} never became {expected}"
            time.sleep(0.01)

    def close(self):
        self.client.close()
        for rank in range(len(self.conns)):
            if self.procs[rank].is_alive():
                self.ask(rank, "close")
        for proc in self.procs:
            proc.join(30)
            assert proc.exitcode == 0


def prompt_keys(chunks: int, seed: int = 0) -> list[bytes]:
    import random

    rng = random.Random(seed)
    return chunk_keys([rng.randrange(3, 500) for _ in range(chunks * CHUNK_TOKENS)], CHUNK_TOKENS, namespace("tiny"))


@pytest.fixture
def group(tmp_path):
    groups: list[Group] = []

    def start(configs, endpoint=None):
        g = Group(tmp_path, configs, endpoint)
        groups.append(g)
        return g

    yield start
    for g in groups:
        g.close()


def test_commit_and_eviction_across_two_rank_processes(group):
    # Rank 1's CPU tier holds 8 chunks, so it evicts first.
    small = {"chunk_tokens": CHUNK_TOKENS, "cpu_bytes": 8 * POOL_CHUNK, "save_backlog_bytes": 8 * POOL_CHUNK}
    g = group([{"chunk_tokens": CHUNK_TOKENS, "cpu_bytes": 64 * POOL_CHUNK}, small])
    keys = prompt_keys(12)

    # Saved on both ranks: visible, and loads give back each rank's own bytes.
    g.save(keys[:2], first_block=0)
    g.wait_for(keys, ["cpu", "cpu"])
    for failed, same in g.all("load", keys[:2], list(range(40, 44)), list(range(0, 4))):
        assert failed == [] and same

    # A save that fails on rank 1 is never visible, though rank 0 stored it.
    g.ask(1, "fail_saves")
    g.save(keys[2:4], first_block=4)
    g.ask(1, "heal_saves")
    g.barrier()
    assert g.client.prefix_tiers(keys) == ["cpu", "cpu"]
    assert g.ask(0, "holds", keys[2:4]) == ["cpu", "cpu"] and g.ask(1, "holds", keys[2:4]) == [None, None]

    # Rank 1 evicts its oldest chunks (LRU) to make room: withdrawn for every rank at once,
    # although rank 0 still holds them, so no lookup promises what rank 1 lost.
    g.save(keys[2:8], first_block=4)
    g.barrier()
    assert g.ask(1, "holds", keys[:2]) == [None, None]
    assert g.ask(0, "holds", keys[:2]) == ["cpu", "cpu"]
    assert g.client.prefix_tiers(keys) == []

    # Saved again: rank 0 skips the copy but re-confirms, rank 1 stores it: visible again.
    g.save(keys[:2], first_block=0)
    g.wait_for(keys[:2], ["cpu", "cpu"])
    stats = g.all("stats")
    assert stats[0]["hit_tokens_cpu"] == 2 * CHUNK_TOKENS and stats[1]["hit_tokens_cpu"] == 0  # counted once
    assert all(s["loaded_bytes"] > 0 and s["saved_bytes"] > 0 for s in stats)


def test_restart_rebuilds_the_index_from_every_ranks_files_and_drops_a_corrupt_one(group, tmp_path):
    configs = [{"chunk_tokens": CHUNK_TOKENS, "cpu_bytes": 64 * POOL_CHUNK, "disk_path": str(tmp_path / "disk"),
                "disk_bytes": 64 * POOL_CHUNK}] * 2
    keys = prompt_keys(4, seed=7)
    g = group(configs)
    g.save(keys, first_block=0)
    g.wait_for(keys, ["cpu"] * 4)
    files = [g.ask(1, "file_of", k) for k in keys]  # written on LMCache's own thread: waited for
    assert None not in files, f"rank 1 never wrote some chunks to disk: {files}"
    endpoint, victim = g.endpoint, Path(files[2])  # rank 1's third chunk
    g.close()

    assert len(list((tmp_path / "disk" / "rank1").glob("*.kv"))) == 4
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))

    g = group(configs, endpoint)  # a restarted engine: new processes, same files
    g.wait_for(keys, ["disk"] * 4)  # the index came back from both ranks' files
    results = g.all("load", keys, list(range(40, 48)), list(range(0, 8)))
    assert results[0] == ([], True)
    assert results[1][0] == [44, 45, 46, 47] and results[1][1]  # rank 1 caught the flipped byte
    g.wait_for(keys, ["cpu", "cpu"])  # promoted; the corrupt chunk withdrawn and its file removed
    assert not victim.exists()
