"""A consumer's probe of its HBM path to a producer, before it asks for any chunk (the why:
:mod:`kvtier.pd.hbm`): one READ of a block pays UCX's wire-up, a second times a READ's fixed
cost, a third of up to :data:`PROBE_BYTES` adds the bytes, and the path is judged direct or
emulated from the speed of the difference."""

from __future__ import annotations

import logging
import time

from kvtier.pd.consumer.fence import Fence
from kvtier.pd.hbm import Landing, RegionSpan, compatible, emulated, judge, judged, read_descriptors
from kvtier.pd.nixl import Agent, NixlError

logger = logging.getLogger(__name__)

PROBE_BYTES = 32 << 20  # bytes the timed READ of a probe moves, at most (a whole chunk of an 8B model: 32 MiB)


def direct_path(agent: Agent, peer: str, endpoint: str, mine: Landing, theirs: tuple[RegionSpan, ...],
                device: int, timeout_ms: int) -> bool:
    """Whether chunks from the producer at ``endpoint`` (NIXL peer ``peer``, its engine KV
    ``theirs`` on its CUDA device ``device``) may land HBM to HBM: the regions match, and the path
    is direct, probed on the first call per producer before any of its chunks is asked for (see
    the module docstring). ``mine``: this transfer's landing, whose first chunk's blocks the probe
    READs into. A probe that fails or times out (``timeout_ms``) says no."""
    timeout_s = timeout_ms / 1000
    if not compatible(mine.regions, theirs):
        return False
    if judged(endpoint, mine.kind):
        return not emulated(endpoint)
    target = next((ids for ids in mine.block_ids if ids), None)
    if target is None:
        return True  # nothing to probe into now: the first READs are timed instead
    block_bytes = sum(r.block_bytes for r in mine.regions)
    blocks = list(target[: max(1, min(len(target), PROBE_BYTES // max(1, block_bytes)))])
    memory = (mine.kind, mine.device, device)
    fence = Fence(agent, peer, endpoint)
    seconds = []
    try:
        # The first READ pays UCX's wire-up to the peer; a one-block READ then times what every READ
        # costs whatever its size (0.33's engine KV is one allocation, mapped per transfer: ~1 ms),
        # and the whole one adds the bytes: the path's speed is the difference.
        for count in (1, 1, len(blocks)):
            local, remote = read_descriptors(mine.regions, theirs, blocks[:count], list(range(count)))
            begin = time.perf_counter()
            read = fence.track(agent.read(peer, local, remote, memory, here=True))
            fence.wait(read, timeout_s)
            read.release()
            seconds.append(time.perf_counter() - begin)
    except (NixlError, ValueError) as exc:
        fence.settle(None, timeout_s)  # nothing else lands in those blocks while the READ may still run
        logger.warning("kvtier P/D: a test READ from %s failed (%s); its chunks come through the CPU tiers.",
                       endpoint, exc)
        judge(endpoint, 0.0)
        return False
    moved, spent = (len(blocks) - 1) * block_bytes, seconds[2] - seconds[1]
    if not moved:  # one block to READ into: its time, fixed cost and all
        moved, spent = block_bytes, seconds[2]
    judge(endpoint, moved / max(spent, 1e-9) / 1e9)
    return not emulated(endpoint)
