"""What differs between the vLLM releases kvtier runs on (0.26 and 0.33 on CUDA, 0.32 on CPU).

The connector API's core methods have the same signatures across these releases; what moves is
around them: names that newer releases add (``CacheHitSource``, ``to_event_extra_keys``) and
optional hooks of ``KVConnectorBase_V1`` that the engine calls only when they exist. Everything
version-dependent is decided here, once, by looking at what the installed vLLM has, never by
comparing version numbers alone: a release newer than the last one tried works as long as the
names kvtier needs are there.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from vllm.v1.request import RequestStatus

MIN_VERSION = (0, 26)  # the oldest release whose connector API kvtier was run on
VERSION: str = getattr(vllm, "__version__", "unknown")

try:  # vLLM >= 0.32: per-source counts of cached prompt tokens (host, disk, p2p)
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None  # type: ignore[assignment,misc]

try:  # the hybrid KV cache manager's connector interface (0.26 and 0.32 both have it)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
except ImportError:
    SupportsHMA = None  # type: ignore[assignment,misc]

# Extra bases of the connector class: where SupportsHMA exists, vLLM keeps its hybrid manager on
# for kvtier and hands request_finished_all_groups every group's blocks.
HMA_BASES: tuple[type, ...] = () if SupportsHMA is None else (SupportsHMA,)

try:  # vLLM >= 0.32: finished and failed loads in one report (get_transfer_results); the scheduler
    # recomputes a failed_recving request itself
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
except ImportError:
    KVConnectorTransferResults = None  # type: ignore[assignment,misc]

try:  # vLLM >= 0.32: block-hash extra keys in the untagged form KV events publish
    from vllm.v1.core.kv_cache_utils import to_event_extra_keys
except ImportError:
    def to_event_extra_keys(extra_keys: Iterable[tuple[Any, ...] | None] | None) -> list | None:
        """Older releases publish extra keys exactly as the block hash uses them."""
        keys = list(extra_keys or ())
        return keys or None


def release(version: str = VERSION) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``0.26.0``, ``0.32.0+cpu`` or ``0.27.0rc1.dev5``."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        parts.append(int(digits) if digits else 0)
    return (parts + [0, 0])[0], (parts + [0, 0])[1]


def check_version(version: str = VERSION) -> None:
    """Raise one sentence when ``version`` is older than kvtier's connector API needs."""
    if version != "unknown" and release(version) < MIN_VERSION:
        raise RuntimeError(
            f"kvtier needs vLLM {MIN_VERSION[0]}.{MIN_VERSION[1]} or newer (its KV connector API); "
            f"this is vLLM {version}: upgrade vLLM, or remove kv_connector='kvtier'."
        )


def has_hook(name: str) -> bool:
    """Whether this vLLM's connector base class defines hook ``name`` (so the engine may call it)."""
    return callable(getattr(KVConnectorBase_V1, name, None))


# vLLM >= 0.32 asks the connector whether it restores Mamba state that lags the full-attention
# hit; one that does not gets the hit every group holds. Older releases do not ask.
ASKS_DIVERGENT_HITS = hasattr(KVConnectorBase_V1, "supports_divergent_local_hybrid_hits")


def boundary_states(scheduler_output: Any) -> dict[str, list[tuple[int, int, int]]]:
    """The Mamba states this step's forward writes where vLLM keeps them for prefix caching, per
    request: ``(KV cache group id, block id, tokens)`` (vLLM >= 0.32's
    ``kv_connector_block_state.boundary_state_offloads``; empty on older releases). A model whose
    Mamba layers store a prefill checkpoint (Granite-4, Nemotron-H) writes the state at the
    prompt's last block boundary inside a step that runs on past it, so no step ends there."""
    state = getattr(scheduler_output, "kv_connector_block_state", None)
    return getattr(state, "boundary_state_offloads", None) or {}


def calling_scheduler(attribute: str) -> Any | None:
    """The vLLM scheduler on the call stack (the nearest ``self`` having ``attribute``), or None.
    vLLM hands its connector no scheduler; the one calling the connector's hook is it."""
    frame = sys._getframe(2)
    while frame is not None and not hasattr(frame.f_locals.get("self"), attribute):
        frame = frame.f_back
    return None if frame is None else frame.f_locals["self"]


