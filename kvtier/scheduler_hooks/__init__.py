"""Scheduler policy, engine-agnostic and pure: load plans, their cost model, per-request states.

:mod:`.plan` decides per prompt (none, load, partial, handoff, remote); :mod:`.cost` predicts a
load against recompute from measured step and load times; :mod:`.states` is the one lifecycle
every KV source goes through. The vLLM adapter (``kvtier.engines.vllm``) drives them.
"""

from kvtier.scheduler_hooks.cost import CostMeter, CostModel, LinearCost
from kvtier.scheduler_hooks.plan import Geometry, LoadPlan, PlanInput, PlanKind, Policy, Skip, may_load, plan_load, tier_tokens
from kvtier.scheduler_hooks.states import Event, IllegalTransition, ReqState, advance

__all__ = [
    "CostMeter", "CostModel", "Event", "Geometry", "IllegalTransition", "LinearCost", "LoadPlan",
    "PlanInput", "PlanKind", "Policy", "ReqState", "Skip", "advance", "may_load", "plan_load", "tier_tokens",
]
