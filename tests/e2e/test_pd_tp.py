"""P/D with tensor parallelism on both sides: two real vLLM engines with ``tensor_parallel_size=2``
(four worker processes, one core per rank), each D rank fetching its shard from the same P rank.
The decode engine's answer must equal a colocated engine's, and it must have loaded the prompt.

Opt-in (``KVTIER_PD_TP=1``): on this 2-core box, with six busy processes on two cores, one rank's
transfer sometimes gets no answer within the timeout (the connection is established, the
producer's reply never arrives); the consumer then recomputes, with identical output, and the
assertion that the prompt was loaded fails. Not understood yet (what is known: the README's P/D
section, "Known limits").
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_engines import prompt, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("KVTIER_PD_TP") != "1",
                                                   reason="opt-in: KVTIER_PD_TP=1 (see the module docstring)")]

HERE = Path(__file__).parent
CHUNK = 64
PROMPT = prompt(21, 5 * CHUNK + 30)


class Engine:
    """An engine process that stays up (``pd_engine.py``); ``ask`` sends one request, waits for its answer."""

    def __init__(self, spec: dict, tmp: Path, name: str):
        (tmp / f"{name}.json").write_text(json.dumps(spec))
        self.log = tmp / f"{name}.log"
        self.printed: list[str] = []
        self.proc = subprocess.Popen([sys.executable, str(HERE / "pd_engine.py"), str(tmp / f"{name}.json")],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(self.log, "wb"),
                                     text=True, start_new_session=True,
                                     env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            self.printed.append(line)  # kvtier's own log lines come out here
        raise AssertionError(f"engine exited:\n{self.log.read_text(errors='replace')[-4000:]}")

    def ask(self, prompt_ids: list[int], max_tokens: int, params: dict | None = None) -> dict:
        self.proc.stdin.write(json.dumps({"prompt": prompt_ids, "max_tokens": max_tokens, "params": params}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("OUT "))

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def test_tp2_producer_to_tp2_consumer_is_token_identical(tiny_llama, tmp_path):
    base, _ = run_engine({"model": tiny_llama, "kvtier": None, "max_tokens": 12, "rounds": [{"prompts": [PROMPT]}]},
                         tmp_path, "base")
    kvtier = {"chunk_tokens": CHUNK, "cpu_bytes": 64 << 20, "pd_timeout_ms": 5000}
    engines = []
    try:
        p = Engine({"model": tiny_llama, "tp": 2, "kvtier": kvtier}, tmp_path, "p")
        engines.append(p)
        d = Engine({"model": tiny_llama, "tp": 2, "kvtier": kvtier, "role": "kv_consumer"}, tmp_path, "d")
        engines.append(d)
        published = p.ask(PROMPT, 1, {"do_remote_decode": True})["params"]
        assert published["tp_size"] == 2 and len(published["kvtier_endpoints"]) == 2
        published.pop("remote_prefill_cached_tokens", None)  # else vLLM reports P's count as D's
        out = d.ask(PROMPT, 12, published)
        assert out["tokens"] == base[0][0]["tokens"]
        assert out["cached"] >= len(PROMPT) - 1, "".join(d.printed)  # both ranks loaded their shards of the whole prompt
        assert "recomputing" not in "".join(d.printed)
    finally:
        for engine in engines:
            engine.stop()
