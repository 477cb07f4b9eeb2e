"""A load's chunks from a P/D producer: fetched, scattered one by one as they arrive, kept in the CPU tier.

Runs on a ``kvtier-remote`` thread of :class:`~kvtier.transfer.load.LoadSide` (its ``_load_remote``).
A chunk that came in a buffer is verified (its KVSUM64 while the copy scatters it; a chunk joined
here from verified pieces, :class:`~kvtier.pd.consumer.gather.Joined`, its header only), scattered and
stored; one the producer wrote straight into the engine's blocks (a :class:`~kvtier.jobs.Landed`)
is checked against the producer's KVSUM64 by :class:`~kvtier.transfer.landed.LandedCheck`. Pieces
of another TP size's ranks (:class:`~kvtier.pd.consumer.gather.Gathered`) are scattered straight
into the engine's head slices, each checked as it is copied, and stored as the pieces they are.
"""

from __future__ import annotations

import logging
from typing import Any

from kvtier import codec
from kvtier.jobs import Landed, LoadJob
from kvtier.ops import ChunkSpan
from kvtier.ops.span import PieceSpan
from kvtier.pd.consumer.gather import Gathered, Joined
from kvtier.shards import piece_layout
from kvtier.transfer import pieces

logger = logging.getLogger(__name__)

CHECK_AT = 16  # push: landed chunks checked as they come, at least this many a pass, one READ's in one pass


def remote_pass(side: Any, job: LoadJob, done: int, first: int, land: bool) -> tuple[int, int, bool]:
    """``side``'s (a :class:`~kvtier.transfer.load.LoadSide`) ``_load_remote`` from chunk ``first`` (``land``: into
    engine blocks); and whether one landed bad."""
    items = [(job.keys[i], side.num_blocks(job, i)) for i in range(first, len(job.keys))]
    remote, mismatch, held, count_chunks, chunks = job.remote, False, [], 0, None
    targets = _targets(side, job, done, first, land)
    landed: list[tuple[int, int, int, Landed]] = []  # (chunk, blocks loaded before it, its blocks, what came)
    ahead = side.landed.prepare(targets) if land else None  # the check, built while they are on their way
    try:
        chunks = side.fetch_remote(job, items, targets)
        for i, buffer in enumerate(chunks, start=first):
            joined = isinstance(buffer, Joined)  # sealed here from verified pieces: no second pass over it
            buffer = buffer.buffer if joined else buffer
            if done == len(job.block_ids):
                if not isinstance(buffer, Landed):
                    buffer.release()  # (a Gathered's pieces too)
                break
            num_blocks = side.num_blocks(job, i)
            if isinstance(buffer, Gathered):
                count = _scatter_pieces(side, job, i, done, buffer, held)
                if count is None:
                    break
                done, count_chunks = done + count, count_chunks + 1
                continue
            if isinstance(buffer, Landed):  # written straight into this engine's blocks: checked below
                count = side.span(job, i, done)[1]
                landed.append((i, done, count, buffer))
                done, count_chunks = done + count, count_chunks + 1
                if remote.wait and len(landed) >= CHECK_AT and not buffer.follows:  # while P computes the rest
                    checked, landed = side.landed.loaded(job, landed, done, count_chunks, side.ids, ahead), []
                    side.stats.landed_bytes += checked[2]
                    if checked[0] < done:  # a bad chunk: fetched again from there
                        done, count_chunks, mismatch = *checked[:2], True
                        break
                continue
            try:  # a KVSUM64 chunk is checked by the copy that scatters it (one pass, not two)
                fused = side.kernel_sums and codec.read_header(buffer.data).checksum_kind == codec.KVSUM64 and not joined
                header = codec.verify_chunk(buffer.data, side.layout, num_blocks, payload=not (fused or joined))
            except codec.ChunkError as exc:
                buffer.release()
                logger.warning("kvtier P/D: chunk %d of transfer %s from %s is unusable (%s); recomputing from there.",
                               i, remote.transfer_id, remote.endpoints[0], exc)
                break
            block, count = side.span(job, i, done)
            span = ChunkSpan(buffer.data, num_blocks, block, side.ids(job.block_ids[done : done + count]))
            intact = side.start_scatter([span], [header.checksum]).wait()[0] if fused else True
            if not fused:
                side._scatter(side.layout, [span])
            if side.load_stream is not None:
                side.load_stream.synchronize()  # the buffer is stored or freed next
            if not intact:  # its blocks hold garbage until vLLM recomputes them: not counted as loaded
                buffer.release()
                logger.warning("kvtier P/D: chunk %d of transfer %s from %s is unusable (payload KVSUM64 checksum "
                               "mismatch); recomputing from there.", i, remote.transfer_id, remote.endpoints[0])
                break
            done, count_chunks = done + count, count_chunks + 1
            if num_blocks == side.chunk_blocks:
                skey = side.skey(job.keys[i])
                side.store.put([skey], [buffer])  # takes the buffer; a key already stored is skipped
                held.append(skey)
            else:
                buffer.release()  # a prompt's partial tail: no later prompt can look it up
    except Exception as exc:  # kvtier.pd.PeerError, or the producer's socket failing under us
        logger.warning("kvtier P/D: transfer %s failed after %d of %d chunks (%s); recomputing the rest.",
                       remote.transfer_id, count_chunks, len(items), exc)
    finally:
        if chunks is not None:
            chunks.close()
    if landed:
        checked = side.landed.loaded(job, landed, done, count_chunks, side.ids, ahead)
        mismatch = mismatch or checked[0] < done
        done, count_chunks, nbytes = checked
        side.stats.landed_bytes += nbytes
    if held:
        side.on_held(held)
    return done, count_chunks, mismatch


