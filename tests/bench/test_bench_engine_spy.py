"""``python -m kvtier.bench.engine_spy``: a py-spy raw record's engine loop and connector hooks,
from hand-written stacks in py-spy's raw format (``frame;frame;... count``)."""

from __future__ import annotations

import json

from kvtier.bench.engine_spy import main, summarize

PROC = 'process 7:"VLLM::EngineCore"'
LOOP = "run_busy_loop (vllm/v1/engine/core.py:1629);step_with_batch_queue (vllm/v1/engine/core.py:737)"
RECORD = [
    f"{PROC};thread (7): MainThread;{LOOP};execute_model (vllm/v1/executor/uniproc_executor.py:122) 40",
    f"{PROC};thread (7): MainThread;{LOOP};_start_load_kv (vllm/v1/worker/gpu/kv_connector.py:127);"
    "run (kvtier/profiled.py:22);start_load_kv (kvtier/engines/vllm/connector.py:178);"
    "start_loads (kvtier/engines/vllm/worker_side.py:138) 5",
    f"{PROC};thread (7): MainThread;{LOOP};post_forward (vllm/v1/worker/gpu/kv_connector.py:147);"
    "wait_for_save (kvtier/engines/vllm/connector.py:194) 3",
    # a connector frame outside the engine loop (start-up) is no hook's
    f"{PROC};thread (7): MainThread;register_kv_caches (kvtier/engines/vllm/connector.py:163) 30",
    f"{PROC};thread (9): kvtier-save;_save_loop (kvtier/transfer/save.py:321) 12",
    f'process 8:"python";thread (8): MainThread;{LOOP};start_load_kv '
    "(vllm/distributed/kv_transfer/kv_connector/v1/offloading_connector.py:120) 7",
    "not a sample line",
    "",
]


def test_loop_samples_and_hooks_are_counted_per_connector():
    s = summarize(RECORD)
    assert s.samples == 40 + 5 + 3 + 30 + 12 + 7
    assert s.loop == 40 + 5 + 3 + 7  # not start-up, not the save thread
    assert s.hooks["kvtier"] == {"start_load_kv": 5, "wait_for_save": 3}
    assert s.hooks["OffloadingConnector"] == {"start_load_kv": 7}
    assert s.hook_samples() == {"kvtier": 8, "OffloadingConnector": 7}
    assert s.threads["kvtier-save"] == 12 and s.threads["MainThread"] == 40 + 5 + 3 + 30 + 7


def test_the_command_prints_the_shares_and_writes_json(tmp_path, capsys):
    record = tmp_path / "chat.txt"
    record.write_text("\n".join(RECORD))
    assert main([str(record), "--json", str(tmp_path / "chat.json")]) == 0
    out = capsys.readouterr().out
    assert "engine loop 55" in out and "kvtier's hooks: 8 (14.5 % of the loop)" in out
    data = json.loads((tmp_path / "chat.json").read_text())[str(record)]
    assert data["loop"] == 55 and data["hooks"]["kvtier"]["start_load_kv"] == 5
