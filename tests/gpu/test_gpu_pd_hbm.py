"""P/D HBM to HBM between two real CUDA vLLM engines: P on GPU 0, D on GPU 1 where there are two
(NVLink: UCX's cuda_ipc), else both on GPU 0. Each engine is a process of its own
(``kvtier.bench.pd_child``) with its own ``CUDA_VISIBLE_DEVICES``.

Runs only on a CUDA vLLM (skipped at collection elsewhere); ``python -m pytest -q -m gpu tests/gpu``.

Prompts are ``4 * CHUNK + 1`` tokens: D loads the 4 whole chunks and computes the last token, and
its answer is compared bit for bit with P's answer to the same prompt again (P's own prefix hit
on the same KV bytes). Cases:

* pull while P's lease runs: D READs P's engine blocks into its own (its log says the chunks
  landed HBM to HBM) and answers exactly as P;
* the same again, once D knows P: D READs the blocks P's ``kv_transfer_params`` name before
  P's handshake reply (its log counts them), and answers exactly as P;
* pull after the lease ended (P's log says so; P keeps its blocks 300 ms here): D's early READ
  of the blocks named is not used, D gets the same chunks from P's CPU tier, no recompute, the
  same answer;
* push (both legs at once): D READs each chunk from P's blocks as P computes it, and (a D with
  ``pd_hbm_push: write``) P WRITEs each from its blocks into those D named; D's log counts them
  landed, and the READs it took; the same answer;
* a transfer P never published: D recomputes and still answers like P (negative control);
* every lease of P ends: none is left holding blocks when the test ends.

Both engines on one GPU: UCX has no ``cuda_ipc`` between them, and D's test READ at its first
handshake finds the path emulated before any chunk is asked for; every transfer then takes P's
CPU tier (D's log says so), and each answer is still P's. The HBM-only checks are skipped then.
"""

from __future__ import annotations

import re
import time
import uuid

import pytest

import gpu_engines as g

if (_reason := g.skip_reason()) is not None:
    pytest.skip(_reason, allow_module_level=True)

from test_gpu_pd import _as_output, _ask  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.e2e]

LENGTH = 4 * g.CHUNK + 1
LOADED = 4 * g.CHUNK
LEASE_MS = 300
LANDED = "land HBM to HBM"


def _devices() -> tuple[str, str]:
    import torch

    d = 1 if torch.cuda.device_count() >= 2 else 0
    return g.visible_devices(0), g.visible_devices(d)


def _spec(model: str, **kvtier) -> dict:
    return {"model": model, "connector": "kvtier", "load_format": "auto", "block_size": g.BLOCK,
            "max_model_len": g.MAX_MODEL_LEN, "gpu_memory_utilization": g.GPU_MEMORY_UTILIZATION,
            "kvtier": g.kvtier_config(pd_transport="nixl", **kvtier)}


def _log(engine) -> str:
    with open(engine.log_path, errors="replace") as f:
        return f.read()