class AgreedHits:
    """Makes a vLLM 0.26 scheduler admit a Mamba-hybrid request at the prefix every KV cache group
    holds. Install with :func:`agree_on_hybrid_hits`.

    vLLM 0.26 with any connector admits such a request at its longest per-group hit
    (``find_longest_cache_hit_per_group``), the full-attention group's, counting on the connector
    to bring the Mamba state of that position (NIXL's consumer always does). Where the Mamba group
    caches no state there (in ``align`` mode it caches states only where a step ended) and the
    connector adds no tokens, the request's Mamba layers start from the null block: a wrong answer.
    Later releases ask the connector (``supports_divergent_local_hybrid_hits``) and, as kvtier does
    not restore that state, take the hit every group holds, as a connector-less engine does; this
    gives the 0.26 scheduler's coordinator that answer.

    That path also zeroes the request's ``shared_prefix_boundary`` (where a connector-less engine
    ends a prefill step so the Mamba state of a shared prefix is cached);
    :meth:`restore_junction` puts it back, so the prefill runs in the same steps as without a
    connector.
    """

    def __init__(self, coordinator: Any):
        self._coordinator = coordinator
        self._last: tuple[object, int] | None = None  # (block hashes asked about, their junction)
        coordinator.find_longest_cache_hit_per_group = self.per_group

    def per_group(self, block_hashes: list, max_cache_hit_length: int) -> tuple[tuple[list, ...], tuple[int, ...]]:
        """The coordinator's own reconciled hit, given to every group."""
        blocks, hit, *rest = self._coordinator.find_longest_cache_hit(block_hashes, max_cache_hit_length)
        uncached = rest[0] if rest else 0
        self._last = (block_hashes, hit + uncached if uncached else 0)  # as get_computed_blocks computes it
        return blocks, (hit,) * len(blocks)

    def restore_junction(self, request: Any) -> None:
        """Give ``request`` (just looked up) the shared-prefix junction a connector-less engine sets."""
        last, self._last = self._last, None
        if last is not None and last[0] is request.block_hashes and hasattr(request, "shared_prefix_boundary"):
            request.shared_prefix_boundary = last[1]


def agree_on_hybrid_hits() -> AgreedHits | None:
    """Install :class:`AgreedHits` on the calling scheduler's coordinator where the release admits
    Mamba hybrids at the attention group's hit (it does not ask the connector, and has the
    per-group lookup); None elsewhere, where the scheduler is not looked for either."""
    if ASKS_DIVERGENT_HITS:
        return None
    scheduler = calling_scheduler("kv_cache_manager")
    coordinator = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
    if not hasattr(coordinator, "find_longest_cache_hit_per_group"):
        return None
    return AgreedHits(coordinator)


def recompute_failed_loads(req_ids: set[str]) -> None:
    """Make the engine recompute the whole prompt of each request in ``req_ids``, whose load failed.

    Releases without ``KVConnectorTransferResults`` (0.26) only: later ones take the failed
    requests from the connector's ``get_transfer_results`` (``failed_recving``) and do this
    themselves. Called from the connector's ``update_connector_output``, which vLLM's scheduler
    calls just before it takes the step's finished loads. For a model of several KV cache groups
    vLLM takes no invalid block ids (0.26 fails on them), so kvtier does here what vLLM does itself
    for a failed asynchronous load with no valid prefix: the request's computed tokens go to 0 and
    it is marked failed, so that, when its load reports finished, the scheduler frees its blocks
    and admits it afresh. vLLM hands its connector no scheduler: the caller found on the stack is it.
    """
    scheduler = calling_scheduler("failed_recving_kv_req_ids")
    if scheduler is None:
        raise RuntimeError("kvtier: a hybrid model's KV load failed and no vLLM scheduler was found to recompute "
                           f"requests {sorted(req_ids)}; this vLLM release is not supported for hybrid models.")
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:  # vLLM's own rule
            request.num_computed_tokens = 0
            scheduler.failed_recving_kv_req_ids.add(req_id)
