"""Which of the engine's KV cache groups kvtier serves.

With vLLM's hybrid KV cache manager a model's layers fall into several KV cache groups, each
with its own block table (and possibly block size): full attention, sliding window, chunked
local attention, Mamba state. kvtier's chunks hold one group's blocks, so it serves a config
only when it can serve every group that takes part in KV transfer: a prefix hit must be valid
for all of them, and a group kvtier cannot fill leaves the hit at 0 (the engine recomputes).

Today that is one full-attention group (MLA included). Groups vLLM marks as not transferred
(``enable_kv_transfer=False``, rebuilt by the engine after a load) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED_LOCAL = "chunked_local_attention"
MAMBA = "mamba"

# vLLM KV cache spec class name -> kind. Names, not classes: older releases lack some of them,
# and a subclass vLLM adds later (a window variant of full attention) must not pass for its base.
_KINDS = {
    "FullAttentionSpec": FULL,
    "MLAAttentionSpec": FULL,
    "SlidingWindowSpec": SLIDING,
    "SlidingWindowMLASpec": SLIDING,
    "ChunkedLocalAttentionSpec": CHUNKED_LOCAL,
    "MambaSpec": MAMBA,
}
SERVED_KINDS = frozenset({FULL})


def spec_kind(spec: Any) -> str:
    """The kind of one group's KV cache spec (its class name when kvtier has no name for it).

    A full-attention spec that carries a sliding window or attention chunk (vLLM's way of
    running such layers with the hybrid manager off) keeps every token's KV: full attention.
    """
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":  # several layers' specs of one type in one group
        kinds = {spec_kind(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else name
    return _KINDS.get(name, name)


@dataclass(frozen=True, slots=True)
class GroupSupport:
    """kvtier's answer for one ``KVCacheConfig``.

    ``kinds``: kind of each group, by group index. ``served``: index of the group whose blocks
    kvtier saves and loads, None when kvtier serves none (then it offers no hits and saves
    nothing). ``unserved``: ``(group index, kind)`` of each transferred group it cannot serve.
    ``block_size``: tokens per block of the served group (0: the engine's block size).
    ``layers``: with several groups, the served group's layer names, whose KV tensors alone the
    worker's layout covers (empty: every registered tensor).
    """

    kinds: tuple[str, ...]
    served: int | None
    unserved: tuple[tuple[int, str], ...]
    block_size: int = 0
    layers: tuple[str, ...] = ()

    @property
    def active(self) -> bool:
        return self.served is not None and not self.unserved

    @property
    def fits_without_hybrid(self) -> bool:
        """Whether vLLM could run this model with its hybrid manager off, every layer's KV then one
        full-attention group that kvtier serves (not so with Mamba state or unknown kinds)."""
        return all(kind in (FULL, SLIDING, CHUNKED_LOCAL) for _, kind in self.unserved)

    def describe(self) -> str:
        """The groups in words, e.g. ``group 0 full_attention, group 1 mamba (not served)``."""
        unserved = {g for g, _ in self.unserved}
        return ", ".join(f"group {g} {kind}" + (" (not served)" if g in unserved else "")
                         for g, kind in enumerate(self.kinds))


def group_support(kv_cache_config: Any) -> GroupSupport:
    """Classify ``kv_cache_config.kv_cache_groups`` (vLLM's ``KVCacheGroupSpec`` list).

    Served: the first transferred full-attention group, when it is the only transferred group.
    A second transferred group of any kind is unserved: chunk keys name no group yet, so two
    groups' blocks cannot be told apart in the tiers.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:  # nothing said: the engine's one group of full attention, all layers
        return GroupSupport((FULL,), 0, ())
    kinds = tuple(spec_kind(g.kv_cache_spec) for g in groups)
    transferred = [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)]
    served = next((i for i in transferred if kinds[i] in SERVED_KINDS), None)
    unserved = tuple((i, kinds[i]) for i in transferred if i != served)
    if served is None:
        return GroupSupport(kinds, None, unserved)
    spec = groups[served].kv_cache_spec
    layers = tuple(groups[served].layer_names) if len(groups) > 1 else ()  # one group: layers sharing KV too
    return GroupSupport(kinds, served, unserved, int(spec.block_size), layers)