def _wait_for_line(engine, pattern: str, timeout_s: float = 30.0, count: int = 1) -> list:
    """Wait until the engine's log has ``count`` lines matching ``pattern`` (what the engine reports;
    each TP rank logs its own); returns the matches (``re.findall``'s)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = re.findall(pattern, _log(engine))
        if len(found) >= count:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{engine.name} never logged {pattern!r} {count} time(s); its log ends:\n{engine.log_tail()}")


def test_pd_hbm_to_hbm_pull_lease_end_push_and_negative_control(gpu_model, tmp_path, monkeypatch):
    from kvtier.bench.pd_engine_proc import Engine

    for key, value in g.child_env(multiprocess=True).items():
        monkeypatch.setenv(key, value)
    p_dev, d_dev = _devices()
    engines = []
    try:
        p = Engine("P", _spec(gpu_model, pd_hbm_lease_ms=LEASE_MS), str(tmp_path),
                   env={"CUDA_VISIBLE_DEVICES": p_dev, "KVTIER_LOG_LEVEL": "DEBUG"})
        engines.append(p)
        d = Engine("D", _spec(gpu_model), str(tmp_path), env={"CUDA_VISIBLE_DEVICES": d_dev, "KVTIER_LOG_LEVEL": "DEBUG"})
        engines.append(d)

        # Pull while the lease runs: D asks at once, well inside 300 ms of P's finish.
        pulled = g.prompt(400, LENGTH)
        params = p.ask(pulled, {"do_remote_decode": True})["params"]
        assert params and params.get("kvtier_endpoints"), f"P published nothing: {params}"
        got = _ask(d, pulled, params)
        assert got["cached"] >= LOADED, f"HBM pull: D loaded {got['cached']} tokens, expected {LOADED}"
        judged = _wait_for_line(d, r"(a direct path|no direct GPU path)")  # D's test READ, before any fetch
        direct = judged[0] == "a direct path"
        assert direct == (p_dev != d_dev), f"two GPUs of one host are NVLinked, one GPU has no cuda_ipc: {judged}"
        assert (LANDED in _log(d)) == direct, f"D's chunks landed HBM to HBM: {not direct}; D's log ends:\n{d.log_tail()}"
        g.assert_strict(_as_output(got), _as_output(_ask(p, pulled)), "HBM pull vs P's own KV")

        # Again, now that D knows P: it READs the blocks P's params name before P's reply comes.
        again = g.prompt(405, LENGTH)  # (403 is the never-published prompt below)
        params = p.ask(again, {"do_remote_decode": True})["params"]
        assert params.get("remote_block_ids"), f"P lent its blocks but did not name them: {params}"
        got = _ask(d, again, params)
        if direct:
            early = _wait_for_line(d, r"landed by \d+ READs; [^\n]*; (\d+) READ before P's reply", count=2)
            assert int(early[-1]) >= 4, f"D READ {early[-1]} chunks before P's reply, expected the 4 it loads"
        g.assert_strict(_as_output(got), _as_output(_ask(p, again)), "early-READ pull vs P's own KV")

        # Pull after the lease: P says the lease ended unread, then D asks. Told nothing of when the
        # lease ends (no kvtier_lent_until), D READs the blocks named before P's reply, which says
        # they are not lent: that READ goes unused and D takes P's CPU tier instead.
        late = g.prompt(401, LENGTH)
        params = p.ask(late, {"do_remote_decode": True})["params"]
        _wait_for_line(p, rf"lease of transfer {re.escape(params['remote_request_id'])} ended: expired unread")
        early_reads = len(re.findall(r"blocks READ from \S+ before its reply", _log(d)))
        params = {k: v for k, v in params.items() if k != "kvtier_lent_until"}
        got = _ask(d, late, params)
        if direct:
            _wait_for_line(d, r"blocks READ from \S+ before its reply", count=early_reads + 1)
        assert got["cached"] >= LOADED, f"after the lease: D loaded {got['cached']} tokens (a recompute?)"
        g.assert_strict(_as_output(got), _as_output(_ask(p, late)), "pull after the lease vs P's own KV")

        # Push: both legs at once under one transfer id; D READs P's blocks as P computes them
        # (pd_hbm_push "read"), then a D of its own has P WRITE them into its blocks ("write").
        for seed, push in ((402, "read"), (404, "write")):
            if push == "write":
                d.stop()
                engines.remove(d)
                d = Engine("D-write", _spec(gpu_model, pd_hbm_push="write"), str(tmp_path),
                           env={"CUDA_VISIBLE_DEVICES": d_dev, "KVTIER_LOG_LEVEL": "DEBUG"})
                engines.append(d)
            pushed, transfer_id = g.prompt(seed, LENGTH), uuid.uuid4().hex
            d.send(pushed, {"do_remote_prefill": True, "transfer_id": transfer_id, "tp_size": 1,
                            "kvtier_endpoints": params["kvtier_endpoints"]}, max_tokens=16, logprobs=g.TOP_LOGPROBS)
            p.send(pushed, {"do_remote_decode": True, "transfer_id": transfer_id})
            got, _ = d.receive(), p.receive()
            assert got["cached"] >= LOADED, f"{push} push: D loaded {got['cached']} tokens, expected {LOADED}"
            if direct:
                landed = _wait_for_line(d, rf"transfer {transfer_id} from \S+: 5 chunks landed by (\d+) READs")
                assert (landed[0] == "0") == (push == "write"), f"{push} push: {landed[0]} READs by D"  # 4 and the tail
            g.assert_strict(_as_output(got), _as_output(_ask(p, pushed)), f"{push} push vs P's own KV")

        # Negative control: a transfer P never published. D recomputes; the answer is still P's.
        unknown = g.prompt(403, LENGTH)
        got = _ask(d, unknown, {**params, "remote_request_id": "never-published"})
        assert got["cached"] < g.CHUNK, f"D loaded {got['cached']} tokens of a transfer never published"
        g.assert_close(_as_output(got), _as_output(_ask(p, unknown)), "recompute vs P")

        # Every lease P began has ended (released by D, or expired): no engine block stays held.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            log = _log(p)
            began, ended = log.count("began: "), len(re.findall(r"lease of transfer \S+ ended", log))
            if began == ended:
                break
            time.sleep(0.05)
        assert began >= 2 and began == ended, f"P began {began} leases and ended {ended}"
    finally:
        for e in engines:
            e.stop()
