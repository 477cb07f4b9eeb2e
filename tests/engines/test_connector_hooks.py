"""When vLLM's model runner calls the connector's worker hooks, and what kvtier does in each:
driven by the installed vLLM's own ``KVConnectorModelRunnerMixin`` (its order of calls around the
forward), with a recorder standing in for kvtier's worker half (no KV memory is needed to see
the order)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from sched_setup import vllm_config  # noqa: E402  (first: quiets vLLM)

import torch  # noqa: E402
from vllm.distributed.kv_transfer import kv_transfer_state  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.worker import kv_connector_model_runner_mixin as runner_mixin  # noqa: E402
from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin  # noqa: E402

from kvtier.engines.vllm.compat import KVConnectorTransferResults  # noqa: E402
from kvtier.engines.vllm.connector import KvtierConnector, KvtierMetadata  # noqa: E402
from kvtier.jobs import StepPlan  # noqa: E402


class Recorder:
    """Stands in for the worker half: records the calls the connector makes, in order."""

    def __init__(self, failed: set[str] = frozenset()):
        self.calls: list[str] = []
        self.failed = set(failed)
    def __getattr__(self, name):
        def record(*args, **kwargs):
            self.calls.append(name)
            if name == "take_failed_loads":
                failed, self.failed = self.failed, set()
                return failed
            return {"finished_sends": set(), "finished_loads": set(self.failed), "failed_blocks": set(),
                    "take_events": ([], False)}.get(name)
        return record


@pytest.fixture
def connector(monkeypatch):
    config = vllm_config(16, 64, "auto", None, 4, 128, True)
    kv_cache_config = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layers.0.attn"], FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=16, dtype=torch.float32))])
    conn = KvtierConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", conn)
    monkeypatch.setattr(runner_mixin, "get_forward_context", lambda: None)  # no model: kvtier never reads it
    yield conn
    conn._worker = None
    conn.shutdown()


def step(connector, recorder: Recorder, has_sync_kv_loads: bool = False, idle: bool = False):
    """One step through vLLM's own connector context (``idle``: one that computes nothing);
    returns the calls made before the forward (the context's body) and the step's connector output."""
    connector._worker = recorder
    plan = StepPlan(loads=(), saves=(), allocated=(3, 4))
    meta = KvtierMetadata(plan, idle=idle)
    out = type("SchedulerOutput", (), {"kv_connector_metadata": meta, "finished_req_ids": set(),
                                       "has_sync_kv_loads": has_sync_kv_loads})()
    with KVConnectorModelRunnerMixin._get_kv_connector_output(out) as output:
        before_forward = list(recorder.calls)  # the forward is launched here
    return before_forward, output


def test_blocks_given_out_wait_for_saves_before_the_forward_is_launched(connector):
    before_forward, _ = step(connector, Recorder())
    assert "guard_reuse" in before_forward


def test_failed_whole_loads_go_to_vllm_as_failed_receives(connector):
    if KVConnectorTransferResults is None:
        pytest.skip("this vLLM has no KVConnectorTransferResults: failures travel in the stats (0.26)")
    _, output = step(connector, Recorder(failed={"r1"}))
    assert output.failed_recving == {"r1"} and "r1" in output.finished_recving
    assert connector.get_kv_connector_stats() is None or "failed_requests" not in connector.get_kv_connector_stats().data


def test_a_step_without_saves_and_an_unbound_wait_for_save_do_nothing(connector):
    recorder = Recorder()
    step(connector, recorder)
    assert "save" not in recorder.calls  # an empty step: vLLM >= 0.32 still calls wait_for_save
    connector.clear_connector_metadata()
    connector.wait_for_save()  # called with nothing bound: no error, no work
    assert "save" not in recorder.calls


def test_only_a_step_that_computes_nothing_waits_for_the_loads_before_taking_them(connector):
    """vLLM steps back to back while requests wait for their loads: such a step gives the load
    threads the interpreter (waits for one to end, at most a moment) instead of spinning."""
    recorder = Recorder()
    step(connector, recorder)
    assert "wait_idle" not in recorder.calls
    recorder = Recorder()
    step(connector, recorder, idle=True)
    assert recorder.calls.index("wait_idle") < recorder.calls.index("finished_loads")
