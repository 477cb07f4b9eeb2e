"""Mamba state that a prefill checkpoint writes inside a step (vLLM >= 0.32's Mamba2 layers:
Granite-4, Nemotron-H), through vLLM's real scheduler.

Such a model's Mamba layers store the state at the prompt's last block boundary in the same
forward that runs on past it, so no step ends there and a rule that saves a state only where a
step ended finds none: on vLLM 0.33 (H200) kvtier saved no Mamba state at all for these models.
vLLM names the states a step writes (``kv_connector_block_state.boundary_state_offloads``), and
kvtier saves those at chunk ends.
"""

from __future__ import annotations

import pytest
import torch

from test_hybrid import BS, CHUNK, _Engine, full, hybrid_config  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec

from kvtier.engines.vllm import connector as connector_module
from kvtier.engines.vllm.groups import NULL_BLOCK
from kvtier.keys import group_key

pytestmark = pytest.mark.skipif("num_prefill_checkpoint_blocks" not in MambaSpec.__dataclass_fields__,
                                reason="this vLLM has no Mamba prefill checkpoints")


def checkpointed() -> MambaSpec:
    """Mamba state in align mode with one prefill checkpoint block (what vLLM's MambaMixer2 asks for)."""
    return MambaSpec(block_size=BS, shapes=((4,), (4,)), dtypes=(torch.float32, torch.float32),
                     mamba_cache_mode="align", num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1)


def test_the_state_a_checkpoint_writes_inside_a_step_is_saved_and_reloaded(monkeypatch):
    """197 tokens, 128 a step: the first step ends at 128 (chunk 1's end: its state saved as the
    step ends there), the second runs on to 197 and writes the state at 192 (chunk 2's end) on
    its way, which vLLM names: kvtier saves it from the block vLLM names, and a reload after the
    engine forgot the prompt loads it with the hit's last chunk."""
    named, offered = [], connector_module.boundary_states
    monkeypatch.setattr(connector_module, "boundary_states", lambda out: named.append(offered(out)) or named[-1])
    engine = _Engine(hybrid_config(full(), checkpointed()), mamba_mode="align")
    try:
        assert engine.sched.connector.active
        prompt, keys = engine.prompt(21)
        first, saves, steps = engine.add(prompt), [], []
        while not first.is_finished():
            steps.append(engine.step())
            saves += steps[-1].kv_connector_metadata.plan.saves
        assert [sum(out.num_scheduled_tokens.values()) for out in steps[:2]] == [128, 69]  # no step ends at 192
        at_192 = [e for states in named for e in states.get(first.request_id, ()) if e[2] == 3 * CHUNK]
        assert at_192, "vLLM named no state at 192: the test no longer covers a checkpoint"
        states = [job for job in saves if job.group == 1]
        assert [job.keys for job in states] == [(group_key(keys[1], 1),), (group_key(keys[2], 1),)]
        assert states[1].block_ids == (at_192[0][1],)
        request, out = engine.reload(saves, prompt)
        state_job = max(out.kv_connector_metadata.plan.loads, key=lambda j: j.group)
        mamba_ids = engine.sched.kv_cache_manager.get_block_ids(request.request_id)[1]
        assert state_job.keys == (group_key(keys[2], 1),) and state_job.block_ids == (mamba_ids[11],)
        assert mamba_ids[11] != NULL_BLOCK
    finally:
        engine.sched.shutdown()