def _scatter_pieces(side: Any, job: LoadJob, i: int, done: int, gathered: Gathered, held: list[bytes]) -> int | None:
    """Scatter chunk ``i``'s pieces into its blocks (``done`` loaded before it), each checked as it
    is copied, and store them (a whole chunk's: their keys join ``held``); the blocks loaded, or None
    when a piece failed its check (its blocks hold garbage until vLLM recomputes them)."""
    num_blocks = side.num_blocks(job, i)
    block, count = side.span(job, i, done)
    try:
        span = PieceSpan(tuple(zip(gathered.way, (b.data for b in gathered.buffers))), num_blocks, block,
                         side.ids(job.block_ids[done : done + count]))
        intact = side.start_scatter([span], [tuple(h.checksum for h in gathered.headers)]).wait()[0]
    except BaseException:  # its blocks count as not loaded (the caller's except): the pieces go back
        gathered.release()
        raise
    if not intact:  # which piece: each checked again, on this rare path only
        try:
            problems = [f"its piece of KV heads {heads[0]}-{heads[1]} from {endpoint} is unusable ({problem})"
                        for heads, endpoint, buffer in zip(gathered.way, gathered.endpoints, gathered.buffers)
                        if (problem := _problem(buffer, piece_layout(side.layout, heads), num_blocks))]
        finally:
            gathered.release()
        logger.warning("kvtier P/D: chunk %d of transfer %s: %s; recomputing from there.", i, job.remote.transfer_id,
                       "; ".join(problems) or "a piece failed its KVSUM64 checksum in the copy")
        return None
    if num_blocks == side.chunk_blocks:
        skeys = pieces.piece_keys(side.layout, job.keys[i], gathered.way)
        side.store.put(skeys, list(gathered.buffers))  # takes the buffers; keys already stored are skipped
        held += skeys
    else:
        gathered.release()  # a prompt's partial tail: no later prompt can look it up
    return count


def _problem(buffer: Any, layout: Any, num_blocks: int) -> str:
    try:
        codec.verify_chunk(buffer.data, layout, num_blocks)
    except codec.ChunkError as exc:
        return str(exc)
    return ""


def _targets(side: Any, job: LoadJob, done: int, first: int, land: bool) -> list[tuple[int, ...] | None]:
    """Per producer chunk of ``job`` from chunk ``first`` (``done`` blocks loaded before them): the engine
    blocks it may be written into directly (``land``), if all of it goes there (its checksum covers it all)."""
    targets: list[tuple[int, ...] | None] = []
    for i in range(first, len(job.keys)):
        block, count = side.span(job, i, done)
        whole = block == 0 and count == side.num_blocks(job, i) and land
        targets.append(tuple(job.block_ids[done : done + count]) if whole else None)
        done += count
    return targets
