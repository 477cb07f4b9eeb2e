import subprocess
import sys
import threading
import time

import blake3
import numpy as np
from hypothesis import given, strategies as st

from kvtier.keys import chunk_keys, namespace, storage_key, tail_key

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


def test_keys_are_a_stored_format_and_do_not_change():
    """Chunk files on disk and in a shared tier are found again by these keys: the same tokens
    must give the same keys in every release (int64 little-endian token ids, chained blake3)."""
    root = namespace("golden-model", "salt")
    tokens = list(range(1000, 1600)) + [-5, 2**40]  # two chunks of 256 and a tail of 90
    keys = chunk_keys(tokens, 256, root)
    assert root.hex() == "f14ec0364cd9f781e7a22b5519185469"
    assert [k.hex() for k in keys] == ["f99e7e56d997cd9094905e55f84b729f", "501de8bbc42c885c3b2b388042f82c8a"]
    assert tail_key(tokens, 256, root, keys).hex() == "a226cf3937898d6c2fd4510d006de519"


def test_a_tail_of_almost_a_chunk_keeps_its_key():
    tokens = list(range(256 + 255))  # a tail of 255 tokens: 2,040 bytes, 2,060 hashed with its prefix
    root = namespace("m")
    keys = chunk_keys(tokens, 256, root)
    tail = np.asarray(tokens[256:], dtype="<i8").tobytes()
    assert tail_key(tokens, 256, root, keys) == blake3.blake3(keys[-1] + b"tail" + tail).digest(16)


def test_making_keys_never_lets_go_of_the_interpreter():
    """A thread running Python gets no turn while the engine's thread makes a prompt's keys: had a
    hash let go of the interpreter, the engine's thread would wait for it back after every chunk."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(0.2)  # the other thread may only run where the key making lets go
    spins, stop = [0], threading.Event()

    def spin():
        while not stop.is_set():
            spins[0] += 1

    thread = threading.Thread(target=spin, daemon=True)
    try:
        thread.start()
        time.sleep(0.01)  # it runs; this thread takes the interpreter back at the next forced switch
        before = spins[0]
        keys = chunk_keys(list(range(64 * 256)), 256, namespace("m"))
        during = spins[0] - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    assert len(keys) == 64 and during == 0
