import subprocess
import sys

from hypothesis import given, strategies as st

from kvtier.keys import chunk_keys, namespace, storage_key

ROOT = namespace("m")


@given(st.lists(st.integers(0, 2**31), max_size=100), st.sampled_from([4, 8, 16]))
def test_one_key_per_full_chunk_and_prefix_stable(tokens, chunk):
    keys = chunk_keys(tokens, chunk, ROOT)
    assert len(keys) == len(tokens) // chunk
    assert chunk_keys(tokens + [7] * chunk, chunk, ROOT)[: len(keys)] == keys


def test_a_changed_token_changes_its_chunk_and_every_later_key():
    tokens = list(range(64))
    keys = chunk_keys(tokens, 16, ROOT)
    tokens[20] += 1
    other = chunk_keys(tokens, 16, ROOT)
    assert other[0] == keys[0] and all(a != b for a, b in zip(keys[1:], other[1:]))


def test_namespace_separates_models_salts_and_layouts():
    tokens = list(range(32))
    base = chunk_keys(tokens, 16, namespace("m"))
    assert chunk_keys(tokens, 16, namespace("m2")) != base
    assert chunk_keys(tokens, 16, namespace("m", "salt")) != base
    assert storage_key(base[0], b"a" * 16) != storage_key(base[0], b"b" * 16)


def test_keys_identical_across_processes_and_hash_seeds():
    code = "from kvtier.keys import *; print(chunk_keys(list(range(1000)), 256, namespace('m', 's'))[-1].hex())"
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout
        for seed in ("0", "1", "12345")
    }
    assert len(outs) == 1 and outs.pop().strip() == chunk_keys(list(range(1000)), 256, namespace("m", "s"))[-1].hex()
